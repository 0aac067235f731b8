"""`gathered_attention` with reused buffers attends exactly as with fresh tensors, across calls
of different sizes and dtypes (the buffers grow, shrink in use, and are overwritten)."""

from __future__ import annotations

import pytest
import torch

from oasiskv.decode_node.attention import gathered_attention
from oasiskv.models.attention import AttentionBuffers

from .test_triton_attention import Case, make_inputs


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_reused_buffers_attend_as_fresh_tensors(pool_dtype):
    buffers = AttentionBuffers()
    cases = [Case(2, 2, 4, 4, 6, seed=1), Case(3, 2, 4, 4, 12, seed=2), Case(1, 2, 4, 4, 3, window=40, seed=3),
             Case(2, 2, 4, 20, 8, seed=4)]  # 20 rows: the SDPA core, which does not widen
    for case in cases:
        inputs = make_inputs(case, pool_dtype=pool_dtype, query_dtype=pool_dtype)
        expected = gathered_attention(*inputs)
        got = gathered_attention(*inputs, buffers=buffers)
        assert torch.equal(got, expected), case
