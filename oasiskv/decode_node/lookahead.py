"""Block selection: score every block against the key summaries, keep the top-K per layer and
KV head, and turn the difference with what is resident into a fetch list.

`lookahead` scores with the draft rows' queries (they approximate the next step's query) and
prefetches for the next step; `sparse-current` scores with the current query and fetches before
attending. Both go through `plan_replacements`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kvstore import block_scores
from .working_set import EMPTY, WorkingSet


@dataclass
class FetchPlan:
    heads: list[int]
    blocks: list[int]
    row_indices: list[int]  # index into the working set's rows

    def __len__(self) -> int:
        return len(self.blocks)


def score_blocks(queries: torch.Tensor, summaries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """queries [rows, q_heads, d]; summaries [kv_heads, blocks, 2, d] -> [kv_heads, blocks].

    Several query rows (the drafts) vote by their best bound; non-candidates get -inf."""
    scores = block_scores(queries, summaries).amax(dim=0)
    return scores.masked_fill(~candidates[None, :], float("-inf"))


def top_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[kv_heads, blocks] -> [kv_heads, k'] block ids, best first (k' <= number of candidates)."""
    available = int(torch.isfinite(scores[0]).sum())
    k = min(k, available)
    if k == 0:
        return scores.new_empty((scores.shape[0], 0), dtype=torch.long)
    return torch.topk(scores, k, dim=-1).indices


def plan_replacements(
    ws: WorkingSet, layer: int, wanted: torch.Tensor, step: int, max_replace: int | None
) -> FetchPlan:
    """Make the budget rows of `layer` converge to `wanted` ([kv_heads, k], best first).

    Resident wanted blocks are marked selected at `step`; missing ones (best first, at most
    `max_replace` per head) take the rows of empty or least-recently-selected unwanted blocks.
    """
    plan = FetchPlan([], [], [])
    budget = ws.budget_slice
    base = budget.start
    for head in range(wanted.shape[0]):
        resident = ws.blocks[layer, head, budget]
        want = wanted[head]
        hit = torch.isin(resident, want) & (resident != EMPTY)
        ws.last_selected[layer, head, budget][hit] = step
        missing = want[~torch.isin(want, resident)]
        if max_replace is not None:
            missing = missing[:max_replace]
        if missing.numel() == 0:
            continue
        # Free rows first (never used), then the least recently selected of the unwanted.
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


def recall(predicted: torch.Tensor, actual: torch.Tensor) -> float:
    """Share of `actual` ([kv_heads, k]) found in `predicted` ([kv_heads, *]), over all heads."""
    if actual.numel() == 0:
        return 1.0
    found = sum(int(torch.isin(actual[h], predicted[h]).sum()) for h in range(actual.shape[0]))
    return found / actual.numel()
