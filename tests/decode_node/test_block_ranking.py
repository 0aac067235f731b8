"""The decode node's block ranking: the fused form equals the definition."""

from __future__ import annotations

import pytest
import torch

from oasiskv.decode_node.lookahead import score_blocks, select_blocks, top_blocks
from oasiskv.kvstore import InvalidArgument, block_scores, summarize_layer


@pytest.mark.parametrize("rows,q_heads,kv_heads,weight", [(1, 14, 2, 0.4), (3, 14, 2, 0.4), (4, 9, 3, 1.0), (2, 8, 8, 0.0)])
def test_fused_ranking_equals_the_mean_of_block_scores(rows, q_heads, kv_heads, weight):
    generator = torch.Generator().manual_seed(rows * 100 + q_heads)
    keys = torch.randn(50 * 16, kv_heads, 64, generator=generator)
    summaries = summarize_layer(keys, 16)
    queries = torch.randn(rows, q_heads, 64, generator=generator)
    candidates = torch.rand(50, generator=generator) > 0.3
    expected = block_scores(queries, summaries, weight).mean(dim=0).masked_fill(~candidates[None], float("-inf"))
    torch.testing.assert_close(score_blocks(queries, summaries, candidates, weight), expected, rtol=1e-5, atol=1e-4)


def test_mismatched_query_shape_is_named():
    summaries = summarize_layer(torch.randn(32, 2, 64), 16)
    with pytest.raises(InvalidArgument, match="do not fit"):
        score_blocks(torch.randn(1, 3, 64), summaries, torch.ones(2, dtype=torch.bool))


@pytest.mark.parametrize("first,end,k", [(1, 45, 16), (1, 45, 44), (1, 45, 100), (10, 11, 4), (5, 5, 3)])
def test_selecting_a_run_of_candidates_equals_masking_the_rest(first, end, k):
    """The decode node scores only its candidate run; the masked form is the definition."""
    generator = torch.Generator().manual_seed(first * 1000 + end + k)
    summaries = summarize_layer(torch.randn(50 * 16, 2, 64, generator=generator), 16)
    queries = torch.randn(3, 14, 64, generator=generator)
    candidates = torch.zeros(50, dtype=torch.bool)
    candidates[first:end] = True
    expected = top_blocks(score_blocks(queries, summaries, candidates, 0.4), k)
    got = select_blocks(queries, summaries, first, end, k, 0.4)
    assert got.shape == (2, min(k, end - first))
    assert torch.equal(got, expected)
