"""The attention path: query rows of several sequences against a per-sequence list of key slots.

Everything a step needs to know about where keys live is an `AttentionBatch`, built once per
forward and shared by all layers. Dense decode builds it from block tables; the decode node
builds it from the blocks it chose to keep resident (a subset, possibly different per KV head),
and the same `attend_slots` function runs both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_cache import PagedKVCache

# Position given to padding keys: larger than any query position, so causality masks them.
PAD_POSITION = 1 << 40
# Up to this many query rows per sequence (decode, speculative verification) a KV group's query
# heads are stacked as rows of one SDPA call; longer (prefill) chunks use SDPA's own GQA.
FEW_QUERY_ROWS = 16


def first_visible_block(query_position: int, window: int, block_size: int) -> int:
    """The first block with a key that a sliding-window layer's query at `query_position` may
    see (`position_mask`: keys less than `window` positions back)."""
    return max(0, query_position - window + 1) // block_size


def position_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """query_positions [B, Tq]; key_positions [B, L] or [B, kv_heads, L] -> bool
    [B, 1|kv_heads, Tq, L]: causal, and within `window` for sliding layers."""
    keys = key_positions if key_positions.dim() == 3 else key_positions[:, None]
    q = query_positions[:, None, :, None]
    k = keys[:, :, None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    # A padding query row may see nothing; give it one key so softmax stays finite.
    empty = ~allowed.any(dim=-1, keepdim=True)
    if bool(empty.any()):
        allowed[..., :1] |= empty
    return allowed


@dataclass
class AttentionBatch:
    write_slots: torch.Tensor  # [tokens] where each new token's K/V goes
    query_rows: torch.Tensor  # [B, Tq] row of the flat token batch (tokens = padding row)
    query_positions: torch.Tensor  # [B, Tq]
    key_slots: torch.Tensor  # [B, L] or [B, kv_heads, L] cache slot of each key
    key_positions: torch.Tensor  # same shape as key_slots; padding = PAD_POSITION
    output_rows: torch.Tensor  # [tokens] index into the padded [B * Tq] outputs
    _masks: dict = field(default_factory=dict, repr=False)
    _head_major: dict = field(default_factory=dict, repr=False)

    @property
    def is_single_row(self) -> bool:
        return self.query_rows.shape[1] == 1

    def mask(self, window: int | None) -> torch.Tensor:
        """Boolean [B, 1 or kv_heads, Tq, L]: causal, and within `window` for sliding layers."""
        if window not in self._masks:
            self._masks[window] = position_mask(self.query_positions, self.key_positions, window)
        return self._masks[window]

    def head_major_index(self, slots_per_head: int, kv_heads: int) -> torch.Tensor:
        """Flat [B * kv_heads * L] row of every key in a layer's cache viewed as
        [kv_heads * slots_per_head, d], ordered (sequence, KV head, key): one gather of it is
        [B, kv_heads, L, d]. Built once per batch; every layer reuses it."""
        key = (slots_per_head, kv_heads)
        if key not in self._head_major:
            slots = self.key_slots if self.key_slots.dim() == 3 else self.key_slots[:, None, :]
            heads = torch.arange(kv_heads, device=slots.device)[None, :, None]
            self._head_major[key] = (heads * slots_per_head + slots).reshape(-1)
        return self._head_major[key]

    @classmethod
    def from_key_lists(
        cls,
        query_positions: list[torch.Tensor],
        key_slots: list[torch.Tensor],
        key_positions: list[torch.Tensor],
        write_slots: torch.Tensor,
    ) -> "AttentionBatch":
        """One entry per sequence: its new rows' positions, and the slots/positions of every key
        it may attend to (including its new rows, whose K/V are written before attention).
        Keys are either [L] (shared by all KV heads) or [kv_heads, L]."""
        device = write_slots.device
        num_seqs = len(query_positions)
        lengths = [len(p) for p in query_positions]
        max_q = max(lengths)
        total = sum(lengths)
        max_k = max(s.shape[-1] for s in key_slots)
        head_shape = key_slots[0].shape[:-1]
        rows = torch.full((num_seqs, max_q), total, dtype=torch.long)
        qpos = torch.zeros((num_seqs, max_q), dtype=torch.long)
        kslots = torch.zeros((num_seqs, *head_shape, max_k), dtype=torch.long)
        kpos = torch.full((num_seqs, *head_shape, max_k), PAD_POSITION, dtype=torch.long)
        out_rows = torch.empty(total, dtype=torch.long)
        start = 0
        for i, (n, qp, ks, kp) in enumerate(zip(lengths, query_positions, key_slots, key_positions)):
            rows[i, :n] = torch.arange(start, start + n)
            qpos[i, :n] = qp
            kslots[i, ..., : ks.shape[-1]] = ks
            kpos[i, ..., : kp.shape[-1]] = kp
            out_rows[start : start + n] = i * max_q + torch.arange(n)
            start += n
        return cls(
            write_slots=write_slots,
            query_rows=rows.to(device),
            query_positions=qpos.to(device),
            key_slots=kslots.to(device),
            key_positions=kpos.to(device),
            output_rows=out_rows.to(device),
        )

    @classmethod
    def dense(
        cls,
        block_tables: list[list[int]],
        num_cached: list[int],
        num_new: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionBatch":
        """Every sequence attends to all of its tokens: cached ones and the `num_new` it adds."""
        query_positions, key_slots, key_positions, writes = [], [], [], []
        for table, cached, new in zip(block_tables, num_cached, num_new):
            context = cached + new
            positions = torch.arange(context)
            blocks = torch.as_tensor(table, dtype=torch.long)
            if len(table) * block_size < context:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {context} tokens")
            slots = blocks[positions // block_size] * block_size + positions % block_size
            query_positions.append(positions[cached:])
            key_slots.append(slots)
            key_positions.append(positions)
            writes.append(slots[cached:])
        write_slots = torch.cat(writes).to(device)
        return cls.from_key_lists(query_positions, key_slots, key_positions, write_slots)


class AttentionBuffers:
    """Reused tensors for attention's large per-layer temporaries (the K and V gathers, the
    few-rows core's stacked mask, the selection's widened summaries), grown to the largest step.

    A fresh tensor every layer costs more than the work that fills it on CPU: glibc serves
    allocations above its mmap threshold (moving, at most 32 MiB; dense's K at 16K in fp32 is
    34 MiB for 4 requests) with new mappings, page-faulted in 4 KiB at a time on every use.
    Measured here, gathering 8,192 units' K and V in 24 layers: 472 ms into fresh tensors, 96 ms
    into reused ones. The memory kept is what the largest step uses, which that step needs
    anyway. One owner per attention backend: a buffer is overwritten by the next layer."""

    def __init__(self):
        self._flat: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of `shape`; its contents are garbage, and the next `take` of the
        same name overwrites them."""
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != dtype or flat.device != device:
            flat = torch.empty(numel, dtype=dtype, device=device)
            self._flat[name] = flat
        return flat[:numel].view(shape)


def reused_or_fresh(buffers: AttentionBuffers | None, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor | None:
    """The `out=` of an op: the named reused tensor, or None (a fresh one) without buffers."""
    return None if buffers is None else buffers.take(name, shape, dtype, device)


def gather_rows(source: torch.Tensor, index: torch.Tensor, buffers: AttentionBuffers | None, name: str) -> torch.Tensor:
    """index_select(source, 0, index), into the named reused tensor when there are buffers."""
    out = reused_or_fresh(buffers, name, (index.numel(), *source.shape[1:]), source.dtype, source.device)
    return torch.index_select(source, 0, index, out=out)


def as_fp32(tensor: torch.Tensor, name: str, buffers: AttentionBuffers | None) -> torch.Tensor:
    """`tensor` in float32: itself if it is, else a copy, into the named reused tensor when there are buffers."""
    if buffers is None or tensor.dtype == torch.float32:
        return tensor.float()
    return buffers.take(name, tuple(tensor.shape), torch.float32, tensor.device).copy_(tensor)


def attend_slots(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    window: int | None,
    scale: float,
    buffers: AttentionBuffers | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, d] -> [tokens, heads, d], attending to batch.key_slots of the cache.
    With `buffers`, K and V are gathered (and the core's temporaries made) in reused tensors."""
    num_seqs = batch.query_rows.shape[0]
    head_dim = q.shape[2]
    kv_heads = k_cache.shape[0]
    queries = batch_queries(q, batch)
    # One index_select per tensor straight into [B, kv_heads, L, d], shared or per-head slots
    # alike: contiguous, so the core's matmuls need no copy of it either.
    index = batch.head_major_index(k_cache.shape[1], kv_heads)
    shape = (num_seqs, kv_heads, index.numel() // (num_seqs * kv_heads), head_dim)
    keys, values = (gather_rows(cache.view(-1, head_dim), index, buffers, name).view(shape)
                    for cache, name in ((k_cache, "keys"), (v_cache, "values")))
    out = attend_gathered(queries, keys, values, batch.mask(window), scale, buffers).to(q.dtype)
    return unbatch_outputs(out, batch)


def batch_queries(q: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """Flat [tokens, heads, d] query rows -> padded [B, heads, Tq, d]."""
    if batch.is_single_row and q.shape[0] == batch.query_rows.shape[0]:
        return q[:, None].transpose(1, 2)  # decode: one row per sequence, already in order
    return F.pad(q, (0, 0, 0, 0, 0, 1))[batch.query_rows].transpose(1, 2)


def unbatch_outputs(out: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """Padded [B, heads, Tq, d] outputs -> flat [tokens, heads, d]."""
    num_seqs, heads, max_q, head_dim = out.shape
    out = out.transpose(1, 2).reshape(num_seqs * max_q, heads, head_dim)
    return out if batch.is_single_row and out.shape[0] == num_seqs else out[batch.output_rows]


def attend_gathered(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
    buffers: AttentionBuffers | None = None,
) -> torch.Tensor:
    """queries [B, heads, Tq, d]; keys/values [B, kv_heads, L, d]; mask [B, 1|kv_heads, Tq, L].
    With `buffers`, the few-rows core stacks its mask in them."""
    heads, kv_heads = queries.shape[1], keys.shape[1]
    if queries.shape[2] <= FEW_QUERY_ROWS:
        return _attend_few_rows(queries, keys, values, mask, scale, buffers)
    if mask.shape[1] not in (1, heads):
        mask = mask.repeat_interleave(heads // kv_heads, dim=1)
    return F.scaled_dot_product_attention(
        queries, keys.to(queries.dtype), values.to(queries.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )


def _attend_few_rows(queries, keys, values, mask, scale, buffers=None):
    """Decode and verification (a few rows per sequence): the query heads of a KV group are
    stacked as rows against their shared keys, and one SDPA call attends them all, so K and V
    are read once per group and never copied. SDPA's CPU kernel scores and softmaxes in fp32
    whatever the dtype. On this 2-core CPU (bench/attention_core.py) it is 1.5-2x faster in
    bf16 than explicit fp32 matmuls over widened K/V copies, and as fast or faster in fp32;
    SDPA over the unstacked heads (enable_gqa) was 1.5-10x slower than the stacked call for
    1-4 rows over 2K-8K keys.
    """
    num_seqs, heads, rows, head_dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = queries.reshape(num_seqs, kv_heads, group * rows, head_dim)
    # Every head of a group sees its sequence's mask: [B, kv, group, rows, L] -> [B, kv, group * rows, L].
    shape = (num_seqs, kv_heads, group, rows, length)
    stacked = mask[:, :, None].expand(shape)
    out_mask = reused_or_fresh(buffers, "mask", shape, torch.bool, mask.device)
    stacked = stacked.contiguous() if out_mask is None else out_mask.copy_(stacked)
    out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype),
                                         attn_mask=stacked.view(num_seqs, kv_heads, group * rows, length), scale=scale)
    return out.reshape(num_seqs, heads, rows, head_dim)


class PagedAttention:
    """The dense backend: write the step's K/V into the paged cache, attend to every key."""

    def __init__(self, cache: PagedKVCache, sliding_window: tuple[int | None, ...], scale: float):
        self.cache = cache
        self.sliding_window = sliding_window
        self.scale = scale
        self.batch: AttentionBatch | None = None
        self.buffers = AttentionBuffers()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        self.cache.write(layer, batch.write_slots, k, v)
        return attend_slots(
            q, self.cache.k[layer], self.cache.v[layer], batch, self.sliding_window[layer], self.scale, self.buffers
        )
