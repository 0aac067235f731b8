"""The dense attention path (`attend_slots`, behind `PagedAttention`) with reused buffers
attends exactly as with fresh tensors: shared and per-head key slots, sliding windows, the
few-rows core and the SDPA core, fp32 and bf16 caches, and calls that grow and shrink the
buffers in turn."""

from __future__ import annotations

import pytest
import torch

from oasiskv.models.attention import AttentionBatch, AttentionBuffers, attend_slots

KV_HEADS, HEADS, HEAD_DIM, BLOCK = 2, 6, 16, 4


def make_batch(contexts: list[int], new: list[int], per_head: bool, seed: int):
    """A paged cache with random K/V, and a batch whose sequences own shuffled blocks of it."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // BLOCK) for c in contexts) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for context in contexts:
        count = -(-context // BLOCK)
        tables.append(order[start:start + count])
        start += count
    batch = AttentionBatch.dense(tables, [c - n for c, n in zip(contexts, new)], new, BLOCK)
    if per_head:  # each KV head reads its own (here: reversed for head 1) slots
        slots = batch.key_slots
        per = torch.stack((slots, slots.flip(-1)), dim=1)
        positions = torch.stack((batch.key_positions, batch.key_positions.flip(-1)), dim=1)
        batch = AttentionBatch(batch.write_slots, batch.query_rows, batch.query_positions, per, positions,
                               batch.output_rows)
    shape = (KV_HEADS, num_blocks * BLOCK, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator)
    v_cache = torch.randn(shape, generator=generator)
    q = torch.randn(sum(new), HEADS, HEAD_DIM, generator=generator)
    return q, k_cache, v_cache, batch


CASES = [  # (contexts, new rows per sequence, window)
    ([37, 20], [1, 1], None),
    ([90, 64, 13], [4, 4, 2], None),
    ([50], [3], 8),
    ([70, 40], [20, 18], None),  # more than FEW_QUERY_ROWS: the SDPA core
    ([12, 9], [1, 1], None),  # smaller again: buffers reused in part
]


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reused_buffers_attend_as_fresh_tensors(dtype, per_head):
    buffers = AttentionBuffers()
    for seed, (contexts, new, window) in enumerate(CASES):
        q, k_cache, v_cache, batch = make_batch(contexts, new, per_head, seed)
        q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
        expected = attend_slots(q, k_cache, v_cache, batch, window, 0.25)
        got = attend_slots(q, k_cache, v_cache, batch, window, 0.25, buffers)
        assert got.shape == expected.shape == q.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{contexts} {new} {window}: {m}")


def test_buffers_really_attend_to_the_cache():
    """Not vacuous: changing one key the batch reads changes the output."""
    q, k_cache, v_cache, batch = make_batch([40], [1], False, seed=9)
    buffers = AttentionBuffers()
    before = attend_slots(q, k_cache, v_cache, batch, None, 0.25, buffers)
    k_cache[:, batch.key_slots[0, 5]] += 3.0
    after = attend_slots(q, k_cache, v_cache, batch, None, 0.25, buffers)
    assert not torch.equal(before, after)


def test_a_buffer_is_reused_while_it_is_large_enough_and_regrown_when_not():
    buffers = AttentionBuffers()
    big = buffers.take("keys", (8, 16, 64), torch.float32, torch.device("cpu"))
    small = buffers.take("keys", (2, 16, 64), torch.float32, torch.device("cpu"))
    assert small.data_ptr() == big.data_ptr()
    other_dtype = buffers.take("keys", (2, 16, 64), torch.bfloat16, torch.device("cpu"))
    assert other_dtype.dtype == torch.bfloat16
    grown = buffers.take("keys", (16, 16, 64), torch.bfloat16, torch.device("cpu"))
    assert grown.shape == (16, 16, 64) and grown.data_ptr() != other_dtype.data_ptr()
