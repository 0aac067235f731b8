"""The decode node's block transfers into the device pool, and the miss policy.

Which blocks a layer needs, and into which of a request's rows they go, is decided by the
selection (`lookahead`, `SparseAttention`); this module only moves planned blocks from the store
and tells a layer when it may read them: at most one transfer per (request, layer) in flight,
its rows hidden from attention until it lands, and a layer that finds it still in flight
either waits for it or attends without it (`miss_policy`), counted either way. A transfer that
fails is the request's own failure (`WorkingSet.failure`), not the step's: the requests beside
it may read from other stores.
"""

from __future__ import annotations

import time

from ..kvstore import KVStoreError
from .counters import DecodeCounters
from .working_set import DevicePool, WorkingSet


class LayerTransfers:
    def __init__(self, pool: DevicePool, client, counters: DecodeCounters, miss_policy: str):
        """client: an `IOThreadClient`, whose handles are due a timeout after they were issued;
        miss_policy: 'wait' or 'skip', as DecodeConfig validated it."""
        self.pool = pool
        self.client = client
        self.counters = counters
        self.miss_policy = miss_policy

    def issue(self, fetches: list[tuple[int, WorkingSet, object]]) -> None:
        """Issue the fetches (layer, working set, plan) of every request as one I/O job."""
        reads, issued = [], []
        for layer, ws, plan in fetches:
            previous = ws.pending[layer]
            if previous is not None:  # at most one transfer per layer in flight: finish the older one
                try:
                    previous.wait_due()
                except KVStoreError as error:
                    self._failed(ws, error)
                    continue  # it stays pending: one that timed out may still land in these rows
                ws.pending[layer] = None
                ws.in_flight[layer] = False
            if ws.failure is not None:
                continue
            # numpy, not torch: a handful of tiny index operations per request and layer.
            slots = self.pool.unit_ids(ws.rows.numpy()[plan.row_indices], layer, plan.heads)
            reads.append((ws.request_id, layer, plan.heads, plan.blocks, self.pool.tensor, slots))
            ws.in_flight.numpy()[layer, plan.heads, plan.row_indices] = True
            self.counters.blocks_fetched += len(plan)
            self.counters.bytes_fetched += len(plan) * self.pool.layout.unit_bytes
            issued.append((layer, ws))
        if not reads:
            return
        for (layer, ws), handle in zip(issued, self.client.read_many(reads)):
            ws.pending[layer] = handle

    def may_plan(self, ws: WorkingSet, layer: int) -> bool:
        """Whether the layer's next prefetch may be planned now. Under 'skip', not while its last
        one is still landing: the new plan would evict rows and its transfer wait for the old."""
        handle = ws.pending[layer]
        if self.miss_policy == "wait" or handle is None:
            return True
        try:
            return handle.done()
        except KVStoreError as error:
            self._failed(ws, error)
            return False

    def await_layer(self, ws: WorkingSet, layer: int, on_demand: bool = False) -> None:
        handle = ws.pending[layer]
        if handle is None:
            return
        if ws.failure is not None:
            # Its store failed it in an earlier layer: its output is thrown away, so no layer
            # waits for its transfers (every layer would wait out the timeout of one that does
            # not answer); they stay pending until they end, and its rows with them.
            return
        try:
            if handle.done():
                if not on_demand:
                    self.counters.prefetch_hits += 1
            elif self.miss_policy == "skip" and not on_demand:
                self.counters.prefetch_misses += 1
                self.counters.prefetch_skips += 1
                return  # in-flight rows stay masked out for this step
            else:
                if not on_demand:
                    self.counters.prefetch_misses += 1
                started = time.perf_counter()
                handle.wait_due()
                self.counters.fetch_wait_s += time.perf_counter() - started
                if on_demand:
                    self.counters.on_demand_waits += 1
                else:
                    self.counters.prefetch_waits += 1
        except KVStoreError as error:
            self._failed(ws, error)
            return  # it stays pending: one that timed out may still land in these rows
        ws.pending[layer] = None
        ws.in_flight[layer] = False

    @staticmethod
    def _failed(ws: WorkingSet, error: KVStoreError) -> None:
        """The transfer failed or timed out (a timed-out one may still land: the engine keeps the
        request's rows until it has ended). The layer attends on, since the rows are only this
        request's, and the engine throws its output away and ends it after the step."""
        if ws.failure is None:
            ws.failure = error
