"""The service's health poll (ClusterService.poll_once) against stand-in actor handles: a worker
that is only slow to answer stays in routing until it misses several polls in a row; one whose
actor raised (died) leaves at once; any answer brings a worker back; a decode worker that says
its engine is broken is restarted, once per breakage."""

from __future__ import annotations

import asyncio
import contextlib
import time

import torch

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.launcher import HEALTH_GROUP, ClusterHandles
from oasiskv.cluster.router import WorkerSlot
from oasiskv.cluster.service import ClusterService


class StandInMethod:
    """An actor method whose calls answer, hang, or raise, as the test sets `behaviour`."""

    def __init__(self, answer):
        self.answer = answer
        self.behaviour = "answer"
        self.groups: list = []

    def options(self, concurrency_group=None):
        self.groups.append(concurrency_group)
        return self

    def remote(self):
        async def call():
            if self.behaviour == "hang":
                await asyncio.sleep(3600)
            if self.behaviour == "raise":
                raise RuntimeError("The actor died unexpectedly before finishing this task.")
            return self.answer
        return call()


class StandInActor:
    def __init__(self, stats):
        self.stats = StandInMethod(stats)
        self.ready = StandInMethod(True)


def make_service(missed_polls_unhealthy=3):
    decode = WorkerSlot("decode-0", StandInActor({"healthy": True, "bytes_fetched": 0}))
    prefill = WorkerSlot("prefill-0", StandInActor(None))
    store = WorkerSlot("store-0", StandInActor({"num_requests": 0}))
    config = ServeConfig(health_timeout_s=0.05, missed_polls_unhealthy=missed_polls_unhealthy)
    service = ClusterService(config, ClusterHandles([prefill], [decode], [store]), tokenizer=None,
                             kv_bytes_per_token=1, max_model_len=2048)
    service.restarted = []
    service.restart_actor = service.restarted.append  # stands in for ray.kill(handle, no_restart=False)
    return service, prefill, decode, store


def poll(service):
    asyncio.run(service.poll_once())


def test_a_slow_worker_stays_healthy_until_it_misses_several_polls_in_a_row():
    service, prefill, decode, _ = make_service(missed_polls_unhealthy=3)
    prefill.handle.ready.behaviour = decode.handle.stats.behaviour = "hang"
    for _ in range(2):
        poll(service)
        assert prefill.healthy and decode.healthy
    poll(service)
    assert not prefill.healthy and not decode.healthy
    assert service.metrics.health[("prefill", "prefill-0")] is False
    prefill.handle.ready.behaviour = decode.handle.stats.behaviour = "answer"
    poll(service)
    assert prefill.healthy and decode.healthy and prefill.missed_polls == decode.missed_polls == 0


def test_a_worker_whose_call_raises_is_unhealthy_at_once():
    service, prefill, _, store = make_service(missed_polls_unhealthy=3)
    prefill.handle.ready.behaviour = store.handle.stats.behaviour = "raise"
    poll(service)
    assert not prefill.healthy and not store.healthy


def test_a_decode_worker_that_reports_itself_broken_is_unhealthy():
    service, _, decode, _ = make_service()
    decode.handle.stats.answer = {"healthy": False, "error": "3 decode steps in a row failed"}
    poll(service)
    assert not decode.healthy


def test_worker_polls_use_the_health_group():
    service, prefill, decode, store = make_service()
    poll(service)
    assert prefill.handle.ready.groups == [HEALTH_GROUP] and decode.handle.stats.groups == [HEALTH_GROUP]
    assert store.handle.stats.groups == []  # the store actor has no such group


def test_a_broken_decode_worker_is_restarted_once_per_breakage():
    service, _, decode, _ = make_service()
    decode.handle.stats.answer = {"healthy": False, "error": "3 decode steps in a row failed"}
    poll(service)
    poll(service)  # the old actor answers again before it goes: not a second restart
    assert service.restarted == [decode.handle] and not decode.healthy
    decode.handle.stats.behaviour = "raise"  # restarting
    poll(service)
    assert not decode.healthy and len(service.restarted) == 1
    decode.handle.stats.behaviour = "answer"
    decode.handle.stats.answer = {"healthy": True}
    poll(service)
    assert decode.healthy
    decode.handle.stats.answer = {"healthy": False, "error": None}  # its loop died: broken again
    poll(service)
    assert service.restarted == [decode.handle, decode.handle]
    samples = {s.labels["worker"]: s.value for s in service.metrics.worker_restarts.collect()[0].samples
               if s.name.endswith("_total")}
    assert samples == {"decode-0": 2.0}


def test_restarting_broken_decode_workers_can_be_turned_off():
    service, _, decode, _ = make_service()
    service.config = service.config.model_copy(update={"restart_broken_decode_workers": False})
    decode.handle.stats.answer = {"healthy": False, "error": "3 decode steps in a row failed"}
    poll(service)
    assert service.restarted == [] and not decode.healthy


def test_a_decode_worker_shut_down_on_purpose_is_not_restarted():
    service, _, decode, _ = make_service()
    decode.handle.stats.answer = {"healthy": False, "error": None, "closed": True}
    poll(service)
    assert service.restarted == [] and not decode.healthy


def test_the_nixl_rate_counts_every_store_read_and_survives_a_restarted_worker():
    """Dense reads all of its KV at admission: the rate counted only reads while decoding, so a
    dense cluster showed 0 B/s. A restarted worker's counters begin again at 0: the rate was
    negative for a poll."""
    service, _, decode, _ = make_service()
    stats = decode.handle.stats

    def poll_reading(decoding, admission, summaries):
        stats.answer = {"healthy": True, "bytes_fetched": decoding, "admission_bytes_fetched": admission,
                        "summary_bytes_fetched": summaries}
        started = time.monotonic()
        poll(service)
        return started, time.monotonic()

    first_poll, _ = poll_reading(0, 0, 0)
    _, second_poll = poll_reading(1, 10**9, 10**6)
    # At least what was read over the longest time the two polls could have been apart.
    assert service.metrics.nixl_rate["decode-0"] >= (1 + 10**9 + 10**6) / (second_poll - first_poll)
    _, third_poll = poll_reading(0, 600, 0)  # restarted, then read 600 bytes
    assert service.metrics.nixl_rate["decode-0"] >= 600 / (third_poll - first_poll)


def test_each_stores_own_series_are_exported_with_its_name():
    """Two real stores' registries, as their polls bring them: one family per series, a sample
    per store, the stores' counters as counters."""
    from prometheus_client import generate_latest

    from oasiskv.cluster.metrics import ServingMetrics
    from oasiskv.kvstore import KVLayout, KVStore

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype=torch.float32)
    stores = [KVStore(8 * 2**20, prefault=False, hugepages=False) for _ in range(2)]
    stores[0].allocate("a", layout, 40)
    stores[0].free("a")
    stores[1].allocate("b", layout, 40)
    metrics = ServingMetrics()
    metrics.store_stats = {f"store-{i}": {"used_bytes": 0, "capacity_bytes": 1, "metrics_text": s.metrics.text()}
                           for i, s in enumerate(stores)}
    value = metrics.registry.get_sample_value
    assert value("oasiskv_kvstore_requests_events_total", {"store": "store-0", "event": "freed"}) == 1
    assert value("oasiskv_kvstore_requests_events_total", {"store": "store-1", "event": "allocated"}) == 1
    assert value("oasiskv_kvstore_requests", {"store": "store-1"}) == 1
    assert value("oasiskv_kvstore_requests", {"store": "store-0"}) == 0
    text = generate_latest(metrics.registry).decode()
    assert text.count("# TYPE oasiskv_kvstore_requests_events_total counter") == 1
    metrics.store_stats = {"store-0": {"used_bytes": 0, "capacity_bytes": 1}}  # a store polled before it had any
    assert value("oasiskv_kvstore_requests_events_total", {"store": "store-0", "event": "freed"}) is None


def test_stopping_the_poll_survives_a_cancel_that_is_lost():
    """Python 3.11's asyncio.wait_for returns a worker's answer that arrives with a cancel, and
    drops the cancel: the poll went on, and serve's shutdown waited on it for good (CI's second
    Ctrl-C test hung there). Here the first poll call drops the cancel; stopping still ends it."""

    async def run() -> float:
        service, *_ = make_service()
        entered = asyncio.Event()
        dropped = []

        async def poll_dropping_a_cancel(slot, method, group=None):
            entered.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if dropped:
                    raise
                dropped.append(slot.name)  # what wait_for does when the answer came with the cancel
            return None

        service._poll = poll_dropping_a_cancel
        service.start_polling(interval_s=0.01)
        await entered.wait()
        started = time.monotonic()
        await asyncio.wait_for(service.stop_polling(), timeout=8)
        assert dropped  # the first cancel was lost, as in CI
        return time.monotonic() - started

    assert asyncio.run(run()) < 3


def test_a_poll_that_will_not_stop_is_left_behind_after_the_timeout(caplog):
    async def run() -> float:
        service, *_ = make_service()
        released = False

        async def poll_that_will_not_stop(slot, method, group=None):
            while not released:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.05)

        service._poll = poll_that_will_not_stop
        service.start_polling()
        poller = service._poller
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await service.stop_polling(timeout_s=1.0)
        took = time.monotonic() - started
        released = True  # this test's own end: asyncio.run waits for its tasks
        poller.cancel()
        await asyncio.wait({poller}, timeout=5)
        return took

    assert 0.9 < asyncio.run(run()) < 3
    assert "the health poll did not stop within 1 s" in caplog.text


def test_a_worker_that_stops_answering_leaves_the_usage_gauges_and_keeps_its_counters():
    """Its last read rate, pool usage and store bytes stood for ever after it died."""
    service, _, decode, store = make_service()
    decode.handle.stats.answer = {"healthy": True, "bytes_fetched": 10, "pool_usage": 0.5}
    store.handle.stats.answer = {"num_requests": 1, "used_bytes": 123, "capacity_bytes": 1000}
    for _ in range(2):
        poll(service)
    registry = service.metrics.registry
    worker = {"worker": "decode-0"}
    assert registry.get_sample_value("oasiskv_nixl_bytes_per_second", worker) is not None
    assert registry.get_sample_value("oasiskv_decode_kv_pool_usage_ratio", worker) == 0.5
    assert registry.get_sample_value("oasiskv_store_used_bytes", {"store": "store-0"}) == 123
    decode.handle.stats.behaviour = store.handle.stats.behaviour = "raise"
    poll(service)
    assert registry.get_sample_value("oasiskv_nixl_bytes_per_second", worker) is None
    assert registry.get_sample_value("oasiskv_decode_kv_pool_usage_ratio", worker) is None
    assert registry.get_sample_value("oasiskv_store_used_bytes", {"store": "store-0"}) is None
    assert registry.get_sample_value("oasiskv_decode_bytes_fetched_total", worker) == 10  # a counter stays
    decode.handle.stats.behaviour = store.handle.stats.behaviour = "answer"
    poll(service)
    assert registry.get_sample_value("oasiskv_decode_kv_pool_usage_ratio", worker) == 0.5
    assert registry.get_sample_value("oasiskv_store_used_bytes", {"store": "store-0"}) == 123
