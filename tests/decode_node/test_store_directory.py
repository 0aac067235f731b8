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


class _ClosingClient(_Client):
    def __init__(self, address: str):
        super().__init__(address)
        self.closed = 0
        self.freed = []

    def close(self) -> None:
        self.closed += 1

    def free(self, request_id) -> None:
        self.freed.append(request_id)


def _directory(monkeypatch) -> StoreDirectory:
    monkeypatch.setattr(store_directory, "connect", lambda address, transport, timeout: _ClosingClient(address))
    return StoreDirectory()


def test_the_client_of_a_store_that_moved_closes_when_its_last_request_is_freed(monkeypatch):
    directory = _directory(monkeypatch)
    closed = []
    directory.closed_listeners.append(closed.append)
    directory.bind("a", "old:1")
    directory.bind("b", "old:1")
    old = directory.client_for("old:1")
    assert directory.retire("old:1")
    assert directory.connected == 0 and directory.retired == 1
    assert directory.route("a") is old  # requests bound to it still reach it until they end
    directory.free("a")
    assert old.closed == 0 and closed == []
    directory.free("b")
    assert old.freed == ["a", "b"] and old.closed == 1 and closed == [old]
    assert directory.retired == 0
    fresh = directory.client_for("old:1")  # a store that comes back at the old address is connected anew
    assert fresh is not old and directory.connected == 1


def test_an_unused_client_of_a_store_that_moved_closes_at_once(monkeypatch):
    directory = _directory(monkeypatch)
    closed = []
    directory.closed_listeners.append(closed.append)
    kept = directory.client_for("kept:1")
    gone = directory.client_for("gone:1")
    assert directory.retire("gone:1")
    assert gone.closed == 1 and closed == [gone] and kept.closed == 0
    assert not directory.retire("never:1")  # no client for it: nothing to do
    directory.close()
    assert kept.closed == 1 and gone.closed == 1  # closed once only


def test_a_retired_client_still_bound_closes_with_the_directory(monkeypatch):
    directory = _directory(monkeypatch)
    directory.bind("a", "old:1")
    old = directory.client_for("old:1")
    directory.retire("old:1")
    directory.close()
    assert old.closed == 1


def test_a_connect_under_way_when_its_store_moves_is_retired_not_kept(monkeypatch):
    """A first connect to the old address still running when the store was retired became the
    address's client afterwards, and nothing ever closed it."""
    release, calls = threading.Event(), []

    def connect(address, transport, timeout):
        calls.append(address)
        if len(calls) == 1:
            release.wait(10)
        return _ClosingClient(address)

    monkeypatch.setattr(store_directory, "connect", connect)
    directory = StoreDirectory()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        binding = pool.submit(directory.bind, "a", "old:1")
        while not calls:
            threading.Event().wait(0.01)
        assert not directory.retire("old:1")  # no client yet: the connect is under way
        release.set()
        binding.result(timeout=5)
    late = directory.route("a")
    assert directory.connected == 0 and directory.retired == 1  # it serves request a, and no one else
    directory.free("a")
    assert late.closed == 1 and directory.retired == 0
    fresh = directory.client_for("old:1")  # a store back at that address is connected anew, and kept
    assert fresh is not late and directory.connected == 1
