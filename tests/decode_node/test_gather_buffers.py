"""`gathered_attention` into reused buffers attends exactly as with fresh gathers, across
calls of different sizes and dtypes (the buffers grow, shrink in use, and are overwritten)."""

from __future__ import annotations

import pytest
import torch

from oasiskv.decode_node.attention import gathered_attention
from oasiskv.models.attention import GatherBuffers

from .test_triton_attention import Case, make_inputs


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_reused_buffers_attend_as_fresh_gathers(pool_dtype):
    buffers = GatherBuffers()
    cases = [Case(2, 2, 4, 4, 6, seed=1), Case(3, 2, 4, 4, 12, seed=2), Case(1, 2, 4, 4, 3, window=40, seed=3),
             Case(2, 2, 4, 20, 8, seed=4)]  # 20 rows: the SDPA core, which does not widen
    for case in cases:
        inputs = make_inputs(case, pool_dtype=pool_dtype, query_dtype=pool_dtype)
        expected = gathered_attention(*inputs)
        got = gathered_attention(*inputs, buffers=buffers)
        assert torch.equal(got, expected), case


def test_a_buffer_is_reused_while_it_is_large_enough_and_regrown_when_not():
    buffers = GatherBuffers()
    big = buffers.take("keys", (8, 16, 64), torch.float32, torch.device("cpu"))
    small = buffers.take("keys", (2, 16, 64), torch.float32, torch.device("cpu"))
    assert small.data_ptr() == big.data_ptr()
    other_dtype = buffers.take("keys", (2, 16, 64), torch.bfloat16, torch.device("cpu"))
    assert other_dtype.dtype == torch.bfloat16
    grown = buffers.take("keys", (16, 16, 64), torch.bfloat16, torch.device("cpu"))
    assert grown.shape == (16, 16, 64) and grown.data_ptr() != other_dtype.data_ptr()
