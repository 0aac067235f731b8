"""A prefill whose client went away stops at its next chunk (or before it starts) and leaves
nothing in the store; before, it ran to its end and held up every prefill queued behind it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from oasiskv.kvstore import KVStoreServer, connect
from oasiskv.prefill_node.cancellation import Cancellations, PrefillCancelled
from oasiskv.prefill_node.prefill import Prefiller
from oasiskv.prefill_node.worker import PrefillWorker

from ..conftest import stdlib_source


def test_a_cancelled_prefill_stops_at_its_next_chunk_and_frees_its_kv(smollm2_llm, store):
    prompt = smollm2_llm.encode(stdlib_source("argparse.py"))[:2048]
    chunks_run = []

    def cancelled() -> bool:
        chunks_run.append(len(chunks_run))
        return len(chunks_run) > 2  # the client hangs up during the second of eight chunks

    prefiller = Prefiller(smollm2_llm.model, connect(store.address, transport="tcp"), chunk_tokens=256)
    with pytest.raises(PrefillCancelled, match="cancelled"):
        prefiller.prefill("gone", prompt, cancelled=cancelled)
    assert len(chunks_run) == 3  # asked before each chunk: two ran, the third was not started
    assert store.store.stats().num_requests == 0


def test_cancellations_of_prefills_queued_running_or_not_arrived_yet():
    now = [0.0]
    cancellations = Cancellations(remember_s=60, clock=lambda: now[0])
    with cancellations.tracking("a") as cancelled:
        assert not cancelled()
        assert cancellations.cancel("a") and cancelled()
    assert not cancellations.cancel("a")  # its prefill has ended
    # A call still in Ray's queue, outside the worker: its cancel holds once it arrives.
    assert not cancellations.cancel("early")
    with cancellations.tracking("early") as cancelled:
        assert cancelled()
    with cancellations.tracking("early") as cancelled:  # used once
        assert not cancelled()
    assert not cancellations.cancel("late")
    now[0] = 61.0  # remembered for remember_s only
    with cancellations.tracking("late") as cancelled:
        assert not cancelled()
    assert not cancellations.cancel("other") and list(cancellations._before_arrival) == ["other"]  # the old ones are dropped


def test_the_worker_cancels_a_running_and_a_queued_prefill(store):
    worker = PrefillWorker("smollm2-135m", chunk_tokens=128, transport="tcp", threads=1)
    worker._prefiller(store.address)  # connect now, not inside the race below
    prompt = list(range(100, 2100))  # 2,000 tokens: 16 chunks of 128

    def prefill(request_id):
        return worker.prefill(request_id, prompt, {"max_tokens": 4}, store.address, 16, 1, 4)

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(prefill, "running")
        _wait_for(lambda: "running" in worker.cancellations._pending and worker._lock.locked())
        queued = pool.submit(prefill, "queued")
        _wait_for(lambda: "queued" in worker.cancellations._pending)
        assert worker.cancel("queued") and worker.cancel("running")
        for future in (running, queued):
            with pytest.raises(PrefillCancelled):
                future.result(timeout=120)
    assert not worker.cancel("running")
    assert connect(store.address, transport="tcp").stats().num_requests == 0
    # Cancelled while its call still waited in Ray's queue (the actor runs 8 calls at once):
    # it stops before it starts instead of running its whole prefill.
    assert not worker.cancel("not-arrived")
    with pytest.raises(PrefillCancelled):
        prefill("not-arrived")
    assert connect(store.address, transport="tcp").stats().num_requests == 0
    done = worker.prefill("after", prompt[:64], {"max_tokens": 4}, store.address, 16, 1, 4)
    assert done.request_id == "after"  # the worker serves the next one
    worker.free("after", store.address)


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)




def test_a_store_that_went_away_does_not_hide_why_the_prefill_stopped(smollm2_llm, caplog):
    """The free after a cancelled (or failed) prefill fails too when its store is down: the
    caller got the free's StoreUnavailable instead of PrefillCancelled."""
    server = KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp")
    server.start()
    prompt = smollm2_llm.encode(stdlib_source("argparse.py"))[:1024]
    chunks_run = []

    def cancelled() -> bool:
        chunks_run.append(len(chunks_run))
        if len(chunks_run) == 2:
            server.stop()  # the store goes away while the prefill runs
        return len(chunks_run) > 2

    prefiller = Prefiller(smollm2_llm.model, connect(server.address, transport="tcp"), chunk_tokens=256)
    with pytest.raises(PrefillCancelled, match="cancelled"):
        prefiller.prefill("orphan", prompt, cancelled=cancelled)
    assert "its store free failed too" in caplog.text
