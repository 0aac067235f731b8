"""`plan_replacements` (all heads at once) and `plan_replacements_many` (all requests at once)
against the per-head loop they replaced, on random working sets: the same fetch plan, the same
block map, the same recency, step after step."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oasiskv.decode_node.lookahead import (
    FetchPlan,
    PlanRequest,
    plan_replacements,
    plan_replacements_many,
    recall,
    replacement_cap,
)
from oasiskv.decode_node.working_set import EMPTY, RowPlan, WorkingSet


def reference_plan_replacements(ws: WorkingSet, layer: int, wanted: torch.Tensor, step: int,
                                max_replace: int | None, fetch_depth: int | None = None) -> FetchPlan:
    """The original implementation, one head at a time (the reference for the vectorized one)."""
    plan = FetchPlan([], [], [])  # lists here; the real one returns arrays
    budget = ws.budget_slice
    base = budget.start
    for head in range(wanted.shape[0]):
        resident = ws.blocks[layer, head, budget]
        want = wanted[head]
        hit = torch.isin(resident, want) & (resident != EMPTY)
        ws.last_selected[layer, head, budget][hit] = step
        fetchable = want[:fetch_depth]
        missing = fetchable[~torch.isin(fetchable, resident)]
        # A missing block never evicts a wanted one (only reachable with more wanted than rows).
        limit = int((~hit).sum())
        missing = missing[: limit if max_replace is None else min(max_replace, limit)]
        if missing.numel() == 0:
            continue
        recency = ws.last_selected[layer, head, budget].clone()
        recency[resident == EMPTY] = -1
        recency[hit] = torch.iinfo(torch.long).max
        order = torch.argsort(recency, stable=True)[: missing.numel()]
        for row_offset, block in zip(order.tolist(), missing.tolist()):
            row = base + row_offset
            ws.blocks[layer, head, row] = block
            ws.last_selected[layer, head, row] = step
            plan.heads.append(head)
            plan.blocks.append(block)
            plan.row_indices.append(row)
    return plan


def _random_ws(g: torch.Generator, layers: int, heads: int, budget: int, num_blocks: int,
               duplicates: bool) -> WorkingSet:
    plan = RowPlan(sinks=1, ring=3, budget=budget)
    ws = WorkingSet("r", torch.arange(plan.total), plan, layers, heads, 16)
    shape = ws.blocks[:, :, ws.budget_slice].shape
    if duplicates:  # not a state the engine reaches; the two must still agree
        blocks = torch.randint(0, num_blocks, shape, generator=g)
    else:
        blocks = torch.stack([torch.randperm(max(num_blocks, budget), generator=g)[:budget]
                              for _ in range(layers * heads)]).reshape(shape)
    empty = torch.rand(shape, generator=g) < 0.3
    ws.blocks[:, :, ws.budget_slice] = blocks.masked_fill(empty, EMPTY)
    ws.last_selected[:, :, ws.budget_slice] = torch.randint(0, 4, shape, generator=g)  # many ties
    return ws


def _random_wanted(g: torch.Generator, heads: int, k: int, num_blocks: int) -> torch.Tensor:
    if k == 0:
        return torch.empty((heads, 0), dtype=torch.long)
    return torch.stack([torch.randperm(max(num_blocks, k), generator=g)[:k] for _ in range(heads)])


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    heads=st.integers(1, 8),
    budget=st.integers(0, 24),
    num_blocks=st.integers(1, 60),
    k_extra=st.integers(-24, 3),
    max_replace=st.one_of(st.none(), st.integers(0, 30)),
    fetch_depth=st.one_of(st.none(), st.integers(1, 24)),
    duplicates=st.booleans(),
    steps=st.integers(1, 4),
)
def test_vectorized_plan_matches_the_per_head_loop(seed, heads, budget, num_blocks, k_extra, max_replace,
                                                    fetch_depth, duplicates, steps):
    g = torch.Generator().manual_seed(seed)
    layers = 2
    fast = _random_ws(g, layers, heads, budget, num_blocks, duplicates)
    slow = _random_ws(torch.Generator().manual_seed(seed), layers, heads, budget, num_blocks, duplicates)
    assert torch.equal(fast.blocks, slow.blocks)
    for step in range(5, 5 + steps):
        layer = step % layers
        k = max(0, budget + k_extra)  # usually k <= budget (as top_blocks gives), sometimes more
        wanted = _random_wanted(g, heads, k, num_blocks)
        got = plan_replacements(fast, layer, wanted, step, max_replace, fetch_depth)
        expected = reference_plan_replacements(slow, layer, wanted, step, max_replace, fetch_depth)
        assert _as_lists(got) == (expected.heads, expected.blocks, expected.row_indices)
        assert torch.equal(fast.blocks, slow.blocks)
        assert torch.equal(fast.last_selected, slow.last_selected)


def _as_lists(plan: FetchPlan) -> tuple[list, list, list]:
    return plan.heads.tolist(), plan.blocks.tolist(), plan.row_indices.tolist()


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    requests=st.lists(
        st.tuples(
            st.integers(1, 4),  # KV heads
            st.integers(0, 16),  # budget rows
            st.integers(-16, 3),  # k - budget
            st.one_of(st.none(), st.integers(0, 20)),  # max_replace
            st.one_of(st.none(), st.integers(1, 16)),  # fetch_depth
        ),
        min_size=1, max_size=5,
    ),
    num_blocks=st.integers(1, 48),
    steps=st.integers(1, 3),
)
def test_many_requests_at_once_plan_as_each_alone(seed, requests, num_blocks, steps):
    """Requests of different widths, head counts, caps, depths and layers, padded into one
    stack, get exactly the plan (and state) each would get alone."""
    g = torch.Generator().manual_seed(seed)
    layers = 2
    together = [_random_ws(g, layers, heads, budget, num_blocks, False) for heads, budget, *_ in requests]
    alone = [_random_ws(torch.Generator().manual_seed(0), layers, heads, budget, num_blocks, False)
             for heads, budget, *_ in requests]
    for a, b in zip(alone, together):
        a.blocks.copy_(b.blocks)
        a.last_selected.copy_(b.last_selected)
    for step in range(3, 3 + steps):
        part_layers = [(step + n) % layers for n in range(len(requests))]  # parts of one call in different layers
        wanted = [_random_wanted(g, heads, max(0, budget + k_extra), num_blocks)
                  for heads, budget, k_extra, _, _ in requests]
        got = plan_replacements_many(step, [
            PlanRequest(ws, layer, w, cap, depth)
            for ws, layer, w, (_, _, _, cap, depth) in zip(together, part_layers, wanted, requests)
        ])
        for ws, layer, w, (_, _, _, cap, depth), plan in zip(alone, part_layers, wanted, requests, got):
            expected = reference_plan_replacements(ws, layer, w, step, cap, depth)
            assert _as_lists(plan) == (expected.heads, expected.blocks, expected.row_indices)
        for a, b in zip(alone, together):
            assert torch.equal(a.blocks, b.blocks)
            assert torch.equal(a.last_selected, b.last_selected)


def test_plan_prefers_empty_then_least_recently_selected_rows():
    plan = RowPlan(sinks=0, ring=1, budget=4)
    ws = WorkingSet("r", torch.arange(plan.total), plan, 1, 2, 16)
    ws.blocks[0, :, 1:] = torch.tensor([[10, 11, EMPTY, 13], [20, 21, 22, 23]])
    ws.last_selected[0, :, 1:] = torch.tensor([[3, 1, 0, 2], [3, 1, 0, 2]])
    wanted = torch.tensor([[13, 40, 41], [21, 50, 51]])
    fetch = plan_replacements(ws, 0, wanted, 7, max_replace=2)
    # Head 0: 13 stays; 40 takes the empty row (3), 41 the least recently selected unwanted (11, row 2).
    # Head 1: 21 stays; 50 takes 22 (selected at 0, row 3), 51 takes 23 (selected at 2, row 4).
    assert _as_lists(fetch) == ([0, 0, 1, 1], [40, 41, 50, 51], [3, 2, 3, 4])
    assert ws.blocks[0, :, 1:].tolist() == [[10, 41, 40, 13], [20, 21, 50, 51]]
    assert ws.last_selected[0, :, 1:].tolist() == [[3, 7, 7, 7], [3, 7, 7, 7]]
    # The cap: one replacement per head at most.
    fetch = plan_replacements(ws, 0, torch.tensor([[60, 61], [70, 71]]), 8, max_replace=1)
    assert fetch.blocks.tolist() == [60, 70]


def test_fetch_depth_keeps_low_ranked_resident_blocks_but_fetches_only_high_ranked_ones():
    plan = RowPlan(sinks=0, ring=1, budget=4)
    ws = WorkingSet("r", torch.arange(plan.total), plan, 1, 1, 16)
    ws.blocks[0, 0, 1:] = torch.tensor([10, 11, 12, 13])
    ws.last_selected[0, 0, 1:] = torch.tensor([1, 1, 1, 1])
    # Ranked: 40 (missing), 12 (resident), 41 (missing), 13 (resident). Depth 2: only 40 is worth a
    # transfer; 41 is not fetched, yet 13 (ranked below the depth) is kept over 10 and 11.
    fetch = plan_replacements(ws, 0, torch.tensor([[40, 12, 41, 13]]), 5, max_replace=None, fetch_depth=2)
    assert fetch.blocks.tolist() == [40]
    assert fetch.row_indices.tolist() == [1]  # 10's row: unwanted, least recently selected, first by row
    assert ws.blocks[0, 0, 1:].tolist() == [40, 11, 12, 13]
    assert ws.last_selected[0, 0, 1:].tolist() == [5, 1, 5, 5]
    # Nothing missing within the depth: no transfer at all, whatever the cap allows.
    fetch = plan_replacements(ws, 0, torch.tensor([[12, 40, 42, 43]]), 6, max_replace=None, fetch_depth=2)
    assert len(fetch) == 0


def test_replacement_cap_is_a_rate_with_the_fraction_carried_over():
    plan = RowPlan(sinks=0, ring=1, budget=4)
    ws = WorkingSet("r", torch.arange(plan.total), plan, 2, 1, 16)
    assert [replacement_cap(ws, 0, 0.64) for _ in range(6)] == [0, 1, 0, 1, 1, 0]
    assert [replacement_cap(ws, 1, 6.4) for _ in range(5)] == [6, 6, 7, 6, 7]  # layers keep their own credit
    total = sum(replacement_cap(ws, 0, 1.28) for _ in range(100))
    assert total in (127, 128)


def test_a_budget_row_still_landing_is_not_counted_as_attended():
    """Under the miss policy 'skip' a layer attends without its landing rows (they are masked);
    the recall counter counted their blocks as found."""
    plan = RowPlan(sinks=1, ring=2, budget=3)
    ws = WorkingSet("r", torch.arange(plan.total), plan, 1, 2, 16)
    budget = ws.budget_slice
    ws.blocks[0, :, budget] = torch.tensor([[5, 6, 7], [8, 9, EMPTY]])
    ws.in_flight[0, 0, budget.start + 1] = True
    attended = ws.attended_budget_blocks(0)
    assert attended.tolist() == [[5, EMPTY, 7], [8, 9, EMPTY]]
    assert recall(attended, torch.tensor([[6, 7], [8, 9]])) == 0.75
    assert int(ws.blocks[0, 0, budget.start + 1]) == 6  # the working set is left as it was
