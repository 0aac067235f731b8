"""What `oasiskv serve` refuses before Ray starts: each was found only after Ray and every worker
had started (half a minute), or never (an --address nobody answers was retried for good)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from oasiskv.cluster.launcher import ClusterUnreachable, check_cluster_answers
from oasiskv.cluster.server import PortUnavailable, require_free_port


def _serve(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oasiskv.cluster.cli", "serve", *argv],
                          capture_output=True, text=True, timeout=timeout)


def test_a_port_in_use_is_refused_before_anything_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortUnavailable, match=f"cannot listen on 127.0.0.1:{port}"):
            require_free_port("127.0.0.1", port)
        started = time.monotonic()
        done = _serve("--port", str(port))
    assert done.returncode == 2 and f"error: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Ray" not in done.stderr and time.monotonic() - started < 60
    require_free_port("127.0.0.1", port)  # free again once the other listener has gone


def test_an_address_where_no_ray_head_answers_fails_fast():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nobody listens there once the probe is closed
    with pytest.raises(ClusterUnreachable, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        check_cluster_answers(f"127.0.0.1:{port}", timeout_s=5)
    with pytest.raises(ClusterUnreachable, match="HOST:PORT"):
        check_cluster_answers("127.0.0.1:99999")
    check_cluster_answers("auto")  # Ray's own lookup; not probed here
    done = _serve("--address", f"127.0.0.1:{port}")
    assert done.returncode == 2 and "no Ray cluster answers" in done.stderr


def test_an_address_that_answers_but_is_not_a_ray_head_fails_fast():
    """A web server's port (a dashboard's, say) or a silent listener accepted the connection, and
    ray.init then retried for good, logging every 30 s."""
    import http.server
    import threading

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{web.server_address[1]}"
        with pytest.raises(ClusterUnreachable, match=f"{address} answers, but not as a Ray head's GCS"):
            check_cluster_answers(address, timeout_s=5)
        done = _serve("--address", address, timeout=60)
        assert done.returncode == 2 and "not as a Ray head's GCS (gRPC) port" in done.stderr, done.stderr[-2000:]
    finally:
        web.shutdown()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started = time.monotonic()
        with pytest.raises(ClusterUnreachable, match="not as a Ray head's GCS"):
            check_cluster_answers(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=1)
        assert time.monotonic() - started < 5


def _settings_answering_server(family=socket.AF_INET, host="127.0.0.1"):
    """A listener that answers each connection's HTTP/2 preface with a SETTINGS frame, as any gRPC
    server (a Ray GCS) does; its port."""
    import threading

    server = socket.socket(family)
    server.bind((host, 0))
    server.listen()

    def serve():
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                connection.recv(64)
                connection.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_port_that_answers_as_grpc_passes_in_every_address_form():
    """The probe must let a Ray GCS through (tests/cluster/test_multi_node.py joins a real one), as
    HOST:PORT with an IPv4 address, a name, or an IPv6 address in brackets as Ray writes it."""
    with _settings_answering_server() as server:
        port = server.getsockname()[1]
        check_cluster_answers(f"127.0.0.1:{port}", timeout_s=5)
        check_cluster_answers(f"localhost:{port}", timeout_s=5)
    if socket.has_ipv6:
        try:
            server = _settings_answering_server(socket.AF_INET6, "::1")
        except OSError:
            return  # no IPv6 loopback here
        with server:
            check_cluster_answers(f"[::1]:{server.getsockname()[1]}", timeout_s=5)


def test_a_port_that_resets_the_probe_is_said_to_answer_but_not_as_ray():
    import threading

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def reset_once():
            connection, _ = server.accept()
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            connection.recv(5)
            connection.close()  # with linger 0: a reset

        threading.Thread(target=reset_once, daemon=True).start()
        with pytest.raises(ClusterUnreachable, match="answers, but not as a Ray head's GCS"):
            check_cluster_answers(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=5)


def test_a_ray_client_address_without_ray_client_is_a_message_not_a_traceback():
    import importlib.util

    if importlib.util.find_spec("grpc") is not None:  # ray[client]: without it ray:// is refused at once
        pytest.skip("ray[client] is installed here: ray:// would try to connect")
    done = _serve("--address", "ray://127.0.0.1:1", timeout=120)
    assert done.returncode == 2 and "cannot join the Ray cluster at --address ray://127.0.0.1:1" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_draft_model_that_does_not_exist_is_named_before_ray_starts():
    started = time.monotonic()
    done = _serve("--drafter", "nosuch", "--port", "0")
    assert done.returncode == 2 and "unknown model 'nosuch'" in done.stderr, done.stderr[-2000:]
    assert "decode-0 failed to start" not in done.stderr  # refused by the head, not by a worker
    assert time.monotonic() - started < 60


def test_a_store_that_cannot_allocate_its_arena_is_named_without_a_traceback():
    done = _serve("--store-capacity-gb", "100000", "--port", "0", timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: store-0 failed to start (capacity 100000 GB" in done.stderr
    assert "Traceback" not in done.stderr


def test_workers_ray_cannot_place_are_named_when_the_start_timeout_runs_out():
    """`--placement resources` on a Ray cluster with no node offering the roles' resources (a
    Kubernetes worker group whose pods are not scheduled): launch() used to wait 600 s per role,
    past the chart's head startup probe, and then fail with Ray's bare GetTimeoutError."""
    started = time.monotonic()
    done = _serve("--placement", "resources", "--start-timeout-s", "5", "--port", "0", timeout=180)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: store-0 not ready 5 s after serve began starting the cluster (--start-timeout-s)" in done.stderr
    assert "no node offers oasiskv_store" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 120
    invalid = _serve("--start-timeout-s", "0", "--port", "0")
    assert invalid.returncode == 2 and "--start-timeout-s: " in invalid.stderr
