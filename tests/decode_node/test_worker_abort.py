"""An abort reaches a decode worker's request whenever it comes: before the worker has handed the
request to its engine (the API aborts as soon as a client hangs up, which can be while the worker
still connects to the store), or as the caller drops the stream. Such an abort used to be lost:
the request decoded to max_tokens for nobody, holding its pool rows and store memory."""

from __future__ import annotations

import asyncio
import time

import pytest

from oasiskv.decode_node.worker import DecodeWorker
from oasiskv.kvstore import KVStore, connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller

LONG = {"max_tokens": 400, "ignore_eos": True}  # far more than the few seconds each check waits


@pytest.fixture
def store():
    return KVStore(64 * 2**20)


@pytest.fixture
def worker():
    worker = DecodeWorker("smollm2-135m", {"kv_pool_gb": 0.05, "budget_tokens": 64}, transport="inproc")
    yield worker
    worker.shutdown()


def _prefill(smollm2_llm, store, request_id):
    prompt = smollm2_llm.encode("The quick brown fox jumps over the lazy dog. " * 4)
    return Prefiller(smollm2_llm.model, connect(store)).prefill(request_id, prompt, SamplingParams(**LONG))


def _settles(check, timeout_s=10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def _idle(worker, store) -> bool:
    stats = worker.stats()
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["admitting"] == 0 \
        and stats["pool_rows_used"] == 0 and store.stats().num_requests == 0


def test_an_abort_that_comes_before_its_request_ends_it(smollm2_llm, store, worker):
    result = _prefill(smollm2_llm, store, "early")
    worker.abort("early")  # Ray may start the abort before the generate it follows

    async def run():
        return [out async for out in worker.generate(result, LONG, store)]

    items = asyncio.run(run())
    assert [(item["finished"], item["finish_reason"], item["num_tokens"]) for item in items] == [(True, "abort", 0)]
    assert _settles(lambda: _idle(worker, store)), worker.stats()
    assert worker.stats()["generated_tokens"] == 0


def test_an_abort_while_the_worker_connects_to_the_store_ends_the_request(smollm2_llm, store, worker):
    result = _prefill(smollm2_llm, store, "connecting")
    connect_to_store = worker.stores.client_for

    def slow_connect(address):  # a store that takes a moment to answer its first connect
        time.sleep(0.5)
        return connect_to_store(address)

    worker.stores.client_for = slow_connect

    async def run():
        stream = worker.generate(result, LONG, store)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)
        worker.abort("connecting")  # the client hung up right after the first token
        item = await first
        rest = [out async for out in stream]
        return [item, *rest]

    items = asyncio.run(run())
    assert [(item["finished"], item["finish_reason"]) for item in items] == [(True, "abort")]
    assert _settles(lambda: _idle(worker, store)), worker.stats()


def test_a_dropped_stream_aborts_its_request(smollm2_llm, store, worker):
    result = _prefill(smollm2_llm, store, "dropped")

    async def run():
        stream = worker.generate(result, LONG, store)
        first = await anext(stream)
        await stream.aclose()  # what the actor sees when its caller cancels the stream
        return first

    first = asyncio.run(run())
    assert not first["finished"]
    assert _settles(lambda: _idle(worker, store)), worker.stats()
    assert worker.stats()["generated_tokens"] < LONG["max_tokens"]


def test_freeing_an_early_aborted_request_does_not_hold_up_the_decode_loop(smollm2_llm):
    """An abort before its request: the worker frees the request in its store. It did so on the
    decode loop, so a store that did not answer stalled every running request for the timeout;
    now the free is queued on the store's I/O thread and the running request decodes on."""
    import threading

    store = KVStore(256 * 2**20)
    very_long = {"max_tokens": 1500, "ignore_eos": True}
    worker = DecodeWorker("smollm2-135m", {"kv_pool_gb": 0.2, "budget_tokens": 64, "mode": "dense"},
                          transport="inproc")
    running, early = _prefill(smollm2_llm, store, "running"), _prefill(smollm2_llm, store, "early")
    answer = threading.Event()
    free = worker.stores.free

    def frozen_free(request_id):  # the store stops answering frees
        assert answer.wait(60)
        free(request_id)

    async def run():
        stream = worker.generate(running, very_long, store)
        await anext(stream)  # admitted and decoding: it needs its store no more
        worker.stores.free = frozen_free
        worker.abort("early")
        assert [out["finish_reason"] async for out in worker.generate(early, LONG, store)] == ["abort"]
        await asyncio.sleep(0.5)  # the step under way when the free was asked for ends
        before = worker.stats()["generated_tokens"]
        await asyncio.sleep(2.5)
        decoded = worker.stats()["generated_tokens"] - before
        answer.set()
        await stream.aclose()
        return decoded

    try:
        decoded = asyncio.run(run())
        assert 8 <= decoded < very_long["max_tokens"], "the decode loop waited for the store"
        assert _settles(lambda: _idle(worker, store)), worker.stats()
    finally:
        answer.set()
        worker.shutdown()
