"""A prefill that hands over no predicted working set (vLLM's, through the connector): the
decode node's first step picks the blocks with its own query."""

from __future__ import annotations

import dataclasses

import torch

from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.kvstore import KVStore, connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller

from ..conftest import stdlib_source

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def _decode(smollm2_llm, budget: int, tag: str):
    store = KVStore(128 * 2**20)
    client = connect(store)
    prompt = smollm2_llm.encode(stdlib_source("argparse.py"))[:640]
    result = Prefiller(smollm2_llm.model, client).prefill(tag, prompt, PARAMS, budget_blocks=budget // 16)
    empty = torch.empty((*result.initial_selection.shape[:2], 0), dtype=torch.long)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client,
                          DecodeConfig(mode="lookahead", budget_tokens=budget, kv_pool_gb=0.1))
    engine.add(dataclasses.replace(result, initial_selection=empty), PARAMS)
    tokens = engine.run_to_completion()[tag].token_ids
    assert store.stats().num_requests == 0
    return engine, prompt, tokens


def test_full_budget_without_a_prediction_still_matches_the_engine(smollm2_llm):
    engine, prompt, tokens = _decode(smollm2_llm, 2048, "no-prediction")
    assert tokens == smollm2_llm.generate([prompt], PARAMS)[0].token_ids
    # Admission fetched only sinks and window; the rest came on the first step's demand.
    assert engine.counters.blocks_fetched > 0


def test_small_budget_without_a_prediction_fetches_on_the_first_step(smollm2_llm):
    engine, _, tokens = _decode(smollm2_llm, 160, "no-prediction-small")
    assert len(tokens) == PARAMS.max_tokens
    assert engine.counters.blocks_fetched > 0
