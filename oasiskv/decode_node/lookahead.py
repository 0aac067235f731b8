"""Block selection: score every block against the key summaries, keep the top-K per layer and
KV head, and turn the difference with what is resident into a fetch list.

`lookahead` scores with the draft rows' queries (they approximate the next step's query) and
prefetches for the next step; `sparse-current` scores with the current query and fetches before
attending. Both go through `plan_replacements_many`, every (request, layer) of a call at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kvstore import rank_blocks
from ..kvstore.summary import query_weights, softmax_shares
from .summary_pages import PagedLayer
from .working_set import EMPTY, WorkingSet


@dataclass
class FetchPlan:
    """Blocks to fetch into one layer of a working set: int64 arrays of the same length."""

    heads: np.ndarray
    blocks: np.ndarray
    row_indices: np.ndarray  # index into the working set's rows

    @staticmethod
    def empty() -> FetchPlan:
        none = np.empty(0, dtype=np.int64)
        return FetchPlan(none, none, none)

    def __len__(self) -> int:
        return len(self.blocks)


def score_blocks(queries: torch.Tensor, summaries: torch.Tensor, candidates: torch.Tensor, scale: float,
                 radius_weight: float) -> torch.Tensor:
    """queries [rows, q_heads, d]; summaries [kv_heads, blocks, 2, d] -> [kv_heads, blocks]: the
    attention each candidate block can expect (`rank_blocks` over the candidates only, so the
    others take no share of the softmax); non-candidates get -inf. Several query rows (the
    drafts) are averaged: measured, 1-2 points more recall of the next step's exact top-K than
    each block's best row."""
    scores = torch.full((summaries.shape[0], summaries.shape[1]), float("-inf"), device=summaries.device)
    chosen = candidates.nonzero().squeeze(1)
    scores[:, chosen] = rank_blocks(queries, summaries[:, chosen], scale, radius_weight)
    return scores


def select_blocks(queries: torch.Tensor, summaries: torch.Tensor, first: int, end: int, k: int, scale: float,
                  radius_weight: float) -> torch.Tensor:
    """The top-k blocks ([kv_heads, k'], best first) among the candidates first..end-1, ranked as
    `score_blocks` ranks them. The decode node's candidates are always one run of blocks (after
    the sinks, before the window), so only that run is scored: no mask, no -inf, no count."""
    k = min(k, end - first)
    if k <= 0:
        return torch.empty((summaries.shape[0], 0), dtype=torch.long)
    scores = rank_blocks(queries, summaries[:, first:end], scale, radius_weight)
    return torch.topk(scores, k, dim=-1).indices + first


@dataclass
class Selection:
    """One request's part of a batched selection: its query rows ([rows, q_heads, d]), its
    summaries of one layer ([kv_heads, blocks, 2, d], or the decode node's `PagedLayer` of them),
    the run of candidate blocks first..end-1, how many to keep and the radius weight of its
    summary kind."""

    queries: torch.Tensor
    summaries: torch.Tensor | PagedLayer
    first: int
    end: int
    k: int
    radius_weight: float

    def code_steps(self) -> torch.Tensor | None:
        """[kv_heads, 2 * head_dim] when the candidates are codes (uint8 summary pages): what each
        query weight is multiplied by for them; None when they are values."""
        return None if isinstance(self.summaries, torch.Tensor) else self.summaries.code_steps()

    def candidate_summaries(self) -> torch.Tensor:
        """[kv_heads, end - first, 2 * head_dim] float32 (values, or codes: see `code_steps`)."""
        if isinstance(self.summaries, torch.Tensor):
            kv_heads, _, _, head_dim = self.summaries.shape
            return self.summaries[:, self.first : self.end].float().reshape(kv_heads, self.end - self.first, 2 * head_dim)
        return self.summaries.candidates(self.first, self.end)


def select_blocks_batched(selections: list[Selection], scale: float) -> list[np.ndarray]:
    """`select_blocks` for many requests at once: [kv_heads, k'] block ids on the host, best
    first, per selection (k' = min(k, end - first); none when that is 0).

    The query weights, the softmax, the top-k and the copy to the host are one operation each for
    the whole batch, over each request's candidates padded to the longest run; only each
    request's matmul against its own summaries is its own. A decode step ranks every running
    request in every layer, so per-request operations (a dozen each, and on a GPU a host sync
    each for the bookkeeping) were most of the selection's time."""
    live = [i for i, s in enumerate(selections) if min(s.k, s.end - s.first) > 0]
    out = [np.empty((s.summaries.shape[0], 0), dtype=np.int64) for s in selections]
    if not live:
        return out
    chosen = [selections[i] for i in live]
    kv_heads, _, _, head_dim = chosen[0].summaries.shape
    device = chosen[0].summaries.device
    if len({len(s.queries) for s in chosen}) == 1:  # every request verifies as many rows: one stack
        rows = torch.stack([s.queries for s in chosen]).float()  # [R, rows, q_heads, d]
        q_mean, q_abs = rows.mean(dim=1), rows.abs().mean(dim=1)
    else:  # (index_add over row segments woke OpenMP threads: 0.3 ms a call on this CPU, measured)
        q_mean = torch.stack([s.queries.float().mean(dim=0) for s in chosen])
        q_abs = torch.stack([s.queries.float().abs().mean(dim=0) for s in chosen])
    q_mean = q_mean.reshape(len(chosen), kv_heads, -1, head_dim)  # [R, kv_heads, group, d]
    q_abs = q_abs.reshape(len(chosen), kv_heads, -1, head_dim)
    radius = torch.tensor([s.radius_weight for s in chosen], device=device)[:, None, None, None]
    weights = query_weights(q_mean, q_abs, scale, radius)  # [R, kv_heads, group, 2d]
    lengths = [s.end - s.first for s in chosen]
    logits = weights.new_full((len(chosen), kv_heads, weights.shape[2], max(lengths)), float("-inf"))
    for i, s in enumerate(chosen):
        # Gathered (and widened) right before its matmul: on a CPU it is then still in cache.
        steps = s.code_steps()  # codes: the offsets they leave out shift a query head's logits alike
        w = weights[i] if steps is None else weights[i] * steps[:, None, :]
        logits[i, :, :, : lengths[i]] = torch.bmm(w, s.candidate_summaries().transpose(1, 2))
    shares = softmax_shares(logits)  # [R, kv_heads, longest run]; padding gets 0
    padding = torch.arange(shares.shape[-1], device=device) >= torch.tensor(lengths, device=device)[:, None]
    shares = shares.masked_fill(padding[:, None, :], -1.0)  # below any real share, even one that underflowed to 0
    ks = [min(s.k, n) for s, n in zip(chosen, lengths)]
    best = torch.topk(shares, max(ks), dim=-1).indices.cpu().numpy()
    for row, (i, s, k) in enumerate(zip(live, chosen, ks)):
        out[i] = best[row, :, :k] + s.first
    return out


def top_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[kv_heads, blocks] -> [kv_heads, k'] block ids, best first (k' <= number of candidates)."""
    available = int(torch.isfinite(scores[0]).sum())
    k = min(k, available)
    if k == 0:
        return scores.new_empty((scores.shape[0], 0), dtype=torch.long)
    return torch.topk(scores, k, dim=-1).indices


def _membership(values: np.ndarray, of: np.ndarray, span: int) -> np.ndarray:
    """Per row (head): which of `values` ([H, n], in [0, span)) occur in `of` ([H, m], same range).
    A [H, span] lookup table: linear in the sizes, unlike a sort."""
    table = np.zeros((of.shape[0], span), dtype=bool)
    heads = np.arange(of.shape[0])[:, None]
    table[heads, of] = True
    return table[heads, values]


def replacement_cap(ws: WorkingSet, layer: int, blocks_per_step: float) -> int:
    """How many blocks per KV head `layer` may replace this step: `blocks_per_step` on average,
    the fraction left over carried to the next step (0.5 a step gives 0, 1, 0, 1, ...), so
    a rate below one block a step is a rate, not a floor of one."""
    credit = ws.replace_credit[layer] + blocks_per_step
    cap = int(credit)
    ws.replace_credit[layer] = credit - cap
    return cap


@dataclass
class PlanRequest:
    """One part of a batched plan: a working set and one of its layers, the blocks it wants
    there ([kv_heads, k], best first), how many it may replace per head (None: as many as it
    has rows) and, when given, the depth of `wanted` worth a transfer."""

    ws: WorkingSet
    layer: int
    wanted: np.ndarray | torch.Tensor
    max_replace: int | None
    fetch_depth: int | None = None


def plan_replacements(
    ws: WorkingSet, layer: int, wanted: np.ndarray | torch.Tensor, step: int, max_replace: int | None,
    fetch_depth: int | None = None,
) -> FetchPlan:
    """Make the budget rows of `layer` converge to `wanted` ([kv_heads, k], best first).

    Resident wanted blocks are marked selected at `step`; missing ones (best first, at most
    `max_replace` >= 0 per head, and only among the first `fetch_depth` of `wanted` when given)
    take the rows of empty or least-recently-selected unwanted blocks (empty rows first, then by
    last selection, ties by row), never a wanted block's row. The plan lists head by head, best
    first within a head.
    """
    return plan_replacements_many(step, [PlanRequest(ws, layer, wanted, max_replace, fetch_depth)])[0]


def plan_replacements_many(step: int, requests: list[PlanRequest]) -> list[FetchPlan]:
    """`plan_replacements` for many (working set, layer) parts in one pass over all their heads.

    Each (part, KV head) is one row of the stacked arrays, padded to the widest budget and the
    longest `wanted`; padding is never a hit, never missing and never evicted. A decode step
    plans every running request in every layer: the ~40 array operations run once per call,
    not once per request and layer. Measured, most of a call's cost in a decode run is fixed
    (its code and data back in caches the model's weights flushed), so what pays is fewer calls.
    """
    plans = [FetchPlan.empty() for _ in requests]
    live = []
    for i, r in enumerate(requests):
        want = r.wanted.cpu().numpy() if isinstance(r.wanted, torch.Tensor) else np.asarray(r.wanted)
        budget = r.ws.budget_slice
        if want.shape[0] and want.shape[1] and budget.stop > budget.start:
            live.append((i, r, want.astype(np.int64, copy=False), budget))
    if not live:
        return plans
    heads = np.array([want.shape[0] for _, _, want, _ in live])
    widths = np.array([budget.stop - budget.start for _, _, _, budget in live])
    lengths = np.array([want.shape[1] for _, _, want, _ in live])
    first_row = np.concatenate(([0], np.cumsum(heads)))  # row t of the stack: (request, head)
    total, width, length = int(first_row[-1]), int(widths.max()), int(lengths.max())
    # numpy on copies of the (CPU) bookkeeping tensors' rows: each operation ~1 us against ~5-10
    # us of dispatch in torch.
    resident = np.full((total, width), EMPTY, dtype=np.int64)
    selected = np.zeros((total, width), dtype=np.int64)
    want = np.full((total, length), EMPTY, dtype=np.int64)
    limit = np.empty(total, dtype=np.int64)
    depth = np.empty(total, dtype=np.int64)
    for n, (_, r, w, budget) in enumerate(live):
        rows = slice(first_row[n], first_row[n + 1])
        resident[rows, : widths[n]] = r.ws.blocks.numpy()[r.layer, : heads[n], budget]
        selected[rows, : widths[n]] = r.ws.last_selected.numpy()[r.layer, : heads[n], budget]
        want[rows, : lengths[n]] = w
        limit[rows] = np.iinfo(np.int64).max if r.max_replace is None else r.max_replace
        depth[rows] = length if r.fetch_depth is None else r.fetch_depth
    padded_row = np.arange(width) >= np.repeat(widths, heads)[:, None]  # [T, W]
    wanted_valid = np.arange(length) < np.minimum(np.repeat(lengths, heads), depth)[:, None]  # [T, K]
    low = min(int(want.min()), int(resident.min()))
    span = max(int(want.max()), int(resident.max())) - low + 1
    resident_ids, wanted_ids = resident - low, want - low  # in [0, span); EMPTY (and padding) is one id
    hit = _membership(resident_ids, wanted_ids, span) & (resident != EMPTY)
    missing = ~_membership(wanted_ids, resident_ids, span) & wanted_valid  # best first
    rank = missing.cumsum(axis=-1) - 1  # position among the row's missing blocks
    free_rows = np.repeat(widths, heads) - hit.sum(axis=-1)  # rows not holding a wanted block
    take = missing & (rank < np.minimum(free_rows, limit)[:, None])
    # Free rows first (never used), then the least recently selected of the unwanted; hits and
    # padding last, never reached (at most free_rows are taken).
    recency = selected
    recency[resident == EMPTY] = -1
    recency[hit | padded_row] = np.iinfo(np.int64).max
    order = np.argsort(recency, axis=-1, kind="stable")  # [T, W] row offsets, evict first
    stack_rows, slots = take.nonzero()  # request by request, head by head, best first
    offsets = order[stack_rows, rank[stack_rows, slots]]
    blocks = want[stack_rows, slots]
    bounds = np.searchsorted(stack_rows, first_row)
    for n, (i, r, _, budget) in enumerate(live):
        rows = slice(first_row[n], first_row[n + 1])
        last_selected = r.ws.last_selected.numpy()[r.layer, : heads[n], budget]  # view, written through
        last_selected[hit[rows, : widths[n]]] = step
        part = slice(bounds[n], bounds[n + 1])
        if part.stop == part.start:
            continue
        head_ids = stack_rows[part] - first_row[n]
        row_indices = budget.start + offsets[part]
        r.ws.blocks.numpy()[r.layer, head_ids, row_indices] = blocks[part]
        r.ws.last_selected.numpy()[r.layer, head_ids, row_indices] = step
        plans[i] = FetchPlan(head_ids, blocks[part], row_indices)
    return plans


def recall(predicted: torch.Tensor, actual: torch.Tensor) -> float:
    """Share of `actual` ([kv_heads, k]) found in `predicted` ([kv_heads, *]), over all heads."""
    if actual.numel() == 0:
        return 1.0
    found = sum(int(torch.isin(actual[h], predicted[h]).sum()) for h in range(actual.shape[0]))
    return found / actual.numel()
