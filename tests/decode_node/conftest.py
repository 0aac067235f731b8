"""Shared by the decode engine's tests: a store, two real prompts, and one way to decode them."""

from __future__ import annotations

import pytest

from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.kvstore import KVStore, connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller

from ..conftest import stdlib_source

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def store():
    return KVStore(256 * 2**20)


@pytest.fixture(scope="module")
def prompts(smollm2_llm):
    ids = smollm2_llm.encode(stdlib_source("argparse.py"))
    # ~40 and ~33 blocks: most of each prompt lies outside the sinks and the window.
    return [ids[:640], ids[3000:3530]]


def run_engine(smollm2_llm, store, prompts, config, params=GREEDY, drafter=None, tag="", wrap_client=None,
               prepare=None):
    """Prefill `prompts` into `store` and decode them to completion with one engine; the engine
    reads through `wrap_client(client)` when given, and `prepare(engine)` runs before the first
    request is added. Returns the engine and each prompt's tokens."""
    client = connect(store)
    engine_client = client if wrap_client is None else wrap_client(client)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, engine_client, config, drafter=drafter)
    if prepare is not None:
        prepare(engine)
    prefiller = Prefiller(smollm2_llm.model, client, tokenizer=smollm2_llm.tokenizer)
    for i, prompt in enumerate(prompts):
        result = prefiller.prefill(
            f"{config.mode}{tag}-{i}", prompt, params, budget_blocks=config.budget_blocks,
            excluded_head_blocks=config.sink_blocks, excluded_tail_blocks=config.window_blocks,
        )
        engine.add(result, params)
    outputs = engine.run_to_completion()
    return engine, [outputs[f"{config.mode}{tag}-{i}"].token_ids for i in range(len(prompts))]
