"""Sparse attention over each request's working set, with look-ahead selection inside the layer.

`SparseAttention` is the decode node's `AttentionBackend`. For every layer of a verification
pass (1 + k rows per request) it:
  1. waits for that layer's prefetch from the previous step, or skips it (`transfers`);
  2. [sparse-current] scores blocks with the current query and fetches the top-K now;
  3. writes the new rows' K/V into the request's window ring;
  4. attends over the resident rows (sinks, window, selected) with the shared attention core;
  5. [lookahead] scores blocks with the draft rows' queries and starts fetching the next step's
     top-K (its highly ranked missing blocks), so the transfer overlaps the rest of the pass.
     The scoring runs once per `layer_group` layers, for all of them together: on a CPU each
     call's cost is mostly its code and data coming back into caches the model's weights
     flushed, on a GPU a host sync for the bookkeeping; either is paid per call, not per layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from ..models.attention import (
    PAD_POSITION,
    AttentionBatch,
    AttentionBuffers,
    attend_gathered,
    batch_queries,
    gather_rows,
    position_mask,
    unbatch_outputs,
)
from .counters import DecodeCounters
from .lookahead import PlanRequest, Selection, plan_replacements_many, recall, replacement_cap, select_blocks_batched
from .summary_pages import PagedLayer, SummaryPages
from .transfers import LayerTransfers
from .triton_attention import sparse_paged_attention
from .working_set import EMPTY, DevicePool, WorkingSet


@dataclass
class StepRequest:
    """What the backend needs of one request for one step."""

    ws: WorkingSet
    summaries: SummaryPages  # of the blocks in the store
    positions: torch.Tensor  # [rows] positions of this step's rows (row 0: last accepted token)
    num_drafts: int
    mode: str
    budget_blocks: int
    radius_weight: float  # rank_blocks' weight for the request's summary kind


def gathered_attention(queries: torch.Tensor, units_kv: torch.Tensor, unit_ids: torch.Tensor,
                       key_positions: torch.Tensor, query_positions: torch.Tensor, window: int | None,
                       scale: float, buffers: AttentionBuffers | None = None) -> torch.Tensor:
    """The torch path of `sparse_paged_attention` (same arguments, plus the buffers to reuse):
    gather the units' K and V, then attend with the shared core. One index_select each for K
    and V straight into [B, kv_heads, R * bs, d]: no [.., 2, bs, d] intermediate to split and
    copy again (several times faster on CPU)."""
    num_seqs, kv_heads, _ = unit_ids.shape
    flat = unit_ids.reshape(-1)
    shape = (num_seqs, kv_heads, -1, units_kv.shape[-1])
    keys, values = (gather_rows(units_kv[:, part], flat, buffers, name).view(shape)
                    for part, name in ((0, "keys"), (1, "values")))
    mask = position_mask(query_positions, key_positions, window)
    return attend_gathered(queries, keys, values, mask, scale, buffers)


@contextlib.contextmanager
def one_cpu_thread():
    """Run the block bookkeeping on one intra-op thread. Its ops are small (a few hundred KiB
    per request and layer), and with OMP_WAIT_POLICY=PASSIVE (which these shared machines need)
    waking the other thread for each costs more than it saves: on 2 cores, a 512-block
    ranking matmul took 60 us on one thread against 92 us on two, and the selection of a bf16
    8K run 3.45 s against 3.80 s. The model's large GEMMs keep every thread."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SparseAttention:
    def __init__(self, pool: DevicePool, client, sliding_window, scale: float, max_replace_fraction: float, miss_policy: str,
                 counters: DecodeCounters, recall_sample_steps: int = 1,
                 use_triton: bool = False, topup_blocks: int = 0, prefetch_rank_fraction: float = 0.25,
                 layer_group: int = 1):
        self.pool = pool
        self.sliding_window = sliding_window
        self.scale = scale
        self.max_replace_fraction = max_replace_fraction
        self.counters = counters
        self.transfers = LayerTransfers(pool, client, counters, miss_policy)
        self.recall_sample_steps = recall_sample_steps
        self.use_triton = use_triton
        self.topup_blocks = topup_blocks
        self.prefetch_rank_fraction = prefetch_rank_fraction
        if layer_group < 1:
            raise ValueError(f"layer_group must be >= 1, got {layer_group}")
        self.layer_group = layer_group
        # (layer, [(request, draft rows)]) whose look-ahead selection waits for the group's last layer.
        self._deferred: list[tuple[int, list[tuple[StepRequest, torch.Tensor]]]] = []
        # (layer, request, current query, its budget rows' blocks when it attended): the recall
        # counter's samples, scored at the same point.
        self._deferred_recall: list[tuple[int, StepRequest, torch.Tensor, torch.Tensor]] = []
        self.requests: list[StepRequest] = []
        self.attention_buffers = AttentionBuffers()
        self.batch: AttentionBatch | None = None
        self.step_index = 0

    # -- per step ------------------------------------------------------------------------
    def prepare(self, requests: list[StepRequest], step_index: int) -> None:
        self.requests = requests
        self.step_index = step_index
        self._deferred, self._deferred_recall = [], []  # a pass that raised midway leaves nothing for this one
        bs = self.pool.layout.block_size
        for req in requests:
            ws = req.ws
            tail = int(req.positions[0]) // bs
            window = ws.window_blocks(tail)
            for index in range(ws.plan.sinks, ws.plan.sinks + ws.plan.ring):
                block = int(ws.blocks[0, 0, index])
                # Out of the window (and not the spill block): it must not be seen twice.
                if block != EMPTY and not window.start <= block <= tail + 1:
                    self._retire(ws, index, block)
                    ws.set_everywhere(index, EMPTY)
            for block in sorted({int(p) // bs for p in req.positions}):
                ws.set_everywhere(ws.ring_index(block), block)
        # Query layout only: keys are gathered per layer from each working set.
        dummy = [torch.zeros(1, dtype=torch.long) for _ in requests]
        self.batch = AttentionBatch.from_key_lists([r.positions for r in requests], dummy, dummy, torch.empty(0))
        rows = [r.ws.kv_rows for r in requests]
        width = max(len(r) for r in rows)
        # Padding repeats the request's own first (sink) row, whose KV is real: the padded keys
        # are masked, but another request's row could hold summary bytes that read as NaN.
        self._rows = torch.stack([torch.cat((r, r[:1].expand(width - len(r)))) for r in rows])
        self._write_units, self._write_offsets = self._write_targets(requests)

    def _retire(self, ws: WorkingSet, ring_index: int, block: int) -> None:
        """A block leaving the window moves into a budget row (a local copy, no transfer), so
        the step that no longer sees it in the window still has it until selection drops it."""
        if ws.plan.budget == 0:
            return
        budget = ws.budget_slice
        recency = ws.last_selected[:, :, budget].clone()
        recency[ws.blocks[:, :, budget] == EMPTY] = -1
        in_flight = ws.in_flight[:, :, budget]
        recency[in_flight] = torch.iinfo(torch.long).max  # never overwrite a landing fetch
        target = budget.start + recency.argmin(dim=-1)  # [layers, kv_heads]
        layers = torch.arange(ws.num_layers)[:, None].expand_as(target)
        heads = torch.arange(ws.num_kv_heads)[None, :].expand_as(target)
        # Where every budget row awaits a fetch the block is let go (the store has it): argmin
        # picked a landing row there, and the read then overwrote the copy under the block's label.
        room = ~in_flight.all(dim=-1)
        layers, heads, target = layers[room], heads[room], target[room]
        source_units = self.pool.unit_ids(ws.rows[ring_index], layers, heads)
        target_units = self.pool.unit_ids(ws.rows[target], layers, heads)
        self.pool.units[target_units.reshape(-1)] = self.pool.units[source_units.reshape(-1)]
        ws.blocks[layers, heads, target] = block
        ws.last_selected[layers, heads, target] = self.step_index

    def _write_targets(self, requests):
        """Per new token: the ring row (as a pool row) and offset where its K/V go."""
        bs = self.pool.layout.block_size
        rows, offsets = [], []
        for req in requests:
            for p in req.positions.tolist():
                rows.append(int(req.ws.rows[req.ws.ring_index(p // bs)]))
                offsets.append(p % bs)
        return torch.tensor(rows), torch.tensor(offsets)

    # -- the backend call ----------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for req in self.requests:
            self.transfers.await_layer(req.ws, layer)
        row_starts = self._row_starts().tolist()
        current = [q[start : start + 1] for start in row_starts]  # each request's current query
        sparse = [i for i, r in enumerate(self.requests) if r.mode != "dense" and r.ws.plan.budget]
        if (self.step_index - 1) % self.recall_sample_steps == 0:  # the first step is always sampled
            for i in sparse:
                # A row still landing (miss policy "skip") is masked: it was counted as found.
                attended = self.requests[i].ws.attended_budget_blocks(layer)
                self._deferred_recall.append((layer, self.requests[i], current[i].clone(), attended))
        on_demand = [i for i in sparse if self.requests[i].mode == "sparse-current"]
        self._select_and_fetch([(layer, [(self.requests[i], current[i]) for i in on_demand])], wait=True)
        if self.topup_blocks:
            topup = [i for i in sparse if self.requests[i].mode == "lookahead"]
            self._select_and_fetch([(layer, [(self.requests[i], current[i]) for i in topup])], wait=True,
                                   cap=self.topup_blocks)
        self._write_new_kv(layer, k, v)
        out = self._attend_resident(layer, q)
        lookahead = []
        for i in sparse:
            req = self.requests[i]
            if req.mode == "lookahead":
                start = row_starts[i]
                drafts = q[start + 1 : start + 1 + req.num_drafts]
                # A copy: the rows are scored after later layers have run.
                lookahead.append((req, (drafts if req.num_drafts else current[i]).clone()))
        if lookahead:
            self._deferred.append((layer, lookahead))
        if (layer + 1) % self.layer_group == 0 or layer == self.pool.layout.num_layers - 1:
            samples, self._deferred_recall = self._deferred_recall, []
            self._track_recall(samples)
            deferred, self._deferred = self._deferred, []
            self._select_and_fetch(deferred, wait=False)
        return out

    def _row_starts(self) -> torch.Tensor:
        counts = torch.tensor([len(r.positions) for r in self.requests])
        return torch.cumsum(counts, 0) - counts

    def _write_new_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        heads = torch.arange(self.pool.layout.num_kv_heads)
        units = self.pool.unit_ids(self._write_units[:, None], layer, heads[None, :])  # [tokens, kv_heads]
        offsets = self._write_offsets[:, None].expand_as(units)
        self.pool.units[units, 0, offsets] = k.to(self.pool.units.dtype)
        self.pool.units[units, 1, offsets] = v.to(self.pool.units.dtype)

    def _attend_resident(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        layout = self.pool.layout
        heads = torch.arange(layout.num_kv_heads)
        units = self.pool.unit_ids(self._rows[:, None, :], layer, heads[None, :, None])  # [B, kv_heads, R]
        device = self.pool.units.device
        positions = self._key_positions(layer, units.shape[2] * layout.block_size)
        args = (batch_queries(q, self.batch), self.pool.units, units.to(device), positions.to(device),
                self.batch.query_positions.to(device), self.sliding_window[layer], self.scale)
        if self.use_triton:
            out = sparse_paged_attention(*args)
        else:
            out = gathered_attention(*args, buffers=self.attention_buffers)
        return unbatch_outputs(out.to(q.dtype), self.batch)

    def _key_positions(self, layer: int, width: int) -> torch.Tensor:
        """[B, kv_heads, width] position of every resident key row (PAD_POSITION: none)."""
        positions = torch.full((len(self.requests), self.pool.layout.num_kv_heads, width), PAD_POSITION,
                               dtype=torch.long)
        for i, req in enumerate(self.requests):
            own = req.ws.key_positions(layer)
            positions[i, :, : own.shape[1]] = own
        return positions

    # -- selection and transfers ---------------------------------------------------------
    def _candidate_range(self, req: StepRequest, layer: int) -> tuple[int, int]:
        """Complete blocks that are neither sinks nor in the window, first..end-1; in a
        sliding-window layer, only those its first query row may still see: the budget went to
        blocks the position mask hid (on Gemma 3 at a 256-token budget, 98% of its blocks)."""
        position = int(req.positions[0])
        window_start = req.ws.window_blocks(position // self.pool.layout.block_size).start
        first = req.ws.first_candidate_block(position, self.sliding_window[layer])
        return first, min(window_start, req.summaries.num_blocks)

    def _top_blocks(self, work: list[tuple[int, StepRequest, torch.Tensor]]) -> list[np.ndarray]:
        """Each (layer, request, query rows)'s top-K blocks of that layer ([kv_heads, k'] on the
        host), ranked in one batch."""
        selections = []
        for layer, req, query in work:
            first, end = self._candidate_range(req, layer)
            budget = min(req.budget_blocks, req.ws.plan.budget)
            selections.append(Selection(query, PagedLayer(req.summaries, layer, self.attention_buffers), first, end,
                                        budget, req.radius_weight))
        return select_blocks_batched(selections, self.scale)

    def _select_and_fetch(self, batches: list[tuple[int, list[tuple[StepRequest, torch.Tensor]]]], wait: bool,
                          cap: int | None = None) -> None:
        """wait=False: the look-ahead prefetch, capped by the replacement rate, of missing blocks
        ranked in the top `prefetch_rank_fraction` of the prediction (the rest of its top-K is
        kept if resident). wait=True: an on-demand fetch of the query's missing top-K, at most
        `cap` blocks per head (None: all). `batches`: (layer, [(request, query rows)]), all ranked
        in one batch and fetched in one I/O job."""
        todo = []  # (layer, request, query rows, cap)
        for layer, work in batches:
            for req, query in work:
                if req.ws.failure is not None:  # it ends after this step: nothing more to read for it
                    continue
                if not wait and not self.transfers.may_plan(req.ws, layer):
                    continue
                budget = min(req.budget_blocks, req.ws.plan.budget)
                c = cap if wait else replacement_cap(req.ws, layer, budget * self.max_replace_fraction)
                if c != 0:  # a request that may move nothing is not ranked: its selection would be thrown away
                    todo.append((layer, req, query, c))
        if not todo:
            return
        with one_cpu_thread():
            wanted_sets = self._top_blocks([(layer, req, query) for layer, req, query, _ in todo])
            plans = plan_replacements_many(self.step_index, [
                PlanRequest(req.ws, layer, wanted, c,
                            None if wait else max(1, int(wanted.shape[1] * self.prefetch_rank_fraction)))
                for (layer, req, _, c), wanted in zip(todo, wanted_sets)
            ])
            fetches = [(layer, req.ws, plan) for (layer, req, _, _), plan in zip(todo, plans) if len(plan)]
            if fetches:
                self.transfers.issue(fetches)
        if wait:
            for layer, ws, _ in fetches:
                self.transfers.await_layer(ws, layer, on_demand=True)

    def _track_recall(self, samples: list[tuple[int, StepRequest, torch.Tensor, torch.Tensor]]) -> None:
        """How many of each current query's top-K blocks were resident (predicted) when it
        attended; samples: (layer, request, current query, the budget rows' blocks then)."""
        if not samples:
            return
        with one_cpu_thread():
            ranked = self._top_blocks([(layer, req, query) for layer, req, query, _ in samples])
        for (_, _, _, resident), actual in zip(samples, ranked):
            if actual.size:
                self.counters.add_recall(recall(resident, torch.from_numpy(actual)))
