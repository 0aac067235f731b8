"""The standalone command and the configuration model."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
from pydantic import ValidationError

from oasiskv.kvstore import KVStoreConfig

from .helpers import REPO_ROOT, store_process


def test_config_defaults_and_validation():
    config = KVStoreConfig()
    assert config.capacity_bytes == 1 << 30 and config.block_size == 16 and config.transport == "nixl"
    assert KVStoreConfig(capacity_gb=0.5).capacity_bytes == 1 << 29
    for bad in ({"capacity_bytes": 0}, {"port": 70000}, {"transport": "carrier-pigeon"}, {"ttl_s": -1}, {"capacity": 5}):
        with pytest.raises(ValidationError):
            KVStoreConfig(**bad)


def test_command_serves_metrics_and_stops_cleanly_on_sigterm():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    with store_process("--metrics-port", str(metrics_port), "--transport", "tcp") as (proc, address):
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert "oasiskv_kvstore_capacity_bytes" in text and "oasiskv_kvstore_free_bytes" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_command_rejects_bad_configuration():
    result = subprocess.run([sys.executable, "-m", "oasiskv.kvstore", "--capacity-gb", "-1"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--capacity-gb: " in result.stderr
    assert result.stderr.count("\n") == 1 and "pydantic.dev" not in result.stderr  # one line, naming the field
    for capacity in ("inf", "1e12"):  # OverflowError tracebacks from inside the allocator
        result = subprocess.run([sys.executable, "-m", "oasiskv.kvstore", "--capacity-gb", capacity], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "--capacity-gb: " in result.stderr and "Traceback" not in result.stderr


def test_a_port_in_use_is_named_in_the_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "oasiskv.kvstore", "--port", str(port), "--transport", "tcp",
                                 "--capacity-gb", "0.01"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"cannot start a 0.01 GiB store on 127.0.0.1:{port}" in result.stderr
    assert f"--port {port} is in use" in result.stderr


def test_a_metrics_port_in_use_is_the_one_named():
    """Both ports bind at start, and the message did not say which one was taken."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "oasiskv.kvstore", "--port", "0", "--metrics-port", str(port),
                                 "--transport", "tcp", "--capacity-gb", "0.01"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=60)
    assert result.returncode == 1 and f"--metrics-port {port} is in use" in result.stderr


@pytest.mark.parametrize("argv, named", [
    (["--port", "7399", "--metrics-port", "7399"], "--metrics-port (7399) is the store's own port"),
    (["--capacity-gb", "1e-9"], "--capacity-gb (1e-09) is under one 4096-byte chunk"),
    (["--log-level", "chatty"], "argument --log-level: invalid choice: 'CHATTY'"),
])
def test_settings_the_store_cannot_run_with_are_refused_before_it_starts(argv, named):
    """Each was accepted: the ports failed as 'address in use' when the store started, the tiny
    arena as an error of starting it, and an unknown log level ran at WARNING."""
    result = subprocess.run([sys.executable, "-m", "oasiskv.kvstore", *argv], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and named in result.stderr, result.stderr
