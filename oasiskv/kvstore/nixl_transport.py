"""NIXL transport: TCP control plane, one-sided NIXL READ/WRITE data plane.

A client learns the store's agent metadata and arena base address in the handshake and, per
request, the block table (cached). It then computes every unit's remote address itself and moves
a whole batch with one transfer. See nixl_agents.py for the measured facts behind the choices.

The store keeps a freed request's memory until this client says it dropped the table (store.py:
holds). The client says so, with the next read report, once it has the store's free notice and
no transfer it started on that request is still running; it forgets every table before each
hello, since notices sent while it was disconnected are lost.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import uuid
import weakref
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

from .errors import InvalidArgument, KVStoreError, ProtocolError, StoreTimeout, StoreUnavailable, TransferError
from .hostmem import merge_runs
from .layout import KVLayout
from .nixl_agents import NixlInitiator, StaleConnection, nixl_available, nixl_errors, stop_polling_at_exit
from .protocol import index_payload
from .store import RequestInfo
from .tcp import TcpTransport, _read_all, described
from .transport import CompletedHandle, TransferHandle

log = logging.getLogger(__name__)

__all__ = ["NixlHandle", "NixlTransport", "nixl_available"]


class NixlHandle(TransferHandle):
    """A NIXL transfer; a write also waits for the store to summarize what landed."""

    def __init__(self, transport: "NixlTransport", request_id: str, xfer: Any, state: str, transient: Any,
                 num_units: int, nbytes: int, keepalive: torch.Tensor,
                 commit: Callable[[], concurrent.futures.Future] | None):
        super().__init__(num_units, nbytes, transport.timeout)
        self._transport = transport
        self._xfer = xfer
        self._transient = transient
        self._state = state
        self._keepalive = keepalive
        self._commit = commit
        self._commit_future: concurrent.futures.Future | None = None
        self._error: KVStoreError | None = None
        self._finished = False
        # A handle dropped unfinished is settled by the transport's report thread (not here: the
        # collector may run while this thread holds the agent's lock).
        self._orphan = weakref.finalize(self, transport.orphans.put, (xfer, transient, request_id))

    def done(self) -> bool:
        if self._error is not None:
            raise self._error
        if self._finished:
            return True
        initiator = self._transport.initiator
        if self._xfer is not None:
            try:
                state = "DONE" if self._state == "DONE" else initiator.state(self._xfer)
            except nixl_errors() as exc:
                state = f"ERR ({type(exc).__name__}: {exc})"
            if state == "PROC":
                return False
            self._settle()
            if state != "DONE":
                self._transport.forget_all()
                self._fail(TransferError(
                    f"NIXL transfer of {self.num_units} units failed, state {state} "
                    f"(store {self._transport.address} stopped or restarted?)",
                    address=self._transport.address,
                ))
        if self._commit is not None:
            if self._commit_future is None:
                try:
                    self._commit_future = self._commit()
                except KVStoreError as exc:
                    self._fail(exc)
            if not self._commit_future.done():
                return False
            try:
                self._commit_future.result()
            except KVStoreError as exc:
                self._fail(exc)
        self._finished = True
        return True

    def wait(self, timeout: float | None = None) -> None:
        try:
            super().wait(timeout)
        except StoreTimeout:
            if self._xfer is not None:  # abort: NIXL cancels an unfinished transfer on release
                self._settle()
            raise

    def _settle(self) -> None:
        """The transfer is over (or cancelled): release it; the request's table may be dropped."""
        detached = self._orphan.detach()
        self._xfer = self._transient = None
        if detached is None:  # settled already
            return
        xfer, transient, request_id = detached[2][0]
        if self._transport.initiator.release(xfer, transient):
            self._transport.transfer_ended(request_id)
        else:  # still running (NIXL refused to let it go): its request stays held until it ends
            self._transport.orphans.put((xfer, transient, request_id))

    def _fail(self, error: KVStoreError) -> None:
        self._error = error
        raise error


class NixlTransport(TcpTransport):
    """TCP control plane + one-sided NIXL data plane."""

    name = "nixl"
    MAX_CACHED_TABLES = 4096

    def __init__(self, address: str | tuple[str, int], timeout: float = 30.0, client_name: str | None = None):
        client_name = client_name or f"oasiskv-client-{uuid.uuid4().hex[:12]}"
        self.initiator = NixlInitiator(client_name)
        self._tables: OrderedDict[str, tuple[RequestInfo, np.ndarray]] = OrderedDict()
        self._tables_lock = threading.Lock()  # guards the tables, transfers in flight and pending releases
        self._in_flight: dict[str, int] = {}  # request id -> transfers started and not settled
        self._unreleased: dict[int, str] = {}  # serial of a freed allocation -> its request id
        self._done_with: list[str] = []  # requests this client will not touch again (release())
        self.orphans: queue.SimpleQueue[tuple[Any, Any, str]] = queue.SimpleQueue()
        self._reads: dict[str, list[int]] = {}  # request id -> [units, bytes] not yet reported
        self._reads_lock = threading.Lock()
        self._stop_reports = threading.Event()
        self._reporter: threading.Thread | None = None
        super().__init__(address, timeout, client_name)
        self.restart_listeners.append(self.forget_all)
        if not self.hello.get("nixl"):
            self.close()
            raise StoreUnavailable(f"store at {self.address} does not serve NIXL (started with transport=tcp)", address=self.address)
        # Often enough to keep requests in use alive well inside the store's TTL.
        self._report_interval = min(1.0, float(self.hello.get("ttl_s", 600.0)) / 4)
        self._reporter = threading.Thread(target=self._report_loop, name="kvstore-nixl-report", daemon=True)
        self._reporter.start()
        stop_polling_at_exit(self)

    def _hello_request(self) -> tuple[dict[str, Any], list[Any]]:
        # The store drops this client's holds on hello: free notices sent while it was away are
        # lost, so every cached table goes now, and with it what was still to be released.
        with self._tables_lock:
            self._tables.clear()
            self._unreleased.clear()
            # Requests with transfers still running keep their holds (a transfer posted through an
            # old table may still be moving data); they are released by id once those end.
            keep = [r for r, n in self._in_flight.items() if n]
            self._done_with = list(keep)
        header, _ = super()._hello_request()
        return {**header, "nixl": True, "keep": keep}, [self.initiator.metadata]

    def _on_hello(self, reply: dict[str, Any], data: bytes) -> None:
        info = reply.get("nixl")
        if info:
            self.initiator.connect(data, int(info["arena_base"]), int(info["arena_bytes"]))

    # --- control plane: keep the block-table cache in step --------------------------------

    def allocate(self, request_id: str, layout: KVLayout, num_tokens: int) -> RequestInfo:
        self.forget(request_id)
        return super().allocate(request_id, layout, num_tokens)

    def extend(self, request_id: str, num_tokens: int) -> RequestInfo:
        self.forget(request_id)
        return super().extend(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        # Idle: this client's table is gone and nothing of its own is in flight, so the store may
        # reuse the memory at once; otherwise it waits for this client's release after the notice.
        # Sent under the lock: a transfer of another thread that starts after this look reaches
        # the store after the free (one socket, in order), so it cannot hold a table the free let go.
        with self._tables_lock:
            self._tables.pop(request_id, None)
            idle = not self._in_flight.get(request_id)
            future = self._submit({"op": "free", "rid": request_id, "forgotten": idle}, [], _read_all)
        self._answer(future, "free")

    def release(self, request_id: str) -> None:
        """This client will not touch the request again (it stays allocated for others)."""
        with self._tables_lock:
            self._tables.pop(request_id, None)
            self._done_with.append(request_id)
        self._report_reads(wait=False)  # now, not at the next report

    def register(self, tensor: torch.Tensor) -> None:
        self.initiator.register(tensor)

    def unregister(self, tensor: torch.Tensor) -> None:
        self.initiator.unregister(tensor)

    def stats(self) -> dict[str, Any]:
        self._report_reads(wait=True)
        return super().stats()

    def metrics_text(self) -> str:
        self._report_reads(wait=True)
        return super().metrics_text()

    def forget(self, request_id: str) -> None:
        with self._tables_lock:
            self._tables.pop(request_id, None)

    def forget_all(self) -> None:
        with self._tables_lock:
            self._tables.clear()

    def transfer_ended(self, request_id: str) -> None:
        with self._tables_lock:
            left = self._in_flight.get(request_id, 0) - 1
            if left > 0:
                self._in_flight[request_id] = left
            else:
                self._in_flight.pop(request_id, None)

    def _take_notices(self) -> None:
        for serial, request_id in self.initiator.drain_notifications():
            with self._tables_lock:
                self._tables.pop(request_id, None)
                self._unreleased[serial] = request_id

    def _releases(self) -> tuple[list[int], list[str]]:
        """Freed allocations whose table this client no longer uses, and requests it is done with.
        The caller holds _tables_lock and sends them before letting it go (see free())."""
        serials = [s for s, r in self._unreleased.items() if not self._in_flight.get(r)]
        done = [r for r in self._done_with if not self._in_flight.get(r)]
        for serial in serials:
            # Again: a describe that raced the notice may have cached the table after it.
            self._tables.pop(self._unreleased.pop(serial), None)
        for request_id in done:
            self._tables.pop(request_id, None)  # re-described since: it is held again from the next use
        self._done_with = [r for r in self._done_with if self._in_flight.get(r)]
        return serials, done

    def _settle_orphans(self) -> None:
        unreleased = []
        while True:
            try:
                xfer, transient, request_id = self.orphans.get_nowait()
            except queue.Empty:
                break
            if self.initiator.release(xfer, transient):
                self.transfer_ended(request_id)
            else:
                unreleased.append((xfer, transient, request_id))
        for orphan in unreleased:  # tried again at the next report
            self.orphans.put(orphan)

    def _describe_held(self, request_id: str) -> tuple[RequestInfo, np.ndarray, int]:
        """The request's info and table, held for this client, and the connection generation
        they belong to (read on the thread that made the connection, so it is the one that answered)."""
        def land(reply: dict[str, Any], payload) -> tuple[RequestInfo, np.ndarray, int]:
            return (*described(*_read_all(reply, payload)), self.initiator.generation)

        return self._call({"op": "describe", "rid": request_id, "hold": True}, land=land)

    def _table(self, request_id: str, needed_blocks: int) -> tuple[RequestInfo, np.ndarray, int]:
        """The request's block table; the caller has counted its transfer in _in_flight, so a
        release for this request waits until that transfer is over."""
        self._take_notices()
        with self._tables_lock:
            cached = self._tables.get(request_id)
            if cached is not None:
                self._tables.move_to_end(request_id)
        if cached is None or cached[1].size < needed_blocks:
            cached = self._describe_held(request_id)
            with self._tables_lock:
                self._tables[request_id] = cached
                while len(self._tables) > self.MAX_CACHED_TABLES:
                    self._tables.popitem(last=False)
        return cached

    # --- data plane ----------------------------------------------------------------------

    def read(self, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray,
             buffer: torch.Tensor, offsets: np.ndarray) -> TransferHandle:
        return self._transfer("READ", request_id, layout, layers, heads, blocks, buffer, offsets)

    def write(self, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray,
              buffer: torch.Tensor, offsets: np.ndarray) -> TransferHandle:
        return self._transfer("WRITE", request_id, layout, layers, heads, blocks, buffer, offsets)

    def _transfer(self, op: str, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray,
                  blocks: np.ndarray, buffer: torch.Tensor, offsets: np.ndarray) -> TransferHandle:
        # Counted before the table is looked up: a free notice taken from now on is not released
        # to the store until this transfer is over (the table it uses may be stale).
        with self._tables_lock:
            self._in_flight[request_id] = self._in_flight.get(request_id, 0) + 1
        try:
            handle = self._post(op, request_id, layout, layers, heads, blocks, buffer, offsets)
        except BaseException:
            self.transfer_ended(request_id)
            raise
        if not isinstance(handle, NixlHandle):
            self.transfer_ended(request_id)
        return handle

    def _post(self, op: str, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray,
              blocks: np.ndarray, buffer: torch.Tensor, offsets: np.ndarray, retry: bool = True) -> TransferHandle:
        n = layers.size
        info, table, generation = self._table(request_id, int(blocks.max()) + 1 if n else 0)
        if info.layout.unit_bytes != layout.unit_bytes:  # the id was reused for another geometry
            raise InvalidArgument(
                f"request {request_id!r} has {info.layout.unit_bytes}-byte units, the client assumed {layout.unit_bytes}",
                unit_bytes=info.layout.unit_bytes,
            )
        layout = info.layout
        if n == 0:
            return CompletedHandle(0, 0)
        layout.check_units(layers, heads, blocks, table.size)
        unit = layout.unit_bytes
        remote = layout.unit_offsets(table, layers, heads, blocks)
        if int(remote.max()) + unit > self.initiator.arena_bytes:
            raise ProtocolError(f"block table of {request_id!r} points outside the store's arena")
        remote_starts, local_starts, lengths = merge_runs(remote, offsets, unit)
        if op == "READ":
            commit = None
        else:
            idx = index_payload(layers, heads, blocks)

            def commit() -> concurrent.futures.Future:
                # With the allocation's serial: a write through the table of a freed allocation of
                # this id (allocated again since) is refused, not counted as landed.
                return self._submit({"op": "commit", "rid": request_id, "n": n, "serial": info.serial}, [idx], None)

        try:
            xfer, state, transient = self.initiator.post(op, buffer, local_starts, remote_starts, lengths, generation)
        except StaleConnection:  # reconnected since the table was looked up: it may point anywhere now
            if retry:
                return self._post(op, request_id, layout, layers, heads, blocks, buffer, offsets, retry=False)
            raise StoreUnavailable(f"the connection to the store at {self.address} changed twice during one "
                                   f"NIXL {op}; retry it", address=self.address) from None
        except nixl_errors() as exc:  # e.g. nixlRemoteDisconnectError: the store process is gone
            self.forget_all()
            if retry:
                # Reconnect through the control plane (StoreUnavailable if the store is gone; a
                # restarted store's new agent otherwise), then try once more with fresh tables.
                self._call({"op": "ping"})
                return self._post(op, request_id, layout, layers, heads, blocks, buffer, offsets, retry=False)
            error = StoreUnavailable if "Disconnect" in type(exc).__name__ else TransferError
            raise error(f"NIXL {op} to store at {self.address} failed: {type(exc).__name__}: {exc}", address=self.address) from None
        if op == "READ":
            with self._reads_lock:
                counts = self._reads.setdefault(request_id, [0, 0])
                counts[0] += n
                counts[1] += n * unit
        return NixlHandle(self, request_id, xfer, state, transient, n, n * unit, buffer, commit)

    def _report_loop(self) -> None:
        while not self._stop_reports.wait(self._report_interval):
            try:
                self._settle_orphans()
                self._take_notices()  # also when idle: undrained notices pile up in the store
            except nixl_errors() as exc:
                log.debug("NIXL notifications not taken: %s", exc)
            if not self._report_reads(wait=False) and self._tables:
                # A heartbeat while tables are cached: a connection the store closed is noticed
                # (and the tables forgotten, see _drop) within a second, not at the next call.
                try:
                    self._submit({"op": "ping"}, [], None)
                except KVStoreError:
                    pass

    def _drop(self) -> None:
        # Free notices sent while disconnected are lost, and the store lets this client's holds
        # go a few seconds after it sees the connection close: no table may outlive it.
        super()._drop()
        self.forget_all()

    def _report_reads(self, wait: bool, closing: bool = False) -> bool:
        """Tell the store what was read since the last report (metrics + TTL refresh) and which
        block tables this client dropped (the store may then reuse that memory)."""
        with self._reads_lock:
            reads, self._reads = self._reads, {}
        try:
            with self._tables_lock:
                released, done = self._releases()
                if not (reads or released or done or closing):
                    return False
                header = {"op": "report", "reads": reads, "released": released, "done": done, "closing": closing}
                future = self._submit(header, [], None)
            if wait:
                future.result(2 * self.timeout)
        except (KVStoreError, concurrent.futures.TimeoutError) as exc:
            log.debug("read report not delivered: %s", exc)
        return True

    def stop_polling(self, wait_s: float | None = None) -> None:
        """Stop the report thread (at exit too: `nixl_agents.stop_polling_at_exit`)."""
        self._stop_reports.set()
        if self._reporter is not None:
            self._reporter.join(timeout=2 * self.timeout if wait_s is None else wait_s)

    def close(self) -> None:
        if self._closed:
            return
        self.stop_polling()
        self._settle_orphans()
        self._report_reads(wait=True, closing=True)
        super().close()
        self.initiator.close()
