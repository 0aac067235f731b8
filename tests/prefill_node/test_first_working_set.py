"""The prefill's first working set per layer (`first_working_set`), on made-up key summaries."""

import torch

from oasiskv.prefill_node.prefill import first_working_set


def _summaries(centers: list[list[float]]) -> torch.Tensor:
    """[1 KV head, blocks, 2, d] summaries whose every key sits at its block's center."""
    c = torch.tensor(centers)
    return torch.stack((c, c), dim=1)[None]


def test_a_sliding_layer_ranks_only_the_blocks_its_first_decode_query_sees():
    """Two query heads share a KV head. Head A points at block 0, which a 32-token window at 48
    tokens hides; head B leans to block 2. Ranked with the hidden block in the softmax, head A
    spent its share on block 0 and head B chose alone: block 2. Among the visible blocks, head A
    prefers block 1 strongly, and the group does too (as the decode node ranks)."""
    summaries = _summaries([[5.0, 0.0], [1.0, 0.0], [0.0, 0.5]])  # blocks 0, 1, 2
    queries = torch.tensor([[[10.0, 0.0], [0.0, 1.0]]])  # [rows, query heads, d]
    choose = dict(summaries=summaries, num_tokens=48, block_size=16, excluded_head_blocks=0,
                  excluded_tail_blocks=0, scale=1.0, radius_weight=0.0)
    assert first_working_set(queries, budget_blocks=1, window=32, **choose).tolist() == [[1]]
    # All three visible: block 0 first. A budget larger than the visible blocks takes hidden ones last.
    assert first_working_set(queries, budget_blocks=1, window=None, **choose).tolist() == [[0]]
    assert first_working_set(queries, budget_blocks=3, window=32, **choose).tolist() == [[1, 2, 0]]


def test_no_candidates_give_an_empty_set_for_every_head():
    summaries = _summaries([[1.0, 0.0]])
    got = first_working_set(torch.ones(1, 2, 2), summaries, 10, 16, 1, 4, 8, None, 1.0, 0.0)
    assert got.shape == (1, 0)
