"""Sparse attention over a request's resident units, read straight from the device pool (Triton).

The torch path (`decode_node.attention.gathered_attention`) first gathers every selected unit's K and V
into a fresh [B, kv_heads, R * block_size, d] copy and then attends to it. Decode is bandwidth
bound, so that copy roughly triples the memory traffic of the step. This kernel reads each unit
where it lies in the pool, by id, and keeps the softmax online, so K and V are read exactly once.

The query heads sharing a KV head are stacked with their query rows into one tile, so each unit
is loaded once per group rather than once per query head. A (sequence, KV head)'s units are split
across programs (split-K, as flash-decoding does): on a GPU one program per (sequence, KV head)
ran 8 programs on 132 SMs for 4 sequences of a 2-KV-head model and walked 2,000 units one after
another (H200: 0.9 ms a layer for 134 units, 3x slower than gathering). Each program keeps
its own online softmax over a slice of the units, and `_combine_splits` merges the slices.
Arithmetic is fp32 throughout, like the torch path, so both give the same answer.
"""

from __future__ import annotations

import os

import torch

# Triton is optional (CPU-only torch wheels do not pull it in), and importing it costs ~0.4 s, so it
# is imported on first use; the kernel's body reads `tl` from these module globals.
triton = None
tl = None
_IMPORT_TRIED = False

# Tile edges below 16 are not accepted by tl.dot.
_MIN_TILE = 16
# Keys a program attends per loop iteration: several units' worth, so each iteration has more
# loads in flight than one 16-slot unit gives.
_KEYS_PER_TILE = 64
# Programs to aim for per SM when splitting the units: enough that every SM has work and the
# memory system sees many independent loads.
_PROGRAMS_PER_SM = 4


def _import_triton() -> bool:
    global triton, tl, _IMPORT_TRIED
    if not _IMPORT_TRIED:
        _IMPORT_TRIED = True
        try:
            import triton as triton_module
            import triton.language as language
        except ImportError:
            return False
        triton, tl = triton_module, language
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available(device: torch.device | str) -> bool:
    """Whether `sparse_paged_attention` can run for tensors on `device`: Triton imports, and
    either the device is a GPU that torch can use or Triton's interpreter is on
    (TRITON_INTERPRET=1, which must be set before the process first imports triton; see `_kernel`)."""
    if not _import_triton():
        return False
    if torch.device(device).type == "cuda":
        return torch.cuda.is_available()
    return _interpreting()


def _attention_program(
    queries_ptr, pool_ptr, unit_ids_ptr, key_positions_ptr, query_positions_ptr, max_ptr, sum_ptr, acc_ptr,
    q_stride_seq, q_stride_head, q_stride_row, q_stride_dim,
    pool_stride_unit, pool_stride_kv, pool_stride_slot, pool_stride_dim,
    ids_stride_seq, ids_stride_head, ids_stride_unit,
    kpos_stride_seq, kpos_stride_head, kpos_stride_key,
    qpos_stride_seq, qpos_stride_row,
    num_units, units_per_split, query_rows, block_size, head_dim, window, scale,
    GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_KEYS: tl.constexpr, UNITS_PER_TILE: tl.constexpr, BLOCK_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Tile row r is query row (r % query_rows) of query head (kv_head * GROUP + r // query_rows).
    rows = tl.arange(0, BLOCK_ROWS)
    row_valid = rows < GROUP * query_rows
    row_head = kv_head * GROUP + rows // query_rows
    row_query = rows % query_rows  # always a real query row, so position loads need no mask
    dims = tl.arange(0, BLOCK_DIM)
    dim_valid = dims < head_dim
    # A key tile spans UNITS_PER_TILE units (scattered in the pool): key j is slot j % BLOCK_KEYS
    # of the tile's unit j // BLOCK_KEYS.
    keys = tl.arange(0, UNITS_PER_TILE * BLOCK_KEYS)
    key_unit = keys // BLOCK_KEYS
    key_slot = keys % BLOCK_KEYS
    slot_valid = key_slot < block_size

    q_offsets = row_head[:, None] * q_stride_head + row_query[:, None] * q_stride_row + dims[None, :] * q_stride_dim
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(queries_ptr + seq * q_stride_seq + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
    q_pos = tl.load(query_positions_ptr + seq * qpos_stride_seq + row_query * qpos_stride_row)

    ids_base = unit_ids_ptr + seq * ids_stride_seq + kv_head * ids_stride_head
    kpos_base = key_positions_ptr + seq * kpos_stride_seq + kv_head * kpos_stride_head

    row_max = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_ROWS,), tl.float32)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_DIM), tl.float32)
    begin = split * units_per_split
    end = tl.minimum(begin + units_per_split, num_units)
    for first in range(begin, end, UNITS_PER_TILE):
        unit_index = first + key_unit
        key_valid = slot_valid & (unit_index < end)
        unit = tl.load(ids_base + unit_index * ids_stride_unit, mask=key_valid, other=0).to(tl.int64)  # pools exceed 2**31 elements
        k_ptrs = (pool_ptr + unit[:, None] * pool_stride_unit + key_slot[:, None] * pool_stride_slot
                  + dims[None, :] * pool_stride_dim)
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(k_ptrs + pool_stride_kv, mask=kv_mask, other=0.0).to(tl.float32)
        k_pos = tl.load(kpos_base + (unit_index * block_size + key_slot) * kpos_stride_key, mask=key_valid, other=0)

        allowed = (k_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        if HAS_WINDOW:
            allowed = allowed & ((q_pos[:, None] - k_pos[None, :]) < window)
        # "ieee": tf32 (Triton's default for fp32 dots on GPUs) would drift ~1e-3 from the torch path.
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        scores = tl.where(allowed, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # Rows that have seen no key yet keep a -inf max; shift by 0 instead so exp gives 0, not nan.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - shift[:, None])
        rescale = tl.exp(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision="ieee")
        row_max = new_max

    # This split's unnormalized part; `_combine_splits` merges the splits of each (sequence, KV head).
    part = (seq * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split
    tl.store(max_ptr + part * BLOCK_ROWS + rows, row_max)
    tl.store(sum_ptr + part * BLOCK_ROWS + rows, row_sum)
    tl.store(acc_ptr + (part * BLOCK_ROWS + rows[:, None]) * BLOCK_DIM + dims[None, :], acc)


# Whether Triton compiles or interprets is fixed per process when `triton` is first imported:
# its own library functions (tl.sum, tl.max, ...) are @triton.jit'd then, from TRITON_INTERPRET,
# and a kernel of the other mode cannot call them (an interpreted kernel may also leave
# triton.language patched, breaking later compiles). So the variable must be set before anything
# in the process imports triton (torch may); the tests use a child process for the interpreter.
# Jitting here on first use, rather than at import, keeps Triton out of processes that never call.
_jitted_kernel = None


def _kernel():
    global _jitted_kernel
    if not _import_triton():
        raise RuntimeError("triton is not installed")
    if _jitted_kernel is None:
        _jitted_kernel = triton.jit(_attention_program)
    return _jitted_kernel


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _validate(queries, units_kv, unit_ids, key_positions, query_positions, window) -> None:
    named = {"queries": queries, "units_kv": units_kv, "unit_ids": unit_ids,
             "key_positions": key_positions, "query_positions": query_positions}
    expected_dims = {"queries": 4, "units_kv": 4, "unit_ids": 3, "key_positions": 3, "query_positions": 2}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
        if tensor.dim() != expected_dims[name]:
            raise ValueError(f"{name} must have {expected_dims[name]} dimensions, got shape {tuple(tensor.shape)}")
    devices = {name: t.device for name, t in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")
    for name in ("unit_ids", "key_positions", "query_positions"):
        if not _is_integer(named[name]):
            raise ValueError(f"{name} must have an integer dtype, got {named[name].dtype}")
    for name in ("queries", "units_kv"):
        if not named[name].dtype.is_floating_point:
            raise ValueError(f"{name} must have a floating dtype, got {named[name].dtype}")

    num_seqs, heads, rows, head_dim = queries.shape
    num_seqs_ids, kv_heads, num_units = unit_ids.shape
    _, pair, block_size, pool_head_dim = units_kv.shape
    if pair != 2:
        raise ValueError(f"units_kv must be [units, 2 (K, V), block_size, head_dim], got {tuple(units_kv.shape)}")
    if pool_head_dim != head_dim:
        raise ValueError(f"head_dim of queries ({head_dim}) and units_kv ({pool_head_dim}) differ")
    if num_seqs_ids != num_seqs:
        raise ValueError(f"unit_ids has {num_seqs_ids} sequences, queries {num_seqs}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if tuple(key_positions.shape) != (num_seqs, kv_heads, num_units * block_size):
        raise ValueError(
            f"key_positions must be {(num_seqs, kv_heads, num_units * block_size)} "
            f"([B, kv_heads, units * block_size]), got {tuple(key_positions.shape)}"
        )
    if tuple(query_positions.shape) != (num_seqs, rows):
        raise ValueError(f"query_positions must be {(num_seqs, rows)} ([B, Tq]), got {tuple(query_positions.shape)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window must be an int or None, got {window!r}")


def sparse_paged_attention(
    queries: torch.Tensor,
    units_kv: torch.Tensor,
    unit_ids: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    window: int | None,
    scale: float,
    units_per_split: int | None = None,
) -> torch.Tensor:
    """GQA attention of each sequence's query rows over its KV heads' resident units.

    queries [B, heads, Tq, d]; units_kv [N, 2, block_size, d] (the pool, 0 = K, 1 = V);
    unit_ids [B, kv_heads, R] which units each (sequence, KV head) attends to, in key order;
    key_positions [B, kv_heads, R * block_size] (PAD_POSITION for empty slots);
    query_positions [B, Tq]. Keys are causal and, with `window`, within it; a row that may see
    no key sees key 0, as `position_mask` does. Returns fp32 [B, heads, Tq, d], equal to
    `attend_gathered` over the gathered units. Unit ids are not range-checked (that would cost
    a device sync per call): they must index `units_kv`. `units_per_split`: how many units one
    program attends; by default whole tiles, sized to the GPU.
    """
    _validate(queries, units_kv, unit_ids, key_positions, query_positions, window)
    if units_per_split is not None and (isinstance(units_per_split, bool) or not isinstance(units_per_split, int)
                                        or units_per_split < 1):
        raise ValueError(f"units_per_split must be a positive int or None, got {units_per_split!r}")
    device = queries.device
    if not triton_available(device):
        raise RuntimeError(
            f"Triton sparse attention needs Triton and a CUDA device (or TRITON_INTERPRET=1); "
            f"got device {device}, triton {'importable' if _import_triton() else 'not importable'}"
        )
    num_seqs, heads, rows, head_dim = queries.shape
    _, kv_heads, num_units = unit_ids.shape
    block_size = units_kv.shape[2]
    group = heads // kv_heads
    if num_units == 0 or queries.numel() == 0:
        # No keys: the torch path's softmax over nothing also yields zeros.
        return torch.zeros((num_seqs, heads, rows, head_dim), dtype=torch.float32, device=device)
    block_rows = max(_MIN_TILE, _next_power_of_two(group * rows))
    block_keys = max(_MIN_TILE, _next_power_of_two(block_size))
    block_dim = max(_MIN_TILE, _next_power_of_two(head_dim))
    units_per_tile = max(1, _KEYS_PER_TILE // block_keys)
    per_split = units_per_split or _units_per_split(num_units, num_seqs * kv_heads, units_per_tile, device)
    splits = -(-num_units // per_split)
    parts = (num_seqs, kv_heads, splits, block_rows)
    maxes = torch.empty(parts, dtype=torch.float32, device=device)
    sums = torch.empty(parts, dtype=torch.float32, device=device)
    accs = torch.empty((*parts, block_dim), dtype=torch.float32, device=device)

    _kernel()[(num_seqs, kv_heads, splits)](
        queries, units_kv, unit_ids, key_positions, query_positions, maxes, sums, accs,
        *queries.stride(),
        *units_kv.stride(),
        *unit_ids.stride(),
        *key_positions.stride(),
        *query_positions.stride(),
        num_units, per_split, rows, block_size, head_dim, window or 0, float(scale),
        GROUP=group,
        HAS_WINDOW=window is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_KEYS=block_keys,
        UNITS_PER_TILE=units_per_tile,
        BLOCK_DIM=block_dim,
    )
    first_values = units_kv[unit_ids[:, :, 0], 1, 0, :].float()  # [B, kv_heads, d]
    combined = _combine_splits(maxes, sums, accs[..., :head_dim], first_values)
    return combined[:, :, : group * rows].reshape(num_seqs, heads, rows, head_dim)


def _units_per_split(num_units: int, programs: int, units_per_tile: int, device: torch.device) -> int:
    """Units per program: the (sequence, KV head) pairs' units split so the GPU has about
    _PROGRAMS_PER_SM programs per SM, at least one tile each. The interpreter runs programs one
    after another, so there a pair is not split."""
    tiles = -(-num_units // units_per_tile)
    if device.type != "cuda":
        return tiles * units_per_tile
    target = _PROGRAMS_PER_SM * _multiprocessors(device)
    splits = min(tiles, max(1, -(-target // programs)))
    return -(-tiles // splits) * units_per_tile


_SM_COUNTS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _combine_splits(maxes: torch.Tensor, sums: torch.Tensor, accs: torch.Tensor,
                    first_values: torch.Tensor) -> torch.Tensor:
    """The softmax-weighted values of every tile row from its splits' parts: maxes and sums
    [B, kv_heads, S, rows], accs [B, kv_heads, S, rows, d] (each split's sum of exp(score - its
    max) * value). A row no split let see a key takes the first unit's first value, as
    `position_mask` lets such a row see key 0. Returns [B, kv_heads, rows, d]."""
    top = maxes.amax(dim=2, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # no key anywhere: weights 0, not nan
    weights = torch.exp(maxes - top)
    total = (sums * weights).sum(dim=2)
    values = (accs * weights[..., None]).sum(dim=2)
    sees_nothing = total == 0.0
    out = values / torch.where(sees_nothing, torch.ones_like(total), total)[..., None]
    return torch.where(sees_nothing[..., None], first_values[:, :, None, :], out)
