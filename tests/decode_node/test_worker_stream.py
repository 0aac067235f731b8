"""What a decode worker's stream carries per step: the new tokens and the new text only, which
add up to the whole output (a step used to resend the whole token list and text)."""

from __future__ import annotations

import asyncio

from oasiskv.decode_node.worker import DecodeWorker
from oasiskv.kvstore import KVStore, connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller


def test_the_stream_sends_new_tokens_and_new_text_that_add_up_to_the_output(smollm2_llm):
    store = KVStore(64 * 2**20)
    worker = DecodeWorker("smollm2-135m", {"kv_pool_gb": 0.05, "budget_tokens": 64}, transport="inproc")
    try:
        # Chinese: the model answers in characters of several byte tokens, which steps split.
        prompt = smollm2_llm.encode("中文：你好，世界！今天天气很好，我们去")
        result = Prefiller(smollm2_llm.model, connect(store)).prefill("stream", prompt, SamplingParams(max_tokens=48))

        async def run():
            return [out async for out in worker.generate(result, {"max_tokens": 48, "ignore_eos": True}, store)]

        items = asyncio.run(run())
    finally:
        worker.shutdown()
    assert all("token_ids" not in item and "text" not in item for item in items)
    ids = [result.first_token] + [t for item in items for t in item["new_token_ids"]]
    assert items[-1]["finished"] and items[-1]["num_tokens"] == len(ids) == 48
    assert [item["num_tokens"] for item in items] == sorted(item["num_tokens"] for item in items)
    text = "".join(item["text_delta"] for item in items)
    assert text == smollm2_llm.tokenizer.decode(ids, skip_special_tokens=True) and len(text) > 10
    assert all("\ufffd" not in item["text_delta"] for item in items[:-1])
    assert store.stats().num_requests == 0
