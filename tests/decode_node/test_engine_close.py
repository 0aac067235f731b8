"""Shutting the decode engine (and its Ray worker) down gives every resource back: pool rows,
store requests, the pool's registration and the I/O thread; doing it twice is harmless."""

from __future__ import annotations

import asyncio

import pytest

from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.kvstore import KVStore, connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller

from ..conftest import stdlib_source

PARAMS = SamplingParams(max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_llm):
    ids = smollm2_llm.encode(stdlib_source("argparse.py"))
    return [ids[:300], ids[1000:1200], ids[2000:2250]]


class RecordingClient:
    """A store client that remembers which buffers are registered."""

    def __init__(self, client):
        self.client = client
        self.registered: list = []

    def register(self, tensor) -> None:
        self.registered.append(tensor)
        self.client.register(tensor)

    def unregister(self, tensor) -> None:
        self.registered = [t for t in self.registered if t is not tensor]
        self.client.unregister(tensor)

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.mark.parametrize("mode", ["lookahead", "dense"])
def test_close_frees_running_and_waiting_requests(smollm2_llm, prompts, mode):
    store = KVStore(64 * 2**20)
    client = RecordingClient(connect(store))
    config = DecodeConfig(mode=mode, budget_tokens=64, kv_pool_gb=0.05, max_num_seqs=2)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, config)
    assert client.registered == [engine.pool.tensor]
    prefiller = Prefiller(smollm2_llm.model, client)
    for i, prompt in enumerate(prompts):
        result = prefiller.prefill(f"close-{mode}-{i}", prompt, PARAMS, budget_blocks=config.budget_blocks,
                                   excluded_head_blocks=config.sink_blocks, excluded_tail_blocks=config.window_blocks)
        engine.add(result, PARAMS)
    for _ in range(2):
        assert not any(out.finished for out in engine.step())
    assert len(engine.running) == 2 and len(engine.waiting) == 1  # max_num_seqs keeps one waiting
    assert store.stats().num_requests == 3 and engine.pool.rows_used > 0

    engine.close()
    assert store.stats().num_requests == 0
    assert engine.pool.allocator.num_free == engine.pool.num_rows
    assert not engine.running and not engine.waiting and not engine.has_unfinished
    assert client.registered == []
    assert not any(t._thread.is_alive() for t in engine.client._threads.values())  # the I/O threads are stopped
    engine.close()  # a second close does nothing, and raises nothing
    assert store.stats().num_requests == 0


def test_close_of_an_idle_engine(smollm2_llm):
    store = KVStore(16 * 2**20)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, connect(store), DecodeConfig(kv_pool_gb=0.01))
    engine.close()
    engine.close()
    assert store.stats().num_requests == 0


def test_worker_shutdown_aborts_open_streams_and_frees_the_store(smollm2_llm, prompts):
    from oasiskv.decode_node.worker import DecodeWorker

    store = KVStore(64 * 2**20)
    worker = DecodeWorker("smollm2-135m", {"kv_pool_gb": 0.05, "budget_tokens": 64}, transport="inproc")
    result = Prefiller(smollm2_llm.model, connect(store)).prefill("worker-close", prompts[0], PARAMS,
                                                                  budget_blocks=4)
    params = {"max_tokens": 7_000, "ignore_eos": True}  # open for longer than the test, within the context

    async def run():
        outputs = []
        async for out in worker.generate(result, params, store):
            outputs.append(out)
            if len(outputs) == 2:
                worker.shutdown()  # from the actor's event loop, as Ray's shutdown hook would run it
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1]["finished"] and outputs[-1]["finish_reason"] == "abort"
    assert store.stats().num_requests == 0
    assert not worker.stats()["healthy"]  # the loop has ended
    worker.shutdown()  # idempotent

    async def start_another():
        return await anext(worker.generate(result, params, store))

    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(start_another())
