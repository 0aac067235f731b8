"""LayerTransfers when a request's store fails a transfer (unit test of this component, with a
stand-in handle): the failure is the request's own (`WorkingSet.failure`), a timed-out transfer
stays pending so that the engine keeps the request's rows until it has ended, and no later layer
waits for a failed request's transfers."""

from __future__ import annotations

import torch

from oasiskv.decode_node.counters import DecodeCounters
from oasiskv.decode_node.transfers import LayerTransfers
from oasiskv.decode_node.working_set import DevicePool, RowPlan, WorkingSet
from oasiskv.kvstore import KVLayout, StoreTimeout


class HeldUpTransfer:
    """A transfer its store never answers: every wait times out and it has not ended."""

    def __init__(self):
        self.waits = 0

    def done(self) -> bool:
        return False

    def wait_due(self) -> None:
        self.waits += 1
        raise StoreTimeout("transfer not done 0.01s after it was issued")

    def ended(self) -> bool:
        return False


def make(miss_policy="wait"):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    pool = DevicePool(layout, 64 * layout.num_layers * layout.num_kv_heads * layout.unit_bytes)
    plan = RowPlan(sinks=1, ring=5, budget=4)
    ws = WorkingSet("r", torch.arange(plan.total), plan, layout.num_layers, layout.num_kv_heads, layout.block_size)
    counters = DecodeCounters()
    return LayerTransfers(pool, client=None, counters=counters, miss_policy=miss_policy), ws, counters


def test_a_timed_out_prefetch_fails_its_request_and_stays_pending():
    transfers, ws, counters = make()
    held = [HeldUpTransfer() for _ in range(3)]
    ws.pending = list(held)
    transfers.await_layer(ws, 0)
    assert isinstance(ws.failure, StoreTimeout)
    assert ws.pending[0] is held[0]  # still tracked: it may land in the request's rows later
    for layer in (1, 2):  # later layers attend on without waiting for it
        transfers.await_layer(ws, layer)
    assert [h.waits for h in held] == [1, 0, 0]
    assert ws.pending == held
    assert counters.prefetch_waits == 0


def test_a_timed_out_transfer_found_before_a_new_prefetch_is_kept_and_nothing_new_is_read():
    transfers, ws, _ = make()
    held = HeldUpTransfer()
    ws.pending[1] = held
    transfers.issue([(1, ws, None)])  # the plan is not looked at: the request has failed
    assert isinstance(ws.failure, StoreTimeout) and ws.pending[1] is held


def test_under_skip_a_failed_layer_is_not_planned_again():
    transfers, ws, _ = make("skip")

    class Failed(HeldUpTransfer):
        def done(self):
            raise StoreTimeout("not done")

    ws.pending[2] = Failed()
    assert not transfers.may_plan(ws, 2)
    assert isinstance(ws.failure, StoreTimeout) and ws.pending[2] is not None
