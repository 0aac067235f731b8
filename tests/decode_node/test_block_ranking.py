"""The decode node's block ranking: the fused form equals the definition."""

from __future__ import annotations

import pytest
import torch

from oasiskv.decode_node.lookahead import score_blocks
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
