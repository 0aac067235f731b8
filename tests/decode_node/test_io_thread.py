"""The decode engine's I/O threads: reads and control calls in order, a write-back ahead of the
reads queued before it, errors handed to whoever waits, one thread per store so that a store
that does not answer holds up only its own requests, bounded waits, and a clean close."""

from __future__ import annotations

import threading

import pytest

from oasiskv.decode_node.io_thread import IOThreadClient
from oasiskv.kvstore.errors import StoreFull, StoreTimeout, StoreUnavailable, TransferError


class _Done:
    def wait(self, timeout=None):
        return None


class _FailsLate:
    def wait(self, timeout=None):
        raise TransferError("the link went down mid-read")


class RecordingClient:
    """A store client (unit test only) that records the order of calls; a read of block
    'gate' holds the I/O thread until the test opens it."""

    def __init__(self):
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.started = threading.Event()

    def read_blocks(self, request_id, layers, heads, blocks, dst, slots=None):
        if blocks == "gate":
            self.started.set()
            assert self.gate.wait(10)
        if blocks == "broken":
            raise OSError("link down")
        if blocks == "store-gone":
            raise StoreUnavailable("cannot connect to store")
        if blocks == "fails-late":
            return _FailsLate()
        self.calls.append(f"read {blocks}")
        return _Done()

    def write_blocks(self, request_id, layers, heads, blocks, src, slots=None):
        self.calls.append(f"write {blocks}")
        return _Done()

    def extend(self, request_id, length):
        if getattr(self, "refuse_extend", False):
            raise StoreFull(f"no room to extend {request_id} to {length} tokens")
        self.calls.append(f"extend {length}")

    def free(self, request_id):
        self.calls.append("free")


@pytest.fixture
def io():
    client = RecordingClient()
    io = IOThreadClient(client, timeout_s=10)
    yield io, client
    client.gate.set()
    io.close()


def test_a_write_back_overtakes_the_reads_queued_before_it(io):
    io, client = io
    first = io.read_blocks("r", 0, 0, "gate", None)
    assert client.started.wait(10)  # the I/O thread is busy with the first read
    queued = io.read_many([("r", 0, 0, "b1", None), ("r", 0, 0, "b2", None)])
    write = io.write_back("r", 48, 0, 0, "w", None)  # returns at once: the caller does not wait for the extend
    later_read = io.read_blocks("r", 0, 0, "b3", None)
    assert not write.done()
    client.gate.set()
    for handle in (first, *queued, write, later_read):
        handle.wait(10)
    # The read in progress finishes; then the write-back (extend, then write); then the reads in
    # their order.
    assert client.calls == ["read gate", "extend 48", "write w", "read b1", "read b2", "read b3"]


def test_a_refused_extend_fails_its_write_back_and_writes_nothing(io):
    io, client = io
    client.refuse_extend = True
    write = io.write_back("r", 48, 0, 0, "w", None)
    with pytest.raises(StoreFull, match="no room to extend"):
        write.wait(10)
    assert write.ended()
    assert "write w" not in client.calls


def test_control_calls_keep_their_place_behind_reads(io):
    io, client = io
    io.read_blocks("r", 0, 0, "gate", None)
    assert client.started.wait(10)
    read = io.read_blocks("r", 0, 0, "b1", None)
    freed = threading.Thread(target=io.free, args=("r",))
    freed.start()
    client.gate.set()
    read.wait(10)
    freed.join(10)
    assert client.calls == ["read gate", "read b1", "free"]


def test_a_failed_transfer_raises_where_it_is_awaited_and_the_thread_goes_on(io):
    io, client = io
    broken = io.read_blocks("r", 0, 0, "broken", None)
    with pytest.raises(OSError, match="link down"):
        broken.wait(10)
    with pytest.raises(OSError, match="link down"):
        broken.done()
    io.read_blocks("r", 0, 0, "b1", None).wait(10)
    assert client.calls == ["read b1"]


def test_a_read_that_fails_fails_only_its_own_handle_of_the_job(io):
    """read_many runs one job for several requests' reads, which may come from different stores:
    the one whose store is gone (at submission or mid-read) fails; the others land."""
    io, client = io
    handles = io.read_many([("a", 0, 0, "b1", None), ("b", 0, 0, "store-gone", None),
                            ("c", 0, 0, "fails-late", None), ("d", 0, 0, "b2", None)])
    handles[0].wait(10)
    handles[3].wait(10)
    assert handles[0].done() and handles[3].done()
    with pytest.raises(StoreUnavailable):
        handles[1].wait(10)
    with pytest.raises(TransferError, match="mid-read"):
        handles[2].done()
    assert client.calls == ["read b1", "read b2"]
    io.read_blocks("e", 0, 0, "b3", None).wait(10)
    assert client.calls[-1] == "read b3"


class RoutingClient(RecordingClient):
    """Requests 'slow-*' live in one store, the rest in another (as a StoreDirectory routes)."""

    def route(self, request_id):
        return "slow-store" if request_id.startswith("slow") else "other-store"


def test_a_store_that_holds_its_thread_up_holds_up_only_its_own_requests():
    client = RoutingClient()
    io = IOThreadClient(client, timeout_s=0.5)
    try:
        held = io.read_blocks("slow-1", 0, 0, "gate", None)
        assert client.started.wait(10)
        slow, other = io.read_many([("slow-2", 0, 0, "b1", None), ("fast-1", 0, 0, "b2", None)])
        other.wait(10)  # its store's thread is free
        assert client.calls == ["read b2"] and other.ended()
        with pytest.raises(StoreTimeout, match="not done after 0.5s"):
            slow.wait(0.5)
        assert not slow.ended() and not held.ended()  # queued or running: they may still write
        with pytest.raises(StoreTimeout):
            io.free("slow-3")  # a control call waits no longer than the timeout either
        client.gate.set()
        held.wait(10)
        slow.wait(10)
        assert held.ended() and slow.ended()
        assert client.calls == ["read b2", "read gate", "read b1", "free"]
    finally:
        client.gate.set()
        io.close()


def test_close_runs_what_is_queued_and_refuses_more():
    client = RecordingClient()
    io = IOThreadClient(client, timeout_s=10)
    io.read_blocks("r", 0, 0, "gate", None)
    assert client.started.wait(10)
    queued = io.read_blocks("r", 0, 0, "b1", None)
    closer = threading.Thread(target=io.close)
    closer.start()
    client.gate.set()
    closer.join(10)
    assert queued.done() and client.calls == ["read gate", "read b1"]
    with pytest.raises(RuntimeError, match="closed"):
        io.read_blocks("r", 0, 0, "b2", None)


def test_at_exit_the_thread_drops_what_is_queued_and_ends():
    """Registered with the exit hook (a daemon thread inside a NIXL call as Python finalized
    aborted the process): the job running ends, the queued ones are cancelled, not run."""
    from oasiskv.kvstore import nixl_agents

    client = RecordingClient()
    io = IOThreadClient(client, timeout_s=10)
    io.read_blocks("r", 0, 0, "gate", None)
    assert client.started.wait(10)
    queued = io.read_blocks("r", 0, 0, "b1", None)
    thread = next(iter(io._threads.values()))
    assert thread in nixl_agents._POLLERS
    threading.Timer(0.2, client.gate.set).start()
    thread.stop_polling(wait_s=10)
    assert not thread._thread.is_alive() and client.calls == ["read gate"]
    with pytest.raises(StoreTimeout, match="cancelled"):
        queued.wait()


def test_a_forgotten_route_runs_what_is_queued_and_stops_its_thread():
    """A store that moved: its I/O thread runs what is queued, then stops; it can be forgotten
    from a job on that very thread (a queued free that closed the store's last request)."""
    routes = {"a": "store-a", "b": "store-b"}

    class Routed:
        def route(self, request_id):
            return routes[request_id]

        def free(self, request_id):
            if request_id == "a":
                io.forget_route("store-a")  # from the store's own thread: must not join itself
            return threading.current_thread()

    io = IOThreadClient(Routed(), timeout_s=5)
    try:
        thread_a = io.free("a")
        thread_a.join(5)
        assert not thread_a.is_alive()
        thread_b = io.free("b")
        assert thread_b.is_alive() and thread_b is not thread_a
        io.free("a")  # a new request on a store at that key again gets a new thread
    finally:
        io.close(5)
