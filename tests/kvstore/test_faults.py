"""Faults and bad input: every one gives a named error, nothing hangs, the store survives."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from oasiskv.kvstore import (
    BlockOutOfRange,
    InvalidArgument,
    KVLayout,
    KVStoreServer,
    RequestExists,
    StoreFull,
    StoreTimeout,
    StoreUnavailable,
    UnknownRequest,
    connect,
)
from oasiskv.kvstore.nixl_transport import nixl_available
from oasiskv.kvstore.protocol import MAGIC, PREFIX, recv_frame_header, send_frame

from .conftest import REMOTE_TRANSPORTS, TRANSPORTS, transport_param
from .helpers import LAYOUT, random_request_blocks, store_process


def rid() -> str:
    return f"f-{uuid.uuid4().hex[:8]}"


def unit_buffer(n: int = 4) -> torch.Tensor:
    return torch.zeros(n, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)


# --- bad requests, every transport ---------------------------------------------------------


def test_unknown_request_everywhere(client):
    missing = rid()
    for call in (
        lambda: client.read_blocks(missing, 0, 0, 0, unit_buffer()).wait(),
        lambda: client.write_blocks(missing, 0, 0, 0, unit_buffer()).wait(),
        lambda: client.read_summaries(missing),
        lambda: client.extend(missing, 100),
        lambda: client.describe(missing),
        lambda: client.free(missing),
    ):
        with pytest.raises(UnknownRequest, match=missing):
            call()
    assert client.touch([missing]) == [missing]


def test_freed_request_is_unknown(client):
    request = rid()
    client.allocate(request, LAYOUT, 32)
    client.read_blocks(request, 0, 0, 0, unit_buffer()).wait()
    client.free(request)
    with pytest.raises(UnknownRequest):
        client.read_blocks(request, 0, 0, 0, unit_buffer()).wait()
    with pytest.raises(UnknownRequest):
        client.free(request)


def test_out_of_range_indices(client):
    request = rid()
    client.allocate(request, LAYOUT, 40)  # 3 blocks
    buffer = unit_buffer(4)
    cases = [
        ((LAYOUT.num_layers, 0, 0), "layer"),
        ((0, LAYOUT.num_kv_heads, 0), "kv_head"),
        ((0, 0, 3), "block"),
        ((0, 0, -1), "block"),
        ((0, 0, 2**40), "block"),
        ((-1, 0, 0), "layer"),
    ]
    for (layer, head, block), kind in cases:
        with pytest.raises(BlockOutOfRange, match=kind):
            client.read_blocks(request, [0, layer], [0, head], [0, block], buffer).wait()
        with pytest.raises(BlockOutOfRange, match=kind):
            client.write_blocks(request, layer, head, block, buffer).wait()
    with pytest.raises(BlockOutOfRange, match="slot"):
        client.read_blocks(request, 0, 0, [0, 1], buffer, [0, 4]).wait()
    with pytest.raises(BlockOutOfRange):
        client.read_summaries(request, first_block=2, num_blocks=5)
    # Still fine afterwards.
    client.read_blocks(request, 0, 0, [0, 1, 2], buffer).wait()
    client.free(request)


def test_bad_arguments(client):
    request = rid()
    client.allocate(request, LAYOUT, 32)
    with pytest.raises(RequestExists):
        client.allocate(request, LAYOUT, 32)
    with pytest.raises(InvalidArgument, match="block_size"):
        client.allocate(rid(), KVLayout(2, 2, 32, block_size=32), 64)
    with pytest.raises(InvalidArgument):
        client.write_layer(request, 0, torch.zeros(2, LAYOUT.num_kv_heads, 2, 16, LAYOUT.head_dim))  # float32
    with pytest.raises(InvalidArgument):
        client.read_blocks(request, 0, 0, [0, 1], unit_buffer(4)[:, 0])  # not contiguous
    with pytest.raises(InvalidArgument):
        client.read_blocks(request, 0, [0, 1], [0, 1, 0], unit_buffer())
    with pytest.raises(InvalidArgument):
        client.extend(request, 10)  # cannot shrink
    with pytest.raises(InvalidArgument):
        client.allocate("", LAYOUT, 16)
    with pytest.raises(InvalidArgument, match="float16"):
        client.read_summaries(request, dtype=torch.float16)
    # Raw bytes of another dtype were taken as the request's KV (fp32 written into bf16).
    wrong = torch.zeros(2, *LAYOUT.unit_shape[:-1], LAYOUT.head_dim // 2, dtype=torch.float32)  # same bytes a unit
    for call in (client.write_blocks, client.read_blocks):
        with pytest.raises(InvalidArgument, match="the request's KV is torch.bfloat16, the buffer is torch.float32"):
            call(request, 0, 0, [0, 1], wrong)
    client.read_blocks(request, 0, 0, [0, 1], unit_buffer(2).view(torch.uint8)).wait()  # raw bytes, said so
    client.free(request)


# --- a full store ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_server():
    srv = KVStoreServer(capacity_bytes=16 * LAYOUT.chunk_bytes, prefault=False, ttl_s=0.3)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(params=[transport_param(t) for t in TRANSPORTS])
def small_client(request, small_server):
    c = connect(small_server, transport=request.param, timeout=10)
    yield c
    c.close()


def test_full_store_refuses_with_needed_and_free_bytes(small_client):
    held = rid()
    small_client.allocate(held, LAYOUT, 10 * 16)
    with pytest.raises(StoreFull) as info:
        small_client.allocate(rid(), LAYOUT, 7 * 16)
    err = info.value
    assert err.needed_bytes == 7 * LAYOUT.chunk_bytes
    assert err.free_bytes == 6 * LAYOUT.chunk_bytes
    assert "need" in str(err) and str(err.free_bytes) in str(err)
    with pytest.raises(StoreFull):
        small_client.extend(held, 17 * 16)
    # A refusal leaves everything as it was; what fits is still admitted.
    ok = rid()
    small_client.allocate(ok, LAYOUT, 6 * 16)
    assert small_client.stats().free_bytes == 0
    small_client.free(ok)
    small_client.free(held)
    assert small_client.stats().used_bytes == 0


def test_ttl_frees_abandoned_requests_and_touch_keeps_them(small_client):
    abandoned, kept = rid(), rid()
    small_client.allocate(abandoned, LAYOUT, 16)
    small_client.allocate(kept, LAYOUT, 16)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        small_client.read_blocks(kept, 0, 0, 0, unit_buffer()).wait()  # reads refresh the TTL
        time.sleep(0.05)
    time.sleep(0.05)
    with pytest.raises(UnknownRequest):
        small_client.read_blocks(abandoned, 0, 0, 0, unit_buffer()).wait()
    assert small_client.touch([kept, abandoned]) == [abandoned]
    small_client.free(kept)


@pytest.mark.skipif(not nixl_available(), reason="nixl not importable")
def test_nixl_client_learns_that_another_client_freed_a_request(server):
    owner = connect(server, transport="tcp")
    reader = connect(server, transport="nixl")
    try:
        request = rid()
        owner.allocate(request, LAYOUT, 32)
        reader.read_blocks(request, 0, 0, 0, unit_buffer()).wait()  # caches the block table
        owner.free(request)
        for _ in range(200):  # the store's notification arrives within milliseconds
            try:
                reader.read_blocks(request, 0, 0, 0, unit_buffer()).wait()
            except UnknownRequest:
                break
            time.sleep(0.005)
        else:
            pytest.fail("the reader kept reading a freed request")
    finally:
        owner.close()
        reader.close()


# --- malformed and truncated frames ------------------------------------------------------


@pytest.fixture(scope="module")
def strict_server():
    srv = KVStoreServer(capacity_bytes=4 << 20, prefault=False, frame_timeout_s=0.5, transport="tcp")
    srv.start()
    yield srv
    srv.stop()


def raw_socket(server: KVStoreServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return sock


def assert_store_serves(server: KVStoreServer) -> None:
    with connect(server.address, transport="tcp", timeout=5) as c:
        request = rid()
        c.allocate(request, LAYOUT, 16)
        src = random_request_blocks(1, LAYOUT, 16)
        c.write_request(request, src).wait()
        out = torch.zeros_like(src)
        c.read_blocks(request, *np.indices(src.shape[:3]).reshape(3, -1)[[0, 2, 1]], out.view(-1, *LAYOUT.unit_shape)).wait()
        assert torch.equal(out, src)
        c.free(request)


def errors(server: KVStoreServer, kind: str) -> float:
    return server.metrics.registry.get_sample_value("oasiskv_kvstore_errors_total", {"type": kind}) or 0.0


def open_connections(server: KVStoreServer) -> float:
    return server.metrics.registry.get_sample_value("oasiskv_kvstore_connections")


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_truncated_frames_do_not_hurt_the_store(strict_server):
    before = errors(strict_server, "ProtocolError")
    # Header cut short, then the client vanishes.
    sock = raw_socket(strict_server)
    sock.sendall(PREFIX.pack(MAGIC, 100, 0) + b'{"op": "pi')
    sock.close()
    # Prefix cut short.
    sock = raw_socket(strict_server)
    sock.sendall(MAGIC + b"\x00")
    sock.close()
    # A write whose data stops midway: the request must stay usable (no pin left behind).
    with connect(strict_server.address, transport="tcp") as c:
        request = rid()
        c.allocate(request, LAYOUT, 64)
        sock = raw_socket(strict_server)
        idx = np.zeros(3 * 4, dtype="<i4").tobytes()
        head = json.dumps({"op": "write", "rid": request, "n": 4, "seq": 1}).encode()
        sock.sendall(PREFIX.pack(MAGIC, len(head), len(idx) + 4 * LAYOUT.unit_bytes) + head + idx + b"x" * 1000)
        sock.close()
        time.sleep(0.2)
        c.free(request)
        assert c.stats().used_bytes == 0
    deadline = time.monotonic() + 2
    while errors(strict_server, "ProtocolError") < before + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert errors(strict_server, "ProtocolError") >= before + 3
    assert_store_serves(strict_server)


def test_stalled_frame_is_dropped_after_the_frame_timeout(strict_server):
    sock = raw_socket(strict_server)
    sock.sendall(PREFIX.pack(MAGIC, 50, 0) + b"{")
    start = time.monotonic()
    sock.settimeout(5)
    data = b""
    try:
        while chunk := sock.recv(4096):  # the error frame, then EOF
            data += chunk
    except ConnectionResetError:
        pass
    assert time.monotonic() - start < 3
    sock.close()
    assert_store_serves(strict_server)


def test_garbage_and_unknown_ops_get_error_frames(strict_server):
    sock = raw_socket(strict_server)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    reply, payload = recv_frame_header(sock, 5)
    assert reply["ok"] is False and reply["error"]["type"] == "ProtocolError"
    sock.close()

    sock = raw_socket(strict_server)
    sock.sendall(PREFIX.pack(MAGIC, 1 << 30, 0))  # oversized header
    reply, _ = recv_frame_header(sock, 5)
    assert reply["error"]["type"] == "ProtocolError"
    sock.close()

    sock = raw_socket(strict_server)
    send_frame(sock, {"op": "teleport", "seq": 1})
    reply, _ = recv_frame_header(sock, 5)
    assert reply["error"]["type"] == "InvalidArgument" and reply["seq"] == 1
    send_frame(sock, {"op": "allocate", "seq": 2})  # missing fields
    reply, _ = recv_frame_header(sock, 5)
    assert reply["error"]["type"] == "InvalidArgument"
    send_frame(sock, {"op": "read", "rid": "nope", "n": 5, "seq": 3}, [b"\x00" * 7])  # short payload
    reply, _ = recv_frame_header(sock, 5)
    assert reply["ok"] is False
    sock.close()

    sock = raw_socket(strict_server)
    send_frame(sock, {"op": "allocate", "rid": "narrow", "seq": 4, "layout": LAYOUT.to_wire(), "num_tokens": 16})
    assert recv_frame_header(sock, 5)[0]["ok"] is True
    send_frame(sock, {"op": "summaries", "rid": "narrow", "dtype": "int8", "seq": 5})
    reply, _ = recv_frame_header(sock, 5)
    assert reply["error"]["type"] == "InvalidArgument" and "int8" in reply["error"]["message"]
    sock.close()
    assert_store_serves(strict_server)


# --- store gone, restarted, or silent -------------------------------------------------------


@pytest.mark.parametrize("transport", [transport_param(t) for t in REMOTE_TRANSPORTS])
def test_restarted_store_gives_clear_errors(transport):
    with store_process() as (proc, address):
        client = connect(address, transport=transport, timeout=3)
        request = rid()
        client.allocate(request, LAYOUT, 32)
        client.read_blocks(request, 0, 0, 0, unit_buffer()).wait()
        port = int(address.rsplit(":", 1)[1])
        proc.terminate()
        proc.wait(10)
        # Store down: a clear error, fast.
        start = time.monotonic()
        with pytest.raises((StoreUnavailable,)):
            client.describe(request)
        with pytest.raises(StoreUnavailable):
            client.read_blocks(request, 0, 0, 0, unit_buffer()).wait()
        assert time.monotonic() - start < 5
    with store_process(port=port) as (_proc, address2):
        assert address2 == address
        # Same address, new process: the old request is unknown, new ones work.
        start = time.monotonic()
        with pytest.raises(UnknownRequest):
            client.read_blocks(request, 0, 0, 0, unit_buffer()).wait()
        assert time.monotonic() - start < 5
        fresh = rid()
        client.allocate(fresh, LAYOUT, 16)
        src = random_request_blocks(2, LAYOUT, 16)
        client.write_request(fresh, src).wait()
        out = unit_buffer(1)
        client.read_blocks(fresh, 1, 1, 0, out).wait()
        assert torch.equal(out[0], src[1, 0, 1])
        client.close()


def test_unreachable_store():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="cannot connect"):
        connect(f"127.0.0.1:{port}", transport="tcp", timeout=2)
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:65536", "127.0.0.1:0", ("127.0.0.1", 70000)])
def test_a_port_out_of_range_is_refused_not_wrapped(address):
    """The socket layer takes a port modulo 2**16: 127.0.0.1:99999 connected to port 34463."""
    with pytest.raises(InvalidArgument, match=r"port must be in \[1, 65535\]"):
        connect(address, transport="tcp", timeout=2)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "5"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout):
    with pytest.raises(InvalidArgument, match="timeout must be a positive number"):
        connect("127.0.0.1:7300", transport="tcp", timeout=timeout)


def test_silent_store_times_out():
    """A peer that accepts connections but never answers: StoreTimeout, not a hang."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(StoreTimeout):
            connect(f"127.0.0.1:{listener.getsockname()[1]}", transport="tcp", timeout=0.5)
        assert time.monotonic() - start < 3
    finally:
        stop.set()
        thread.join()
        for sock in accepted:
            sock.close()
        listener.close()


def test_stopped_server_while_connected(client):
    if client.transport_name == "inproc":
        pytest.skip("no connection to lose in-process")
    srv = KVStoreServer(capacity_bytes=4 << 20, prefault=False)
    srv.start()
    c = connect(srv.address, transport=client.transport_name, timeout=3)
    request = rid()
    c.allocate(request, LAYOUT, 16)
    srv.stop()
    with pytest.raises(StoreUnavailable):
        c.describe(request)
    c.close()


def test_id_reused_for_another_geometry_is_refused_not_overrun(server, client):
    """Another client frees an id and allocates it again with bigger units: this client's
    cached layout is stale, and its reads must fail cleanly instead of overrunning its buffer."""
    request = rid()
    client.allocate(request, LAYOUT, 32)
    backing = unit_buffer(4)
    small = backing[:2]  # what follows it must never be written
    client.read_blocks(request, 0, 0, [0, 1], small).wait()
    bigger = KVLayout(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim * 4)
    with connect(server, transport="tcp") as other:
        other.free(request)
        other.allocate(request, bigger, 32)
    for _ in range(200):  # NIXL learns about the free from the store's notice, within milliseconds
        try:
            client.read_blocks(request, 0, 0, [0, 1], small).wait()
        except InvalidArgument as exc:
            assert "units" in str(exc)
            break
        time.sleep(0.005)
    else:
        pytest.fail("stale layout not detected")
    assert backing[2:].abs().sum() == 0
    client.free(request)


def test_transfers_a_closed_tcp_client_never_ran_fail_with_a_store_error(server):
    """They raised concurrent.futures.CancelledError, which callers catching KVStoreError missed."""
    before = open_connections(server)
    client = connect(server, transport="tcp", timeout=10)
    request = rid()
    client.allocate(request, LAYOUT, 32)
    src = torch.randn(2, *LAYOUT.unit_shape).to(LAYOUT.dtype)
    handles = [client.write_blocks(request, 0, 0, [0, 1], src) for _ in range(64)]
    client.close()
    outcomes = []
    for handle in handles:
        try:
            handle.wait()
            outcomes.append("done")
        except StoreUnavailable as exc:
            assert "closed before this transfer" in str(exc)
            outcomes.append("unavailable")
    assert "unavailable" in outcomes  # some were still queued at close
    # Its connection is closed too: the _drop queued behind those transfers was cancelled with
    # them, and the socket stayed open (the store kept the connection) until GC.
    assert client.transport._sock is None
    assert wait_until(lambda: open_connections(server) <= before)
    with connect(server, transport="tcp") as other:
        other.free(request)


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not importable here")
def test_a_start_that_fails_leaves_no_nixl_agent_running():
    """A port in use left the NIXL agent's poll thread behind at every try (and the command
    sometimes aborted at exit, rc 134)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = {t.name for t in threading.enumerate()}
        for _ in range(3):
            server = KVStoreServer(capacity_bytes=4 << 20, port=port, prefault=False, transport="nixl")
            with pytest.raises(OSError):
                server.start()
        assert [t.name for t in threading.enumerate() if t.name not in before and t.is_alive()] == []


@pytest.mark.skipif(not nixl_available(), reason="nixl not importable")
def test_a_second_nixl_client_with_a_taken_name_is_refused_by_name(server):
    first = connect(server.address, transport="nixl", name=f"worker-{uuid.uuid4().hex[:6]}")
    try:
        with pytest.raises(InvalidArgument, match="already connected to this store"):
            connect(server.address, transport="nixl", name=first.transport.client_name)
        request = rid()
        first.allocate(request, LAYOUT, 16)
        first.read_blocks(request, 0, 0, 0, unit_buffer()).wait()  # the first client is unharmed
        first.free(request)
    finally:
        first.close()
