"""A NIXL client reads and writes the arena one-sided through block tables it cached. The store
must not hand a freed request's memory to another request while a client may still use such a
table: it holds the memory until the client releases the table, reconnects, or times out."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

from oasiskv.kvstore import BlockOutOfRange, KVStoreServer, StoreFull, UnknownRequest, connect
from oasiskv.kvstore.nixl_transport import nixl_available

from .helpers import LAYOUT

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl not importable")

TOKENS = 64  # 4 blocks


def rid() -> str:
    return f"h-{uuid.uuid4().hex[:8]}"


def filled(value: float, n: int = 1) -> torch.Tensor:
    return torch.full((n, *LAYOUT.unit_shape), value, dtype=LAYOUT.dtype)


def held(client) -> int:
    return int(client.stats().extra["held_requests"])


def read_unit(client, request: str, block: int = 0) -> torch.Tensor:
    back = filled(0.0)
    client.read_blocks(request, 0, 0, block, back).wait()
    return back


def cached_by(owner, reader) -> str:
    """A request `owner` allocates and whose block table `reader` (NIXL) caches by reading it."""
    request = rid()
    owner.allocate(request, LAYOUT, TOKENS)
    read_unit(reader, request)
    return request


def stop_reporting(client) -> None:
    """The client's report thread stops: it no longer takes free notices, releases or heartbeats."""
    client.transport._stop_reports.set()
    client.transport._reporter.join()


@contextlib.contextmanager
def clients(server, *transports: str):
    connected = []
    try:
        for transport in transports:
            connected.append(connect(server, transport=transport))
        yield connected
    finally:
        for client in connected:
            client.close()


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture
def slow_notice_server():
    # Free notices go out once a second: a client acts on a stale table for that long.
    srv = KVStoreServer(capacity_bytes=8 << 20, prefault=False, nixl_poll_interval_s=1.0)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def server():
    srv = KVStoreServer(capacity_bytes=8 << 20, prefault=False, ttl_s=600)
    srv.start()
    yield srv
    srv.stop()


def test_a_stale_nixl_write_does_not_land_in_the_next_requests_memory(slow_notice_server):
    with clients(slow_notice_server, "tcp", "nixl") as (owner, writer):
        old, new = rid(), rid()
        owner.allocate(old, LAYOUT, TOKENS)
        writer.write_blocks(old, 0, 0, 0, filled(1.0)).wait()  # caches old's block table
        owner.free(old)
        owner.allocate(new, LAYOUT, TOKENS)  # the same size: the freed chunks would fit it exactly
        owner.write_blocks(new, 0, 0, 0, filled(7.0)).wait()
        try:  # the free notice is not there yet: the writer still uses old's table
            writer.write_blocks(old, 0, 0, 0, filled(99.0)).wait()
        except UnknownRequest:
            pass  # its commit (or a fresh table) found old freed
        assert torch.equal(read_unit(owner, new), filled(7.0)), "a stale table overwrote another request's KV"


def test_freed_memory_comes_back_once_the_nixl_client_holding_its_table_lets_go(server):
    with clients(server, "tcp", "nixl") as (owner, reader):
        request = cached_by(owner, reader)
        owner.free(request)
        assert held(owner) == 1  # the reader has not seen the free notice yet
        assert owner.stats().used_bytes > 0
        assert wait_until(lambda: held(owner) == 0, 5.0), "the reader never released the freed request's table"
        assert owner.stats().used_bytes == 0
        with pytest.raises(UnknownRequest):
            read_unit(reader, request)


def test_a_freed_request_of_no_blocks_is_let_go_once_the_nixl_client_drops_its_table(server):
    """A 0-token request stayed held for good (held_requests 1 forever): the release skipped
    requests without blocks, and past the hold time hold_expired was counted, and a warning
    logged, at every TTL tick."""
    with clients(server, "tcp", "nixl") as (owner, reader):
        request = rid()
        owner.allocate(request, LAYOUT, 0)
        with pytest.raises(BlockOutOfRange):  # the reader cached the (empty) table first
            read_unit(reader, request)
        owner.free(request)
        assert held(owner) == 1
        assert wait_until(lambda: held(owner) == 0, 5.0), "the freed request of no blocks stayed held"
        assert owner.stats().used_bytes == 0
        assert 'event="hold_expired"} 1.0' not in owner.metrics_text()


def test_a_full_store_says_how_much_memory_freed_requests_still_hold(server):
    """The refusal read 'need 98304 bytes, 0 of 4292608 free' while live requests used under
    500 KB: the rest was held for NIXL clients, and the message did not say so."""
    with clients(server, "tcp", "nixl") as (owner, reader):
        request = rid()
        owner.allocate(request, LAYOUT, 400 * LAYOUT.block_size)
        read_unit(reader, request)
        stop_reporting(reader)  # it never drops the table
        owner.free(request)
        with pytest.raises(StoreFull) as info:
            owner.allocate(rid(), LAYOUT, 200 * LAYOUT.block_size)
        assert info.value.held_bytes == 400 * LAYOUT.chunk_bytes
        assert f"{400 * LAYOUT.chunk_bytes} bytes are held by 1 freed requests" in str(info.value)


def test_a_nixl_client_that_frees_its_own_request_gives_the_memory_back_at_once(server):
    with clients(server, "nixl") as (client,):
        request = rid()
        client.allocate(request, LAYOUT, TOKENS)
        client.write_blocks(request, 0, 0, 0, filled(3.0)).wait()
        client.free(request)
        stats = client.stats()
        assert (stats.used_bytes, stats.extra["held_requests"]) == (0, 0)


def test_a_released_request_is_freed_by_another_client_without_waiting(server):
    with clients(server, "nixl", "nixl") as (prefill, decode):
        request = rid()
        prefill.allocate(request, LAYOUT, TOKENS)
        prefill.write_blocks(request, 0, 0, 0, filled(5.0)).wait()
        prefill.release(request)
        assert torch.equal(read_unit(decode, request), filled(5.0))
        time.sleep(0.2)  # the release travels on its own
        decode.free(request)
        assert (held(decode), decode.stats().used_bytes) == (0, 0)


def test_a_nixl_client_that_reconnects_holds_nothing(server):
    with clients(server, "tcp", "nixl") as (owner, reader):
        request = cached_by(owner, reader)
        stop_reporting(reader)  # no releases: only the reconnect can end the hold
        reader.transport._executor.submit(reader.transport._drop).result()  # the connection is lost
        owner.free(request)
        assert held(owner) == 1
        reader.stats()  # reconnects: the hello drops every table the reader had
        assert held(owner) == 0
        with pytest.raises(UnknownRequest):
            read_unit(reader, request)


def test_a_nixl_client_whose_connection_the_store_closed_forgets_its_tables_within_a_second(server):
    with clients(server, "tcp", "nixl") as (owner, reader):
        request = cached_by(owner, reader)
        with server._conn_lock:
            (conn,) = [c for c in server._connections if c.nixl_peer == reader.transport.client_name]
        conn.sock.shutdown(socket.SHUT_RDWR)  # the store drops the client (a frame timeout, say)
        # Its heartbeat finds the connection closed within a second and the tables go; the store
        # lets the holds of a client gone for a few seconds go.
        assert wait_until(lambda: not reader.transport._tables, 3.0), "the client kept its tables"
        owner.free(request)
        assert wait_until(lambda: held(owner) == 0, 8.0)
        with pytest.raises(UnknownRequest):
            read_unit(reader, request)


def test_the_hold_of_a_nixl_client_that_died_ends_soon_after_its_connection_closed():
    """Holds of a client whose connection closed end after a few seconds (min(ttl, 5 s)), not the
    60 s a connected but silent client gets."""
    srv = KVStoreServer(capacity_bytes=8 << 20, prefault=False, ttl_s=600)
    srv.start()
    script = textwrap.dedent(f"""
        import sys, torch
        from oasiskv.kvstore import connect
        from tests.kvstore.helpers import LAYOUT
        client = connect({srv.address!r}, transport="nixl")
        client.read_blocks(sys.argv[1], 0, 0, 0, torch.zeros(1, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)).wait()
        print("read", flush=True)
        sys.stdin.read()
    """)
    try:
        with clients(srv, "tcp") as (owner,):
            request = rid()
            owner.allocate(request, LAYOUT, TOKENS)
            reader = subprocess.Popen([sys.executable, "-c", script, request], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            assert reader.stdout.readline().strip() == "read"
            reader.kill()
            reader.wait()
            owner.free(request)
            assert held(owner) == 1
            assert wait_until(lambda: held(owner) == 0, 12.0)
            assert owner.stats().used_bytes == 0
    finally:
        srv.stop()


def test_the_hold_of_a_connected_client_that_never_releases_ends_after_the_hold_time():
    srv = KVStoreServer(capacity_bytes=8 << 20, prefault=False, ttl_s=2.0)  # holds last min(ttl, 60 s)
    srv.start()
    try:
        with clients(srv, "tcp", "nixl") as (owner, reader):
            request = cached_by(owner, reader)
            stop_reporting(reader)  # stuck: it never takes the free notice
            owner.free(request)
            assert held(owner) == 1
            assert wait_until(lambda: held(owner) == 0, 6.0)
            assert 'oasiskv_kvstore_requests_events_total{event="hold_expired"} 1.0' in owner.metrics_text()
    finally:
        srv.stop()


# --- races inside one client (the delays stand in for a thread switch at the worst moment) ----


def test_a_transfer_racing_its_own_clients_free_cannot_cache_a_table_the_store_let_go(slow_notice_server):
    with clients(slow_notice_server, "tcp", "nixl") as (owner, client):
        transport = client.transport
        submit = transport._submit

        def slow_submit(header, *args):
            if header.get("op") == "free":
                time.sleep(0.2)  # between the free's look at the transfers in flight and its sending
            return submit(header, *args)

        try:
            old, new = rid(), rid()
            client.allocate(old, LAYOUT, TOKENS)
            client.write_blocks(old, 0, 0, 0, filled(1.0)).wait()
            transport._submit = slow_submit
            freeing = threading.Thread(target=client.free, args=(old,))
            freeing.start()
            time.sleep(0.05)
            with contextlib.suppress(UnknownRequest):  # it looks the table up after the free: gone
                client.write_blocks(old, 0, 0, 0, filled(2.0)).wait()
            freeing.join()
        finally:
            transport._submit = submit
        assert old not in transport._tables or held(owner) == 1  # never a cached table the store let go
        owner.allocate(new, LAYOUT, TOKENS)
        owner.write_blocks(new, 0, 0, 0, filled(7.0)).wait()
        with contextlib.suppress(UnknownRequest):
            client.write_blocks(old, 0, 0, 0, filled(99.0)).wait()
        assert torch.equal(read_unit(owner, new), filled(7.0))


def test_a_reconnect_keeps_the_holds_of_transfers_still_running(server):
    with clients(server, "tcp", "nixl") as (owner, client):
        transport = client.transport
        post = transport.initiator.post

        def slow_post(*args, **kwargs):
            if threading.current_thread().name == "slow-writer":
                time.sleep(0.5)  # the thread is descheduled between its table lookup and the post
            return post(*args, **kwargs)

        old, new = rid(), rid()
        owner.allocate(old, LAYOUT, TOKENS)
        client.write_blocks(old, 0, 0, 0, filled(1.0)).wait()
        outcome = {}

        def write() -> None:
            try:
                client.write_blocks(old, 0, 0, 0, filled(99.0)).wait()
                outcome["write"] = "landed"
            except UnknownRequest:
                outcome["write"] = "refused"

        transport.initiator.post = slow_post
        try:
            writer = threading.Thread(target=write, name="slow-writer")
            writer.start()
            time.sleep(0.1)
            owner.free(old)
            transport._executor.submit(transport._drop).result()  # its connection drops
            client.stats()  # and comes back: hello
            assert held(owner) == 1  # the write still running keeps the hold
            owner.allocate(new, LAYOUT, TOKENS)
            owner.write_blocks(new, 0, 0, 0, filled(7.0)).wait()
            writer.join()
        finally:
            transport.initiator.post = post
        assert outcome["write"] == "refused"  # its table was from before the reconnect: looked up again
        assert torch.equal(read_unit(owner, new), filled(7.0))
        assert wait_until(lambda: held(owner) == 0, 5.0)  # released once the write ended


def test_a_write_through_the_table_of_an_id_freed_and_allocated_again_is_refused(slow_notice_server):
    """The same id, allocated again by another client: the free notice has not arrived, and the
    stale write lands in the old (held) allocation. It used to be reported as written."""
    with clients(slow_notice_server, "tcp", "nixl") as (other, client):
        request = rid()
        other.allocate(request, LAYOUT, TOKENS)
        client.write_blocks(request, 0, 0, 0, filled(1.0)).wait()  # caches this allocation's table
        other.free(request)
        other.allocate(request, LAYOUT, TOKENS)
        other.write_blocks(request, 0, 0, 0, filled(2.0)).wait()
        with pytest.raises(UnknownRequest, match="freed and allocated again"):
            client.write_blocks(request, 0, 0, 1, filled(3.0)).wait()
        assert torch.equal(read_unit(other, request), filled(2.0))


def test_an_expired_hold_on_a_pinned_request_is_counted_once():
    """Its holders are dropped when the hold expires, but a read still pinning it keeps it held
    until the read ends: it was warned about and counted as hold_expired at every TTL tick."""
    from oasiskv.kvstore import KVStore

    now = [0.0]
    store = KVStore(4 << 20, prefault=False, clock=lambda: now[0])
    store.allocate("pinned", LAYOUT, TOKENS)
    store.describe("pinned", holder="reader")
    with store.pinned("pinned"):
        store.free("pinned")
        for _ in range(3):
            now[0] += store.hold_s + 1
            store.expire()
        assert store.stats().extra["held_requests"] == 1
    assert store.stats().extra["held_requests"] == 0 and store.stats().used_bytes == 0
    assert store.metrics.registry.get_sample_value("oasiskv_kvstore_requests_events_total",
                                                   {"event": "hold_expired"}) == 1.0
