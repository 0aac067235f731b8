"""Block layout: how a request's KV and key summaries sit in the store's arena.

The KV of a request is cut into blocks of `block_size` tokens. The unit of transfer is one
*block unit*: the K and V of one block, for one layer and one KV head::

    unit = [2 (K, V), block_size, head_dim] of dtype
    unit_bytes = 2 * block_size * head_dim * itemsize
             (16 tokens, head_dim 64, bf16: 4 KiB;  head_dim 128: 8 KiB)

The store allocates a request block by block. One *chunk* holds everything of one token block
of one request, for all layers and heads, followed by the block's key summaries::

    chunk = [layers, kv_heads, 2, block_size, head_dim] dtype      (layers*kv_heads units)
          + [layers, kv_heads, 2 (lo, hi), head_dim] float32       (summaries, of summary_kind)
          + padding to CHUNK_ALIGN (4 KiB)

A request's *block table* is the int64 array of its chunks' byte offsets in the arena, so the
byte address of any unit is arithmetic, vectorized with numpy over a whole batch::

    unit_offset(layer, head, block) = table[block] + (layer * kv_heads + head) * unit_bytes

Chunks of one request are usually one contiguous run (the allocator carves them together),
which lets consecutive units merge into fewer, larger copies.

Producers/consumers hand the store *slots*: slot i of a buffer is the unit-sized byte range
[i * unit_bytes, (i + 1) * unit_bytes). The canonical host tensors are
`[blocks, kv_heads, 2, block_size, head_dim]` for one layer and
`[layers, blocks, kv_heads, 2, block_size, head_dim]` for a whole request (`pack_layer`,
`pack_request` build them from per-token K and V).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from .config import CHUNK_ALIGN
from .errors import BlockOutOfRange, InvalidArgument
from .summary import DEFAULT_SUMMARY_KIND, check_summary_kind

SUMMARY_DTYPE = torch.float32

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise InvalidArgument(f"unsupported KV dtype {dtype}; use one of {sorted(_DTYPES)}")
    return name


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class KVLayout:
    """KV geometry of one request (one model)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    summary_kind: str = DEFAULT_SUMMARY_KIND  # how the store summarizes keys (kvstore.summary)

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be a positive int, got {value!r}")
        dtype_name(self.dtype)
        check_summary_kind(self.summary_kind)

    # --- sizes (cached: they sit on every transfer's path) ----------------------------------

    @cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @cached_property
    def unit_shape(self) -> tuple[int, int, int]:
        return (2, self.block_size, self.head_dim)

    @cached_property
    def unit_bytes(self) -> int:
        """K and V of one block, one layer, one KV head."""
        return 2 * self.block_size * self.head_dim * self.itemsize

    @cached_property
    def key_bytes(self) -> int:
        """The K half of a unit (the part summaries are computed from)."""
        return self.block_size * self.head_dim * self.itemsize

    @cached_property
    def units_per_block(self) -> int:
        return self.num_layers * self.num_kv_heads

    @cached_property
    def summary_unit_bytes(self) -> int:
        """The (lo, hi) summary of one block's keys, one layer, one KV head, float32."""
        return 2 * self.head_dim * 4

    @cached_property
    def kv_bytes_per_block(self) -> int:
        return self.units_per_block * self.unit_bytes

    @cached_property
    def summary_bytes_per_block(self) -> int:
        return self.units_per_block * self.summary_unit_bytes

    @cached_property
    def chunk_bytes(self) -> int:
        """Arena bytes one token block of a request takes (KV + summaries + padding)."""
        return round_up(self.kv_bytes_per_block + self.summary_bytes_per_block, CHUNK_ALIGN)

    def num_blocks(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.block_size)

    def request_bytes(self, num_tokens: int) -> int:
        return self.num_blocks(num_tokens) * self.chunk_bytes

    # --- addresses -----------------------------------------------------------------------

    def unit_offsets(self, table: np.ndarray, layers, heads, blocks) -> np.ndarray:
        """Byte offsets of units (layer, head, block) given the request's block table.

        Arguments broadcast against each other; indices must already be validated.
        """
        return table[blocks] + (np.asarray(layers, np.int64) * self.num_kv_heads + heads) * self.unit_bytes

    def summary_offsets(self, table: np.ndarray, layers, heads, blocks) -> np.ndarray:
        """Byte offsets of the [2, head_dim] float32 summary of units (layer, head, block)."""
        within = (np.asarray(layers, np.int64) * self.num_kv_heads + heads) * self.summary_unit_bytes
        return table[blocks] + self.kv_bytes_per_block + within

    def check_units(self, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray, num_blocks: int):
        """Raise BlockOutOfRange naming the first bad index (what a caller needs to debug)."""
        for name, values, bound in (
            ("layer", layers, self.num_layers),
            ("kv_head", heads, self.num_kv_heads),
            ("block", blocks, num_blocks),
        ):
            bad = (values < 0) | (values >= bound)
            if bad.any():
                first = int(values[np.argmax(bad)])
                raise BlockOutOfRange(
                    f"{name} index {first} out of range [0, {bound})",
                    index_kind=name, index=first, bound=int(bound),
                )

    # --- wire ----------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        return {
            "num_layers": int(self.num_layers),
            "num_kv_heads": int(self.num_kv_heads),
            "head_dim": int(self.head_dim),
            "block_size": int(self.block_size),
            "dtype": dtype_name(self.dtype),
            "summary_kind": self.summary_kind,
        }

    @staticmethod
    def from_wire(data: dict[str, Any]) -> "KVLayout":
        try:
            dtype = _DTYPES[str(data["dtype"])]
            return KVLayout(
                int(data["num_layers"]), int(data["num_kv_heads"]), int(data["head_dim"]),
                int(data["block_size"]), dtype, str(data.get("summary_kind", "minmax")),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgument(f"bad layout {data!r}: {exc}") from None


def as_index_array(values) -> np.ndarray:
    """1-D int64 array from an int, sequence, numpy array or tensor."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise InvalidArgument(f"indices must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False).reshape(-1)


def broadcast_units(layers, heads, blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(layers, heads, blocks) as three int64 arrays of one length (length-1 ones broadcast)."""
    if all(type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1 for a in (layers, heads, blocks)) \
            and layers.size == heads.size == blocks.size:
        return layers, heads, blocks  # already normalized (the store re-checks the client's arrays)
    arrays = [as_index_array(v) for v in (layers, heads, blocks)]
    lengths = {a.size for a in arrays} - {1}
    if len(lengths) > 1:
        raise InvalidArgument(f"layers/kv_heads/blocks have different lengths {sorted(lengths)}")
    n = lengths.pop() if lengths else 1
    layer_arr, head_arr, block_arr = (np.ascontiguousarray(np.broadcast_to(a, (n,))) for a in arrays)
    return layer_arr, head_arr, block_arr


# --- packing per-token K/V into the canonical block tensors -------------------------------


def pack_layer(keys: torch.Tensor, values: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """[tokens, kv_heads, head_dim] K and V -> [blocks, kv_heads, 2, block_size, head_dim].

    The last block is zero-padded; the store only summarizes a request's real tokens.
    """
    if keys.shape != values.shape or keys.dim() != 3:
        raise InvalidArgument(f"keys/values must both be [tokens, kv_heads, head_dim], got {tuple(keys.shape)}, {tuple(values.shape)}")
    tokens, heads, head_dim = keys.shape
    blocks = -(-tokens // block_size)
    kv = torch.stack((keys, values), dim=1)  # [tokens, 2, heads, head_dim]
    pad = blocks * block_size - tokens
    if pad:
        kv = torch.cat((kv, kv.new_zeros((pad, 2, heads, head_dim))), dim=0)
    return kv.view(blocks, block_size, 2, heads, head_dim).permute(0, 3, 2, 1, 4).contiguous()


def pack_request(keys: torch.Tensor, values: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """[layers, tokens, kv_heads, head_dim] K and V -> [layers, blocks, kv_heads, 2, block_size, head_dim]."""
    if keys.dim() != 4:
        raise InvalidArgument(f"keys/values must be [layers, tokens, kv_heads, head_dim], got {tuple(keys.shape)}")
    return torch.stack([pack_layer(k, v, block_size) for k, v in zip(keys, values)])


def unpack_units(units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2, block_size, head_dim] units -> (keys, values), each [..., block_size, head_dim]."""
    return units[..., 0, :, :], units[..., 1, :, :]
