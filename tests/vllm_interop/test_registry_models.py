"""Every registry model (slow): vLLM alone, OasisKV's engine, and vLLM prefill + OasisKV decode
give the same greedy tokens. Gemma 3's sliding-window layers need
disable_hybrid_kv_cache_manager=True in vLLM (VLLMPrefillWorker sets it)."""

from __future__ import annotations

import gc

import pytest

from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.kvstore import connect
from oasiskv.models.engine import LLM
from oasiskv.models.sampling import SamplingParams

from ..conftest import stdlib_source
from .test_vllm_connector import vllm_alone

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# Qwen2.5-Coder-1.5B is left out: vLLM's and OasisKV's fp32 copies of it together took 17 GB
# and were OOM-killed on this 24 GB machine.
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "gemma3-270m"])
def test_three_ways_agree(name, nixl_store):
    from oasiskv.prefill_node.vllm_worker import VLLMPrefillWorker

    worker = VLLMPrefillWorker(name, dtype="float32", chunk_tokens=512, kv_cache_gb=0.5, max_model_len=4096)
    llm = LLM(name, dtype="float32", kv_cache_gb=0.5)
    try:
        ids = llm.encode(stdlib_source("argparse.py"))[:1200]
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        reference = llm.generate([ids], params)[0].token_ids
        assert vllm_alone(worker, ids) == reference
        engine = DecodeEngine(llm.model, llm.tokenizer, connect(nixl_store.address),
                              DecodeConfig(mode="dense", kv_pool_gb=0.5))
        engine.add(worker.prefill(f"{name}-1", ids, {"max_tokens": 32}, nixl_store.address), params)
        assert engine.run_to_completion()[f"{name}-1"].token_ids == reference
        assert nixl_store.store.stats().num_requests == 0
    finally:
        del worker, llm
        gc.collect()
