"""vLLM prefills through OasisKVConnector into a real store (NIXL); OasisKV decodes the request.

Oracles: OasisKV's own prefill of the same prompt (the KV and summaries in the store), and vLLM
alone (the greedy tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.kvstore import KVStoreServer, connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller
from oasiskv.prefill_node.vllm_connector import learn_cpu_block_order
from oasiskv.prefill_node.vllm_worker import VLLMPrefillError

from ..conftest import stdlib_source

pytestmark = pytest.mark.vllm

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(smollm2_llm):
    ids = smollm2_llm.encode(stdlib_source("argparse.py"))
    # 700 tokens: three vLLM steps of 256, 44 store blocks (most outside sinks and window).
    return [ids[:700], smollm2_llm.encode(stdlib_source("typing.py"))[:530]]


def vllm_alone(vllm_prefill, prompt: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    out = vllm_prefill.llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                                    VLLMSamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def read_all(client, request_id: str, layout, num_tokens: int) -> torch.Tensor:
    blocks = layout.num_blocks(num_tokens)
    units = layout.num_layers * layout.num_kv_heads * blocks
    layers = np.repeat(np.arange(layout.num_layers), layout.num_kv_heads * blocks)
    heads = np.tile(np.repeat(np.arange(layout.num_kv_heads), blocks), layout.num_layers)
    block_ids = np.tile(np.arange(blocks), layout.num_layers * layout.num_kv_heads)
    out = torch.zeros((units, *layout.unit_shape), dtype=layout.dtype)
    client.read_blocks(request_id, layers, heads, block_ids, out).wait()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_order_is_learned_from_the_backend_kernel(dtype):
    """On this CPU (no AMX) vLLM's `vec` kernel stores a block's keys channel-major and its
    values token-major; the order learned from the kernel must say exactly that."""
    block_size, head_dim = 32, 64
    key_order, value_order = learn_cpu_block_order("vec", dtype, block_size, head_dim)
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_dim)[None, :]
    assert torch.equal(key_order, d * block_size + t)
    assert torch.equal(value_order, block_size * head_dim + t * head_dim + d)


def test_store_holds_what_oasiskv_prefill_writes(smollm2_llm, nixl_store, vllm_prefill, prompts):
    prompt = prompts[0]
    client = connect(nixl_store.address)
    assert client.transport_name == "nixl"
    result = vllm_prefill.prefill("vllm-kv", prompt, {"max_tokens": 8}, nixl_store.address)
    own = Prefiller(smollm2_llm.model, client).prefill("own-kv", prompt, SamplingParams(max_tokens=8))
    try:
        assert result.first_token == own.first_token
        assert result.layout == own.layout
        assert result.initial_selection.shape[-1] == 0  # vLLM has no queries to predict with
        theirs = read_all(client, "vllm-kv", result.layout, len(prompt))
        ours = read_all(client, "own-kv", own.layout, len(prompt))
        # Same weights, both fp32: the KV agrees to rounding; wrong slots would be O(1) off.
        torch.testing.assert_close(theirs, ours, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(client.read_summaries("vllm-kv"), client.read_summaries("own-kv"), atol=2e-4, rtol=1e-4)
    finally:
        client.free("vllm-kv")
        client.free("own-kv")
    assert nixl_store.store.stats().num_requests == 0


@pytest.mark.parametrize("mode,budget", [("dense", 2048), ("lookahead", 2048), ("lookahead", 256)])
def test_vllm_prefill_then_oasiskv_decode(smollm2_llm, nixl_store, vllm_prefill, prompts, mode, budget):
    """The acceptance check of the interop: vLLM prefill + OasisKV decode == vLLM alone (greedy).
    With a budget below the prompt (256 tokens of 700) the sparse run must still decode every
    token and pick its first blocks from its own first query; agreement is reported, not equal."""
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, connect(nixl_store.address),
                          DecodeConfig(mode=mode, budget_tokens=budget, kv_pool_gb=0.1))
    ids = [f"{mode}-{budget}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add(vllm_prefill.prefill(request_id, prompt, {"max_tokens": NEW_TOKENS}, nixl_store.address), params)
    outputs = engine.run_to_completion()
    expected = [vllm_alone(vllm_prefill, p) for p in prompts]
    got = [outputs[i].token_ids for i in ids]
    if budget >= max(len(p) for p in prompts):
        assert got == expected
    else:
        assert all(len(g) == NEW_TOKENS for g in got)
        assert engine.counters.blocks_fetched > 0  # the first step fetched what its query chose
    assert engine.pool.allocator.num_free == engine.pool.num_rows
    assert nixl_store.store.stats().num_requests == 0


def test_greedy_oracle_vllm_equals_oasiskv(smollm2_llm, vllm_prefill):
    """Independent oracle: vLLM and OasisKV's engine, same weights, same prompts, greedy."""
    texts = [stdlib_source(name)[:1500] for name in ("json/decoder.py", "heapq.py", "textwrap.py")]
    prompts = [smollm2_llm.encode(t) for t in texts]
    ours = [o.token_ids for o in smollm2_llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]
    assert ours == [vllm_alone(vllm_prefill, p) for p in prompts]


def test_requests_without_store_parameters_are_served_as_usual(vllm_prefill, nixl_store, prompts):
    before = nixl_store.store.stats().num_requests
    tokens = vllm_alone(vllm_prefill, prompts[1][:100], max_tokens=4)
    assert len(tokens) == 4
    assert nixl_store.store.stats().num_requests == before


def test_unreachable_store_is_a_clear_error_and_vllm_keeps_serving(vllm_prefill, nixl_store, prompts):
    with pytest.raises(VLLMPrefillError, match="127.0.0.1:9"):
        vllm_prefill.prefill("to-nowhere", prompts[1][:64], {"max_tokens": 4}, "127.0.0.1:9")
    result = vllm_prefill.prefill("after-nowhere", prompts[1][:64], {"max_tokens": 4}, nixl_store.address)
    assert result.first_token >= 0
    vllm_prefill.free("after-nowhere", nixl_store.address)


def test_full_store_is_a_clear_error_and_nothing_leaks(vllm_prefill, prompts):
    small = KVStoreServer(capacity_bytes=4 * 2**20, transport="nixl")  # 4 MiB: 700 tokens need ~32
    small.start()
    try:
        with pytest.raises(VLLMPrefillError, match="did not reach the store"):
            vllm_prefill.prefill("too-big", prompts[0], {"max_tokens": 4}, small.address)
        assert small.store.stats().num_requests == 0
        result = vllm_prefill.prefill("fits", prompts[0][:32], {"max_tokens": 4}, small.address)
        assert result.layout.num_blocks(32) == 2
        vllm_prefill.free("fits", small.address)
        assert small.store.stats().num_requests == 0
    finally:
        small.stop()


def test_a_prefill_that_fails_inside_vllm_leaves_nothing_behind(vllm_prefill, nixl_store, prompts, monkeypatch):
    """vLLM 0.32 on CPUs fails a seeded, sampled prompt longer than one step ("CPU Generator does
    not use offset"). The API refuses such requests (tests/prefill_node/test_vllm_prefill_refusal.py);
    here the refusal is lifted so that vLLM fails for real. The failed request stayed inside
    vLLM: the next prefill took its token for its own, and after two failures every prefill spun."""
    import concurrent.futures

    import oasiskv.prefill_node.vllm_worker as vllm_worker

    short = prompts[1][:40]
    expected = vllm_prefill.prefill("before-failures", short, {"max_tokens": 4}, nixl_store.address).first_token
    vllm_prefill.free("before-failures", nixl_store.address)
    monkeypatch.setattr(vllm_worker, "vllm_prefill_refusal", lambda *args: None)
    for i in range(2):
        with pytest.raises(RuntimeError, match="offset"):
            vllm_prefill.prefill(f"seeded-{i}", prompts[0], {"max_tokens": 4, "temperature": 1.0, "seed": 7},
                                 nixl_store.address)
        vllm_prefill.free(f"seeded-{i}", nixl_store.address)  # as the API does after a failed prefill
    monkeypatch.undo()
    assert not vllm_prefill.llm.llm_engine.output_processor.request_states
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        after = pool.submit(vllm_prefill.prefill, "after-failures", short, {"max_tokens": 4}, nixl_store.address)
        assert after.result(timeout=120).first_token == expected
    vllm_prefill.free("after-failures", nixl_store.address)
    assert nixl_store.store.stats().num_requests == 0
