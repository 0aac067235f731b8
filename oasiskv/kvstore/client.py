"""The client API the prefill and decode nodes use, whatever the transport.

    client = connect("10.0.0.5:7300")              # NIXL where importable, else TCP
    client = connect(server)                        # same process: in-process, zero copy
    client.allocate("req-1", layout, num_tokens=2048)
    client.write_layer("req-1", layer, kv).wait()   # kv: [blocks, kv_heads, 2, block_size, head_dim]
    handle = client.read_blocks("req-1", layer, heads, blocks, pool, slots)   # one transfer
    ...; handle.wait()                              # or handle.done() / await handle
    summaries = client.read_summaries("req-1")      # [layers, kv_heads, blocks, 2, head_dim]
    client.free("req-1")

Buffers are addressed in *slots* of one unit (layout.unit_bytes): slot i of a tensor is its bytes
[i * unit_bytes, (i + 1) * unit_bytes), i.e. a [2, block_size, head_dim] K/V pair when the
tensor is shaped [..., slots, 2, block_size, head_dim]. With NIXL, a long-lived buffer (the
decode node's pool) should be registered once with register(): it then stays registered, and
referenced, until unregister(). Any other buffer is registered just for its transfer (a few
microseconds). Buffers must not be touched until their transfer's handle is done.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np
import torch

from .errors import BlockOutOfRange, InvalidArgument
from .hostmem import tensor_bytes
from .inproc import InprocTransport
from .layout import KVLayout, as_index_array, broadcast_units
from .store import KVStore, RequestInfo, StoreStats
from .summary import QuantizedSummaries, summary_read_dtype
from .transport import TransferHandle, Transport

TRANSPORTS = ("auto", "nixl", "tcp", "inproc")


class KVStoreClient:
    MAX_CACHED_LAYOUTS = 65536

    def __init__(self, transport: Transport):
        self.transport = transport
        # Layouts never change for a request id while it lives; cache them to size slots.
        self._layouts: OrderedDict[str, KVLayout] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def transport_name(self) -> str:
        return self.transport.name

    # --- request lifecycle ---------------------------------------------------------------

    def allocate(self, request_id: str, layout: KVLayout, num_tokens: int) -> RequestInfo:
        """Reserve blocks for num_tokens tokens; StoreFull (needed/free bytes) if they do not fit."""
        info = self.transport.allocate(request_id, layout, int(num_tokens))
        self._remember(request_id, info.layout)
        return info

    def extend(self, request_id: str, num_tokens: int) -> RequestInfo:
        """Grow the request to num_tokens tokens (blocks appended during decode)."""
        return self.transport.extend(request_id, int(num_tokens))

    def describe(self, request_id: str) -> RequestInfo:
        info = self.transport.describe(request_id)
        self._remember(request_id, info.layout)
        return info

    def free(self, request_id: str) -> None:
        with self._lock:
            self._layouts.pop(request_id, None)
        self.transport.free(request_id)

    def release(self, request_id: str) -> None:
        """Say this client will not read or write the request again, while it stays allocated
        for another client (a prefill node hands it to a decode node). A NIXL client drops its
        block table, so a free by the other client gives the memory back at once instead of
        after this client's next report (about a second)."""
        with self._lock:
            self._layouts.pop(request_id, None)
        self.transport.release(request_id)

    def touch(self, request_ids: str | Iterable[str]) -> list[str]:
        """Keep requests alive past the TTL; returns the ids the store does not know."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self.transport.touch(ids)

    # --- data ----------------------------------------------------------------------------

    def read_blocks(self, request_id: str, layers, kv_heads, blocks, dst: torch.Tensor, dst_slots=None) -> TransferHandle:
        """Read units (layers[i], kv_heads[i], blocks[i]) into slot dst_slots[i] of dst, as ONE
        batched transfer. Indices broadcast (e.g. one layer, many heads/blocks); dst_slots
        defaults to 0..n-1."""
        layout = self._layout(request_id)
        _check_dtype(dst, layout, "read_blocks")
        layer_idx, head_idx, block_idx = broadcast_units(layers, kv_heads, blocks)
        offsets = _slot_offsets(dst, dst_slots, layer_idx.size, layout.unit_bytes)
        return self.transport.read(request_id, layout, layer_idx, head_idx, block_idx, dst, offsets)

    def write_blocks(self, request_id: str, layers, kv_heads, blocks, src: torch.Tensor, src_slots=None) -> TransferHandle:
        """Write slot src_slots[i] of src to unit (layers[i], kv_heads[i], blocks[i]); the store
        recomputes those units' key summaries. One batched transfer."""
        layout = self._layout(request_id)
        _check_dtype(src, layout, "write_blocks")
        layer_idx, head_idx, block_idx = broadcast_units(layers, kv_heads, blocks)
        offsets = _slot_offsets(src, src_slots, layer_idx.size, layout.unit_bytes)
        return self.transport.write(request_id, layout, layer_idx, head_idx, block_idx, src, offsets)

    def write_layer(self, request_id: str, layer: int, src: torch.Tensor, first_block: int = 0) -> TransferHandle:
        """Write one layer, src = [blocks, kv_heads, 2, block_size, head_dim], to blocks
        first_block.. (prefill: call as each layer finishes)."""
        layout = self._layout(request_id)
        blocks = _check_shape(src, layout, (layout.num_kv_heads, *layout.unit_shape), "write_layer")
        block_idx = np.repeat(np.arange(blocks, dtype=np.int64) + first_block, layout.num_kv_heads)
        head_idx = np.tile(np.arange(layout.num_kv_heads, dtype=np.int64), blocks)
        return self.write_blocks(request_id, layer, head_idx, block_idx, src)

    def write_request(self, request_id: str, src: torch.Tensor, first_block: int = 0) -> TransferHandle:
        """Write all layers, src = [layers, blocks, kv_heads, 2, block_size, head_dim], in one transfer."""
        layout = self._layout(request_id)
        if src.dim() != 6 or src.shape[0] != layout.num_layers:
            raise InvalidArgument(f"write_request needs [layers={layout.num_layers}, blocks, kv_heads, 2, block_size, head_dim], got {tuple(src.shape)}")
        blocks = _check_shape(src[0], layout, (layout.num_kv_heads, *layout.unit_shape), "write_request")
        per_layer = blocks * layout.num_kv_heads
        layer_idx = np.repeat(np.arange(layout.num_layers, dtype=np.int64), per_layer)
        block_idx = np.tile(np.repeat(np.arange(blocks, dtype=np.int64) + first_block, layout.num_kv_heads), layout.num_layers)
        head_idx = np.tile(np.arange(layout.num_kv_heads, dtype=np.int64), blocks * layout.num_layers)
        return self.write_blocks(request_id, layer_idx, head_idx, block_idx, src)

    def read_summaries(self, request_id: str, first_block: int = 0, num_blocks: int | None = None,
                       dtype: str | torch.dtype = torch.float32) -> torch.Tensor | QuantizedSummaries:
        """Key summaries [layers, kv_heads, blocks, 2 (lo, hi), head_dim] as float32, as bfloat16
        (half the bytes; lo rounded down and hi up, so a min/max box is still a bound), or as
        uint8 (`QuantizedSummaries`: codes over per-channel ranges, a quarter of the bytes)."""
        return self.transport.read_summaries(
            request_id, int(first_block), None if num_blocks is None else int(num_blocks), summary_read_dtype(dtype)
        )

    def register(self, tensor: torch.Tensor) -> None:
        """Register a long-lived buffer once (NIXL; a no-op elsewhere). Keeps a reference."""
        self.transport.register(tensor)

    def unregister(self, tensor: torch.Tensor) -> None:
        self.transport.unregister(tensor)

    # --- store ---------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        data = dict(self.transport.stats())
        known = {k: data.pop(k) for k in ("capacity_bytes", "used_bytes", "free_bytes", "num_requests", "free_extents")}
        data.pop("extra", None)
        return StoreStats(**known, extra=data)

    def metrics_text(self) -> str:
        return self.transport.metrics_text()

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------

    def _layout(self, request_id: str) -> KVLayout:
        with self._lock:
            layout = self._layouts.get(request_id)
        if layout is None:
            layout = self.describe(request_id).layout
        return layout

    def _remember(self, request_id: str, layout: KVLayout) -> None:
        with self._lock:
            self._layouts[request_id] = layout
            self._layouts.move_to_end(request_id)
            while len(self._layouts) > self.MAX_CACHED_LAYOUTS:
                self._layouts.popitem(last=False)


def connect(target: Any, transport: str = "auto", timeout: float = 30.0, name: str | None = None) -> KVStoreClient:
    """A client for a store.

    target: "host:port" (or (host, port)) of a store server; or, in the same process, a
    KVStoreServer or KVStore (then transport "auto" means in-process).
    transport: "auto" | "nixl" | "tcp" | "inproc". "auto" picks NIXL when it is importable and
    the store serves it, else TCP.
    """
    if transport not in TRANSPORTS:
        raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout!r}")
    store = target if isinstance(target, KVStore) else getattr(target, "store", None)
    if isinstance(store, KVStore) and transport in ("auto", "inproc"):
        return KVStoreClient(InprocTransport(store, timeout))
    if transport == "inproc":
        raise InvalidArgument("the inproc transport needs a KVStore or KVStoreServer object, not an address")
    address = target.address if isinstance(store, KVStore) else target
    if transport in ("auto", "nixl"):
        from .nixl_transport import NixlTransport, nixl_available

        if nixl_available():
            try:
                return KVStoreClient(NixlTransport(address, timeout, name))
            except Exception as exc:
                if transport == "nixl" or not _is_no_nixl(exc):
                    raise
        elif transport == "nixl":
            raise InvalidArgument("transport 'nixl' requested but nixl is not importable")
    from .tcp import TcpTransport

    return KVStoreClient(TcpTransport(address, timeout, name))


def _is_no_nixl(exc: Exception) -> bool:
    return "does not serve NIXL" in str(exc)


def _check_dtype(buffer, layout: KVLayout, what: str) -> None:
    """Transports copy raw bytes: an fp32 buffer of a bf16 request was taken as bf16 KV (and its
    summaries became inf and NaN). Raw bytes (uint8) stay allowed, as an explicit choice."""
    if isinstance(buffer, torch.Tensor) and buffer.dtype not in (layout.dtype, torch.uint8):
        raise InvalidArgument(f"{what}: the request's KV is {layout.dtype}, the buffer is {buffer.dtype} "
                              "(or give raw bytes as torch.uint8)")


def _slot_offsets(buffer: torch.Tensor, slots, n: int, unit_bytes: int) -> np.ndarray:
    """Byte offsets of unit slots in buffer, bounds-checked (transports copy raw memory)."""
    if not isinstance(buffer, torch.Tensor):
        raise InvalidArgument(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if not buffer.is_contiguous():
        raise InvalidArgument("buffer must be contiguous")
    capacity = tensor_bytes(buffer) // unit_bytes
    slot_idx = np.arange(n, dtype=np.int64) if slots is None else as_index_array(slots)
    if slot_idx.size != n:
        raise InvalidArgument(f"{n} units but {slot_idx.size} slots")
    if n and (slot_idx.min() < 0 or slot_idx.max() >= capacity):
        bad = int(slot_idx[(slot_idx < 0) | (slot_idx >= capacity)][0])
        raise BlockOutOfRange(
            f"slot {bad} out of range: buffer of {tensor_bytes(buffer)} bytes holds {capacity} units of {unit_bytes} bytes",
            index_kind="slot", index=bad, bound=capacity,
        )
    return slot_idx * unit_bytes


def _check_shape(src: torch.Tensor, layout: KVLayout, tail: tuple[int, ...], what: str) -> int:
    """Blocks in a [blocks, *tail] tensor of the layout's dtype."""
    if src.dtype != layout.dtype or tuple(src.shape[1:]) != tail or src.dim() != len(tail) + 1:
        raise InvalidArgument(f"{what} needs a {layout.dtype} tensor [blocks, {', '.join(map(str, tail))}], got {src.dtype} {tuple(src.shape)}")
    return int(src.shape[0])
