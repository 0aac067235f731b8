"""A store frees a request nobody has touched for its TTL (its client vanished). A request that
waits in a decode worker's queue, or decodes densely (nothing read or written back), touches its
store for as long as it runs: the worker keeps every request it holds alive in its store."""

from __future__ import annotations

import asyncio

from oasiskv.decode_node.worker import DecodeWorker
from oasiskv.kvstore import KVStoreServer, connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller

PARAMS = {"max_tokens": 48, "ignore_eos": True}


def test_requests_outliving_the_store_ttl_are_kept_alive(smollm2_llm):
    # One request at a time: the second waits in the queue for the whole first one, far past
    # the store's one-second TTL; the first decodes densely, so it never reads or writes back.
    store = KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp", ttl_s=1.0)
    store.start()
    worker = DecodeWorker("smollm2-135m", {"kv_pool_gb": 0.05, "mode": "dense", "max_num_seqs": 1,
                                           "store_keep_alive_s": 0.2}, transport="tcp")
    try:
        prefiller = Prefiller(smollm2_llm.model, connect(store.address))
        results = [prefiller.prefill(f"long-lived-{i}", smollm2_llm.encode(f"def function_{i}(x):\n    return"),
                                     SamplingParams(**PARAMS)) for i in range(2)]

        async def decode_both():
            async def one(result):
                items = [item async for item in worker.generate(result, PARAMS, store.address)]
                return items[-1]

            return await asyncio.gather(*(one(r) for r in results))

        finals = asyncio.run(decode_both())
        assert [f["num_tokens"] for f in finals] == [PARAMS["max_tokens"]] * 2
        assert [f["finish_reason"] for f in finals] == ["length"] * 2
        stats = worker.stats()
        assert stats["step_failures"] == 0 and stats["store_free_failures"] == 0
        assert store.store.stats().num_requests == 0
        assert store.store.metrics.requests.labels("expired")._value.get() == 0
    finally:
        worker.shutdown()
        store.stop()
