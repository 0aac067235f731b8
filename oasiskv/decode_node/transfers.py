"""The decode node's block transfers into the device pool, and the miss policy.

Which blocks a layer needs, and into which of a request's rows they go, is decided by the
selection (`lookahead`, `SparseAttention`); this module only moves planned blocks from the store
and tells a layer when it may read them: at most one transfer per (request, layer) in flight,
its rows hidden from attention until it lands, and a layer that finds it still in flight
either waits for it or attends without it (`miss_policy`), counted either way.
"""

from __future__ import annotations

import time

from .counters import DecodeCounters
from .working_set import DevicePool, WorkingSet


class LayerTransfers:
    def __init__(self, pool: DevicePool, client, counters: DecodeCounters, miss_policy: str, timeout_s: float):
        """miss_policy: 'wait' or 'skip', as DecodeConfig validated it."""
        self.pool = pool
        self.client = client
        self.counters = counters
        self.miss_policy = miss_policy
        self.timeout_s = timeout_s

    def issue(self, fetches: list[tuple[int, WorkingSet, object]]) -> None:
        """Issue the fetches (layer, working set, plan) of every request as one I/O job."""
        reads = []
        for layer, ws, plan in fetches:
            previous = ws.pending[layer]
            if previous is not None:  # at most one transfer per layer in flight: finish the older one
                previous.wait(self.timeout_s)
                ws.in_flight[layer] = False
            # numpy, not torch: a handful of tiny index operations per request and layer.
            slots = self.pool.unit_ids(ws.rows.numpy()[plan.row_indices], layer, plan.heads)
            reads.append((ws.request_id, layer, plan.heads, plan.blocks, self.pool.tensor, slots))
            ws.in_flight.numpy()[layer, plan.heads, plan.row_indices] = True
            self.counters.blocks_fetched += len(plan)
            self.counters.bytes_fetched += len(plan) * self.pool.layout.unit_bytes
        handle = self.client.read_many(reads)
        for layer, ws, _ in fetches:
            ws.pending[layer] = handle

    def may_plan(self, ws: WorkingSet, layer: int) -> bool:
        """Whether the layer's next prefetch may be planned now. Under 'skip', not while its last
        one is still landing: the new plan would evict rows and its transfer wait for the old."""
        handle = ws.pending[layer]
        return self.miss_policy == "wait" or handle is None or handle.done()

    def await_layer(self, ws: WorkingSet, layer: int, on_demand: bool = False) -> None:
        handle = ws.pending[layer]
        if handle is None:
            return
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
            handle.wait(self.timeout_s)
            self.counters.fetch_wait_s += time.perf_counter() - started
            if on_demand:
                self.counters.on_demand_waits += 1
            else:
                self.counters.prefetch_waits += 1
        ws.pending[layer] = None
        ws.in_flight[layer] = False
