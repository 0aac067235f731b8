"""The store itself: one preallocated arena, per-request block tables, summaries, TTL.

Transport-free: the TCP/NIXL server and the in-process transport all call these methods.
Thread-safe: bookkeeping happens under one lock, copies happen outside it while the request is
*pinned*, and a request freed while pinned gives its memory back when the last pin goes.

A NIXL client reads and writes the arena one-sided, through a block table it cached; the store
cannot check those accesses. So a request whose table a NIXL client holds (its *holders*) is
*held* when freed: its memory is reused only once every holder has said it dropped the table
(after the store's free notice), reconnected (a client forgets every table then), or stayed
silent for hold_s. Otherwise a stale table made a client read or overwrite the next owner's KV.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from .allocator import ExtentAllocator
from .config import CHUNK_ALIGN, GIB, MAX_CAPACITY_GB, KVStoreConfig
from .errors import BlockOutOfRange, InvalidArgument, KVStoreError, RequestExists, StoreFull, UnknownRequest
from .hostmem import HostBuffer, alloc_host_buffer, copy_units, merge_runs
from .layout import KVLayout, broadcast_units
from .metrics import StoreMetrics
from .summary import QuantizedSummaries, read_as, summarize_keys, summary_read_dtype

MAX_REQUEST_ID_LEN = 256
# Live NIXL clients drop a freed request's table within about a second; a holder silent this long
# has died with it (or is stuck), and the memory goes back to the allocator.
MAX_HOLD_S = 60.0
# A live NIXL client notices within about a second that its connection closed, and forgets its
# tables; one whose connection stays closed this long has died.
DISCONNECTED_HOLD_S = 5.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestInfo:
    """What a client learns about a live request."""

    request_id: str
    layout: KVLayout
    num_tokens: int
    num_blocks: int
    nbytes: int  # arena bytes held (KV + summaries)
    serial: int = 0  # this allocation of the id (a freed id allocated again gets another)

    def to_wire(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "layout": self.layout.to_wire(),
            "num_tokens": self.num_tokens,
            "num_blocks": self.num_blocks,
            "nbytes": self.nbytes,
            "serial": self.serial,
        }

    @staticmethod
    def from_wire(data: dict[str, Any]) -> "RequestInfo":
        return RequestInfo(
            str(data["request_id"]), KVLayout.from_wire(data["layout"]),
            int(data["num_tokens"]), int(data["num_blocks"]), int(data["nbytes"]), int(data.get("serial", 0)),
        )


@dataclass
class _Request:
    request_id: str
    layout: KVLayout
    num_tokens: int
    table: np.ndarray  # int64 arena offset of each block's chunk
    last_used: float
    serial: int = 0  # tells this allocation from a later one under the same id
    pins: int = 0
    dead: bool = False  # freed or expired
    holders: set[str] = field(default_factory=set)  # NIXL clients that cached its block table
    hold_deadline: float = 0.0

    def info(self) -> RequestInfo:
        return RequestInfo(
            self.request_id, self.layout, self.num_tokens, int(self.table.size),
            int(self.table.size) * self.layout.chunk_bytes, self.serial,
        )


@dataclass
class StoreStats:
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    num_requests: int
    free_extents: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "extra"}
        return {**data, **self.extra}


class KVStore:
    def __init__(
        self,
        capacity_bytes: int,
        block_size: int = 16,
        ttl_s: float = 600.0,
        hugepages: bool = True,
        prefault: bool = True,
        pin_memory: str = "auto",
        clock: Callable[[], float] = time.monotonic,
    ):
        if capacity_bytes > MAX_CAPACITY_GB * GIB:  # it overflowed inside the allocator
            raise InvalidArgument(f"capacity of {capacity_bytes} bytes is more than {MAX_CAPACITY_GB} GiB")
        capacity_bytes -= capacity_bytes % CHUNK_ALIGN
        if capacity_bytes <= 0:
            raise InvalidArgument(f"capacity must be at least {CHUNK_ALIGN} bytes")
        self.buffer: HostBuffer = alloc_host_buffer(capacity_bytes, hugepages, prefault, pin_memory)
        self.arena = self.buffer.tensor
        self.base = self.buffer.ptr
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.clock = clock
        self.allocator = ExtentAllocator(capacity_bytes, CHUNK_ALIGN)
        self.metrics = StoreMetrics(capacity_bytes)
        self._requests: dict[str, _Request] = {}
        self._held: dict[int, _Request] = {}  # serial -> retired request a NIXL client may still touch
        self._gone: dict[str, float] = {}  # disconnected holder -> when its holds end
        self.hold_s = min(ttl_s, MAX_HOLD_S)
        # A random start: a client's release of a serial from a store that restarted must not
        # match one of this store's.
        self._serials = itertools.count(secrets.randbits(40) + 1)
        self._lock = threading.Lock()
        # Called with (request id, serial) after it is freed or expires (NIXL tells its clients).
        self.release_listeners: list[Callable[[str, int], None]] = []

    @classmethod
    def from_config(cls, config: KVStoreConfig) -> "KVStore":
        return cls(
            config.capacity_bytes, config.block_size, config.ttl_s,
            config.hugepages, config.prefault, config.pin_memory,
        )

    # --- request lifecycle ---------------------------------------------------------------

    def allocate(self, request_id: str, layout: KVLayout, num_tokens: int) -> RequestInfo:
        _check_request_id(request_id)
        if layout.block_size != self.block_size:
            raise InvalidArgument(
                f"layout block_size {layout.block_size} differs from the store's {self.block_size}",
                block_size=layout.block_size, store_block_size=self.block_size,
            )
        if num_tokens < 0:
            raise InvalidArgument(f"num_tokens must be >= 0, got {num_tokens}")
        if layout.chunk_bytes > self.capacity_bytes:  # even a 0-token request overflowed on it
            raise InvalidArgument(f"layout blocks of {layout.chunk_bytes} bytes cannot fit the store's "
                                  f"{self.capacity_bytes} bytes", chunk_bytes=layout.chunk_bytes)
        with self._lock:
            if request_id in self._requests:
                raise RequestExists(f"request {request_id!r} is already allocated", request_id=request_id)
            try:
                table = self.allocator.allocate(layout.num_blocks(num_tokens), layout.chunk_bytes)
            except StoreFull as exc:
                self.metrics.requests.labels("refused").inc()
                raise self.counted(self._full(request_id, exc)) from None
            # Cleared before anyone can see the request, so no write's summary gets wiped.
            self._clear_summaries(layout, table)
            request = _Request(request_id, layout, int(num_tokens), table, self.clock(), next(self._serials))
            self._requests[request_id] = request
            self.metrics.requests.labels("allocated").inc()
            self._update_gauges()
        return request.info()

    def extend(self, request_id: str, num_tokens: int) -> RequestInfo:
        """Grow a request to num_tokens (decode appends); new blocks get fresh chunks."""
        with self._lock:
            request = self._get(request_id)
            layout = request.layout
            if num_tokens < request.num_tokens:
                raise InvalidArgument(
                    f"request {request_id!r} has {request.num_tokens} tokens; extend cannot shrink it to {num_tokens}"
                )
            missing = layout.num_blocks(num_tokens) - request.table.size
            if missing > 0:
                try:
                    new_chunks = self.allocator.allocate(missing, layout.chunk_bytes)
                except StoreFull as exc:
                    raise self.counted(self._full(request_id, exc)) from None
                self._clear_summaries(layout, new_chunks)
                # A new array, not an in-place resize: pinned readers keep the old table.
                request.table = np.concatenate((request.table, new_chunks))
            request.num_tokens = int(num_tokens)
            request.last_used = self.clock()
            self._update_gauges()
            return request.info()

    def describe(self, request_id: str, holder: str | None = None) -> tuple[RequestInfo, np.ndarray]:
        """The request's info and a copy of its block table. A holder (a NIXL client, which will
        access the arena one-sided through the table) keeps the memory from reuse after a free
        until it releases the table."""
        with self._lock:
            request = self._get(request_id)
            request.last_used = self.clock()
            if holder is not None:
                request.holders.add(holder)
            return request.info(), request.table.copy()

    def free(self, request_id: str, releasing: str | None = None) -> None:
        """Free a request. releasing: a holder that frees it and has already dropped its table."""
        with self._lock:
            request = self._get(request_id)
            if releasing is not None:
                request.holders.discard(releasing)
            self._retire(request)
            self.metrics.requests.labels("freed").inc()
        self._notify_released(request)

    def release_holds(self, holder: str, serials: Iterable[int] = (), request_ids: Iterable[str] = (),
                      everything: bool = False, keep: Iterable[str] = ()) -> None:
        """A NIXL client dropped the tables of these freed allocations (serials from the free
        notices), of these requests (freed or not), or every table (it reconnected) but those of
        the requests in `keep` (it still has transfers running on them)."""
        with self._lock:
            touched = [self._held[s] for s in serials if s in self._held]
            ids = set(request_ids)
            if ids:
                touched += [r for r in self._held.values() if r.request_id in ids]
                touched += [self._requests[i] for i in ids if i in self._requests]
            if everything:
                kept = set(keep)
                touched = [r for r in (*self._held.values(), *self._requests.values()) if r.request_id not in kept]
                self._gone.pop(holder, None)
            for request in touched:
                request.holders.discard(holder)
                self._release_if_unused(request)

    def holder_gone(self, holder: str) -> None:
        """A NIXL client's last connection closed: unless it says hello again, its holds end soon."""
        with self._lock:
            self._gone[holder] = self.clock() + min(DISCONNECTED_HOLD_S, self.hold_s)

    def touch(self, request_ids: list[str]) -> list[str]:
        """Refresh the TTL of live requests; returns the ids that are not live."""
        now = self.clock()
        unknown = []
        with self._lock:
            for request_id in request_ids:
                request = self._requests.get(request_id)
                if request is None:
                    unknown.append(request_id)
                else:
                    request.last_used = now
        return unknown

    def expire(self) -> list[str]:
        """Free requests idle for more than ttl_s (their client vanished)."""
        deadline = self.clock() - self.ttl_s
        with self._lock:
            expired = [r for r in self._requests.values() if r.last_used < deadline and r.pins == 0]
            for request in expired:
                self._retire(request)
                self.metrics.requests.labels("expired").inc()
        for request in expired:
            self._notify_released(request)
        self._end_overdue_holds()
        return [r.request_id for r in expired]

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                self.capacity_bytes, self.allocator.used_bytes, self.allocator.free_bytes,
                len(self._requests), self.allocator.num_extents, {"held_requests": len(self._held)},
            )

    # --- data plane ----------------------------------------------------------------------

    @contextmanager
    def pinned(self, request_id: str) -> Iterator[_Request]:
        """Keep the request's chunks from being reused while bytes are copied outside the lock."""
        with self._lock:
            request = self._get(request_id)
            request.pins += 1
            request.last_used = self.clock()
        try:
            yield request
        finally:
            with self._lock:
                request.pins -= 1
                self._release_if_unused(request)

    def unit_offsets(self, request: _Request, layers, heads, blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Validated unit indices and their arena byte offsets."""
        layers, heads, blocks = broadcast_units(layers, heads, blocks)
        units = request.table.size * request.layout.units_per_block
        if layers.size > MAX_REPEATS * units + 1024:  # 2M repeats of a unit built 2M views of the arena (1.5 GB)
            raise self.counted(InvalidArgument(f"{layers.size} units asked of request {request.request_id!r}, which "
                                               f"has {units}: more than {MAX_REPEATS}x over"))
        try:
            request.layout.check_units(layers, heads, blocks, request.table.size)
        except BlockOutOfRange as exc:
            self.counted(exc)
            raise
        return layers, heads, blocks, request.layout.unit_offsets(request.table, layers, heads, blocks)

    def read_into(self, request_id: str, layers, heads, blocks, dst_ptr: int, dst_offsets: np.ndarray,
                  unit_bytes: int) -> int:
        """Copy units to dst_ptr + dst_offsets[i] (in-process transport). Returns bytes copied.

        unit_bytes is what the caller sized its slots with; it must match the request's."""
        with self.pinned(request_id) as request:
            check_unit_bytes(request, unit_bytes)
            layers, heads, blocks, offsets = self.unit_offsets(request, layers, heads, blocks)
            unit = request.layout.unit_bytes
            copy_units(self.base, offsets, dst_ptr, dst_offsets, unit)
        self.record_read(layers.size, layers.size * unit, "inproc")
        return layers.size * unit

    def write_from(self, request_id: str, layers, heads, blocks, src_ptr: int, src_offsets: np.ndarray,
                   unit_bytes: int) -> int:
        """Copy units from src_ptr + src_offsets[i], then summarize them (in-process transport)."""
        with self.pinned(request_id) as request:
            check_unit_bytes(request, unit_bytes)
            layers, heads, blocks, offsets = self.unit_offsets(request, layers, heads, blocks)
            unit = request.layout.unit_bytes
            copy_units(src_ptr, src_offsets, self.base, offsets, unit)
            self.summarize(request, layers, heads, blocks)
        self.record_write(layers.size, layers.size * unit, "inproc")
        return layers.size * unit

    def summarize(self, request: _Request, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray) -> None:
        """Recompute the key summaries (of the layout's kind) of the given (validated) units from the arena."""
        n = layers.size
        if n == 0:
            return
        layout = request.layout
        keys = torch.empty((n, layout.block_size, layout.head_dim), dtype=layout.dtype)
        unit_offsets = layout.unit_offsets(request.table, layers, heads, blocks)
        copy_units(self.base, unit_offsets, keys.data_ptr(), np.arange(n, dtype=np.int64) * layout.key_bytes, layout.key_bytes)
        valid = np.minimum(request.num_tokens - blocks * layout.block_size, layout.block_size)
        partial = valid < layout.block_size
        if not partial.any():
            summaries = summarize_keys(keys, kind=layout.summary_kind)
        else:  # only the request's last block is partly filled; mask just those units
            summaries = torch.empty((n, 2, layout.head_dim), dtype=torch.float32)
            full = torch.from_numpy(~partial)
            summaries[full] = summarize_keys(keys[full], kind=layout.summary_kind)
            summaries[~full] = summarize_keys(keys[~full], torch.from_numpy(valid[partial]), layout.summary_kind)
        summaries = summaries.contiguous()
        size = layout.summary_unit_bytes
        copy_units(
            summaries.data_ptr(), np.arange(n, dtype=np.int64) * size,
            self.base, layout.summary_offsets(request.table, layers, heads, blocks), size,
        )

    def read_summaries(self, request_id: str, first_block: int = 0, num_blocks: int | None = None,
                       dtype: str | torch.dtype = torch.float32) -> torch.Tensor | QuantizedSummaries:
        """[layers, kv_heads, blocks, 2, head_dim] summaries of a block range, as dtype
        (float32 as kept, bfloat16 rounded outward: still a bound, half the bytes; or uint8
        codes over the range's own per-channel ranges, a quarter)."""
        dtype = summary_read_dtype(dtype)
        with self.pinned(request_id) as request:
            layout = request.layout
            total = request.table.size
            count = total - first_block if num_blocks is None else num_blocks
            if first_block < 0 or count < 0 or first_block + count > total:
                raise self.counted(BlockOutOfRange(
                    f"summary blocks [{first_block}, {first_block + count}) out of range [0, {total})",
                    index_kind="block", index=first_block + count - 1, bound=total,
                ))
            out = torch.empty((count, layout.num_layers, layout.num_kv_heads, 2, layout.head_dim), dtype=torch.float32)
            size = layout.summary_bytes_per_block
            src = request.table[first_block:first_block + count] + layout.kv_bytes_per_block
            copy_units(self.base, src, out.data_ptr(), np.arange(count, dtype=np.int64) * size, size)
        return read_as(out.permute(1, 2, 0, 3, 4).contiguous(), dtype)

    def record_read(self, units: int, nbytes: int, transport: str) -> None:
        self.metrics.blocks_read.labels(transport).inc(units)
        self.metrics.bytes_served.labels(transport).inc(nbytes)

    def record_write(self, units: int, nbytes: int, transport: str) -> None:
        self.metrics.blocks_written.labels(transport).inc(units)
        self.metrics.bytes_written.labels(transport).inc(nbytes)

    def arena_runs(self, offsets: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
        """Absolute (address, length) runs covering arena units at offsets, in order."""
        starts, _, lengths = merge_runs(offsets, np.arange(offsets.size, dtype=np.int64) * unit, unit)
        return starts + self.base, lengths

    def counted(self, error: KVStoreError) -> KVStoreError:
        """Count an error this store refuses with, and mark it so the server does not count it again."""
        self.metrics.errors.labels(type(error).__name__).inc()
        error.counted = True
        return error

    # --- internals -----------------------------------------------------------------------

    def _full(self, request_id: str, exc: StoreFull) -> StoreFull:
        # "0 of 4292608 free" while live requests used under 500 KB: the rest waited on NIXL clients.
        held = [r for r in self._held.values() if r.table.size]
        held_bytes = sum(int(r.table.size) * r.layout.chunk_bytes for r in held)
        message = f"request {request_id!r}: {exc.message}"
        if held_bytes:
            message += (f"; {held_bytes} bytes are held by {len(held)} freed requests until the NIXL clients "
                        "that cached their block tables drop them")
        return StoreFull(message, request_id=request_id, held_bytes=held_bytes, **exc.fields)

    def _get(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise self.counted(UnknownRequest(f"unknown request {request_id!r} (never allocated, freed, or expired)",
                                              request_id=request_id))
        return request

    def _retire(self, request: _Request) -> None:
        del self._requests[request.request_id]
        request.dead = True
        if request.holders:
            request.hold_deadline = self.clock() + self.hold_s
            self._held[request.serial] = request
            self.metrics.requests.labels("held").inc()
        self._release_if_unused(request)
        self._update_gauges()

    def _release_if_unused(self, request: _Request) -> None:
        if not request.dead or request.pins or request.holders:
            return
        # A request of no blocks is let go too: it stayed held, its hold "expiring" at every tick.
        was_held = self._held.pop(request.serial, None) is not None
        if request.table.size:
            self.allocator.release(request.table, request.layout.chunk_bytes)
            request.table = np.zeros(0, np.int64)
        elif not was_held:
            return
        self._update_gauges()

    def _end_overdue_holds(self) -> None:
        now = self.clock()
        with self._lock:
            gone = {h for h, at in self._gone.items() if at < now}
            for holder in gone:
                del self._gone[holder]
            if gone:
                for request in [*self._held.values(), *self._requests.values()]:
                    request.holders -= gone
                    self._release_if_unused(request)
            # Holders cleared: a request still pinned then stays held until it is unpinned, and
            # was warned about and counted again at every tick.
            overdue = [r for r in self._held.values() if r.hold_deadline < now and r.holders]
            for request in overdue:
                log.warning("request %r: NIXL clients %s did not drop its block table within %.0f s of its free; "
                            "reusing its memory", request.request_id, sorted(request.holders), self.hold_s)
                request.holders.clear()
                self.metrics.requests.labels("hold_expired").inc()
                self._release_if_unused(request)

    def _update_gauges(self) -> None:
        self.metrics.used_bytes.set(self.allocator.used_bytes)
        self.metrics.free_bytes.set(self.allocator.free_bytes)
        self.metrics.live_requests.set(len(self._requests))
        self.metrics.held_requests.set(len(self._held))

    def _clear_summaries(self, layout: KVLayout, chunks: np.ndarray) -> None:
        # Reused chunks hold an old request's summaries; zeros score 0 until the block is written.
        size = layout.summary_bytes_per_block
        for start in (chunks + self.base + layout.kv_bytes_per_block).tolist():
            ctypes.memset(start, 0, size)

    def _notify_released(self, request: _Request) -> None:
        for listener in list(self.release_listeners):
            try:
                listener(request.request_id, request.serial)
            except Exception:  # a listener must never break free()
                pass


def check_unit_bytes(request: _Request, unit_bytes: int | None) -> None:
    """A client sizes its buffer slots from the layout it cached. If the id now names a request
    of another geometry (freed and allocated again), refuse rather than copy the wrong size."""
    if unit_bytes is not None and int(unit_bytes) != request.layout.unit_bytes:
        raise InvalidArgument(
            f"request {request.request_id!r} has {request.layout.unit_bytes}-byte units, the client assumed {unit_bytes}",
            unit_bytes=request.layout.unit_bytes,
        )


# How many times over a request's units one read or write may name them (a unit may repeat).
MAX_REPEATS = 4


def _check_request_id(request_id: str) -> None:
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument(f"request id must be a non-empty str of at most {MAX_REQUEST_ID_LEN} chars, got {request_id!r}")
    try:
        request_id.encode()
    except UnicodeEncodeError:  # a lone surrogate, which JSON carries: the NIXL free notice could not name it
        raise InvalidArgument(f"request id must be valid Unicode (UTF-8 encodable), got {request_id!r}") from None

