"""StoreDirectory's first connects: a store that does not answer holds up only the connects
to itself. `connect` is replaced by one that blocks for one address (a frozen store), so the
test checks the directory's locking alone."""

from __future__ import annotations

import concurrent.futures
import threading

from oasiskv.decode_node import store_directory
from oasiskv.decode_node.store_directory import StoreDirectory


class _Client:
    def __init__(self, address: str):
        self.address = address
        self.registered = []

    def register(self, buffer) -> None:
        self.registered.append(buffer)


def _connects_blocking_for(frozen: str, release: threading.Event, calls: list[str]):
    def connect(address, transport, timeout):
        calls.append(address)
        if address == frozen:
            release.wait(10)
        return _Client(address)

    return connect


def test_a_store_that_does_not_answer_holds_up_only_the_connects_to_itself(monkeypatch):
    release, calls = threading.Event(), []
    monkeypatch.setattr(store_directory, "connect", _connects_blocking_for("frozen:1", release, calls))
    directory = StoreDirectory()
    directory.register("buffer")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        frozen = pool.submit(directory.client_for, "frozen:1")
        try:
            healthy = pool.submit(directory.client_for, "healthy:1").result(timeout=2)
            assert healthy.address == "healthy:1" and healthy.registered == ["buffer"]
            assert not frozen.done()
        finally:
            release.set()
        assert frozen.result(timeout=5).address == "frozen:1"


def test_threads_that_ask_for_one_new_store_together_share_one_connect(monkeypatch):
    release, calls = threading.Event(), []
    monkeypatch.setattr(store_directory, "connect", _connects_blocking_for("slow:1", release, calls))
    directory = StoreDirectory()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(directory.client_for, "slow:1") for _ in range(4)]
        release.set()
        clients = [f.result(timeout=5) for f in futures]
    assert calls == ["slow:1"]
    assert all(client is clients[0] for client in clients)
