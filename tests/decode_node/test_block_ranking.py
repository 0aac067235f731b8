"""The block ranking: per query head a softmax of the estimated logits, summed over the group."""

from __future__ import annotations

import pytest
import torch

from oasiskv.decode_node.lookahead import Selection, score_blocks, select_blocks, select_blocks_batched, top_blocks
from oasiskv.kvstore import InvalidArgument, block_scores, rank_blocks, summarize_layer

SCALE = 64**-0.5


def literal_ranking(queries, summaries, scale, weight):
    """rank_blocks written out: each row and head's estimated logits, rows averaged, softmax per
    head, heads of a group added."""
    kv_heads = summaries.shape[0]
    rows, q_heads, d = queries.shape
    group = q_heads // kv_heads
    lo, hi = summaries[:, :, 0], summaries[:, :, 1]
    center, radius = (lo + hi) / 2, (hi - lo) / 2
    out = torch.zeros(kv_heads, summaries.shape[1])
    for head in range(kv_heads):
        for g in range(group):
            q = queries[:, head * group + g]  # [rows, d]
            logits = (q @ center[head].T + weight * (q.abs() @ radius[head].T)).mean(0) * scale
            out[head] += torch.softmax(logits, dim=0)
    return out


@pytest.mark.parametrize("rows,q_heads,kv_heads,weight", [(1, 14, 2, 0.2), (3, 14, 2, 0.2), (4, 9, 3, 1.0), (2, 8, 8, 0.0)])
def test_ranking_equals_its_definition(rows, q_heads, kv_heads, weight):
    generator = torch.Generator().manual_seed(rows * 100 + q_heads)
    summaries = summarize_layer(torch.randn(50 * 16, kv_heads, 64, generator=generator), 16)
    queries = torch.randn(rows, q_heads, 64, generator=generator) * 3
    got = rank_blocks(queries, summaries, SCALE, weight)
    torch.testing.assert_close(got, literal_ranking(queries, summaries, SCALE, weight), rtol=1e-5, atol=1e-6)
    # Shares of each head's softmax: a KV head's blocks add up to its group size.
    torch.testing.assert_close(got.sum(dim=1), torch.full((kv_heads,), q_heads / kv_heads))


def test_one_head_per_group_ranks_as_its_logits():
    """Without GQA the softmax changes no order: the ranking is the estimated logit's."""
    generator = torch.Generator().manual_seed(5)
    summaries = summarize_layer(torch.randn(40 * 16, 4, 64, generator=generator), 16)
    queries = torch.randn(1, 4, 64, generator=generator)
    logits = block_scores(queries, summaries, 0.2)[0]
    assert torch.equal(rank_blocks(queries, summaries, SCALE, 0.2).argsort(dim=1, descending=True),
                       logits.argsort(dim=1, descending=True))


def test_a_head_that_ignores_a_block_does_not_veto_it():
    """Head 0 attends to block 1 alone; head 1 gives block 1 a very low logit and spreads over the
    others. Summed logits rank block 1 last (head 1's -60 outweighs head 0's +40); in attention,
    block 1 gets nearly all of head 0's and loses almost nothing of head 1's: it ranks first."""
    d = 4
    keys = torch.zeros(3 * 16, 1, d)
    keys[16:32, 0, 0] = 1.0
    keys[16:32, 0, 1] = -0.6
    keys[32:48, 0, 1] = 0.02
    summaries = summarize_layer(keys, 16)
    queries = torch.zeros(1, 2, d)
    queries[0, 0, 0] = 40.0  # head 0 logits 0 / 40 / 0
    queries[0, 1, 1] = 100.0  # head 1 logits 0 / -60 / 2
    summed = block_scores(queries, summaries, 0.0)[0, 0]
    assert summed.argsort(descending=True).tolist() == [2, 0, 1]
    assert int(rank_blocks(queries, summaries, 0.1, 0.0)[0].argmax()) == 1


def test_mismatched_query_shape_is_named():
    summaries = summarize_layer(torch.randn(32, 2, 64), 16)
    with pytest.raises(InvalidArgument, match="do not fit"):
        score_blocks(torch.randn(1, 3, 64), summaries, torch.ones(2, dtype=torch.bool), SCALE, 0.5)
    with pytest.raises(InvalidArgument, match="do not fit"):
        rank_blocks(torch.randn(4, 64), summaries, SCALE, 0.5)


def test_non_candidates_take_no_share():
    generator = torch.Generator().manual_seed(9)
    summaries = summarize_layer(torch.randn(30 * 16, 2, 64, generator=generator), 16)
    queries = torch.randn(2, 6, 64, generator=generator)
    candidates = torch.rand(30, generator=generator) > 0.4
    scores = score_blocks(queries, summaries, candidates, SCALE, 0.5)
    assert torch.isinf(scores[:, ~candidates]).all()
    torch.testing.assert_close(scores[:, candidates], rank_blocks(queries, summaries[:, candidates], SCALE, 0.5))


@pytest.mark.parametrize("first,end,k", [(1, 45, 16), (1, 45, 44), (1, 45, 100), (10, 11, 4), (5, 5, 3)])
def test_selecting_a_run_of_candidates_equals_masking_the_rest(first, end, k):
    """The decode node scores only its candidate run; the masked form is the definition."""
    generator = torch.Generator().manual_seed(first * 1000 + end + k)
    summaries = summarize_layer(torch.randn(50 * 16, 2, 64, generator=generator), 16)
    queries = torch.randn(3, 14, 64, generator=generator)
    candidates = torch.zeros(50, dtype=torch.bool)
    candidates[first:end] = True
    expected = top_blocks(score_blocks(queries, summaries, candidates, SCALE, 0.5), k)
    got = select_blocks(queries, summaries, first, end, k, SCALE, 0.5)
    assert got.shape == (2, min(k, end - first))
    assert torch.equal(got, expected)


def _mixed_batch(device="cpu") -> list[Selection]:
    """Requests as a decode step has them: runs of different lengths (one empty, one shorter than
    k), 1 or 3 query rows, and both summary kinds' radius weights."""
    generator = torch.Generator().manual_seed(7)
    selections = []
    for i, (blocks, first, end, k, rows, weight) in enumerate(
        [(60, 1, 55, 16, 3, 0.5), (45, 1, 40, 16, 1, 0.2), (30, 1, 9, 16, 3, 0.5), (50, 3, 3, 16, 3, 0.5),
         (80, 2, 75, 40, 2, 0.2)]
    ):
        summaries = summarize_layer(torch.randn(blocks * 16, 2, 64, generator=generator), 16)
        queries = torch.randn(rows, 14, 64, generator=generator)
        selections.append(Selection(queries.to(device), summaries.to(device), first, end, k, weight))
    return selections


def test_batched_selection_equals_selecting_each_request_alone():
    selections = _mixed_batch()
    got = select_blocks_batched(selections, SCALE)
    for s, blocks in zip(selections, got):
        expected = select_blocks(s.queries, s.summaries, s.first, s.end, s.k, SCALE, s.radius_weight)
        assert blocks.shape == tuple(expected.shape) == (2, max(0, min(s.k, s.end - s.first)))
        assert (blocks == expected.numpy()).all()
    assert select_blocks_batched([], SCALE) == []


def test_batched_selection_prefers_a_real_block_whose_share_underflowed_to_padding():
    """A block far below the best gets a softmax share of exactly 0; it must still beat the
    padding of a shorter request's run."""
    summaries = torch.zeros(2, 4, 2, 64)
    summaries[:, 0] = 50.0  # one block far above the others
    queries = torch.ones(1, 14, 64)
    short = Selection(queries, summaries, 0, 4, 4, 0.5)
    long = Selection(queries, torch.zeros(2, 40, 2, 64), 0, 40, 4, 0.5)
    blocks = select_blocks_batched([short, long], SCALE)[0]
    assert sorted(blocks[0].tolist()) == [0, 1, 2, 3]


def test_the_numpy_softmax_equals_torch_softmax():
    """rank_blocks takes the softmax in numpy on the CPU and in torch elsewhere."""
    from oasiskv.kvstore.summary import _softmax_shares_numpy

    logits = torch.randn(2, 7, 300, generator=torch.Generator().manual_seed(13)) * 10
    expected = torch.softmax(logits, dim=-1).sum(dim=1)
    torch.testing.assert_close(_softmax_shares_numpy(logits.clone()), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_ranking_on_cuda_equals_the_cpu_ranking():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    generator = torch.Generator().manual_seed(21)
    summaries = summarize_layer(torch.randn(200 * 16, 2, 64, generator=generator), 16)
    queries = torch.randn(4, 14, 64, generator=generator)
    on_cpu = rank_blocks(queries, summaries, SCALE, 0.5)
    on_cuda = rank_blocks(queries.cuda(), summaries.cuda(), SCALE, 0.5)
    assert on_cuda.device.type == "cuda"
    torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_batched_selection_on_cuda_equals_the_cpu_selection():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    on_cpu = select_blocks_batched(_mixed_batch(), SCALE)
    on_cuda = select_blocks_batched(_mixed_batch("cuda"), SCALE)
    for a, b in zip(on_cpu, on_cuda):
        assert (a == b).all()
