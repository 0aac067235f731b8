"""The engine under KV-cache pressure: every request that fits the cache alone completes, in any
batch, and a failed generate() leaves nothing behind.

Chunked prefill let waiting sequences hold blocks between chunks; with nothing running, the queue
could hold the whole cache and wait on itself forever ('scheduler is stuck'), and the requests of
the failed call stayed in the engine, so every later call failed the same way."""

from __future__ import annotations

import random

import pytest

from oasiskv.models.engine.scheduler import Scheduler
from oasiskv.models.engine.sequence import Sequence
from oasiskv.models.kv_cache import BlockAllocator
from oasiskv.models.sampling import SamplingParams

from ..conftest import stdlib_source


def test_two_requests_that_each_fit_alone_complete_together(smollm2_llm):
    from oasiskv.models.engine import LLM

    # 8 blocks of 16 tokens and 32-token chunks: the two prompts (56 and 73 tokens) with 36 new
    # tokens each fit alone, not together.
    tiny = LLM.from_model(smollm2_llm.model, smollm2_llm.tokenizer, max_num_batched_tokens=32,
                          kv_cache_gb=8 * smollm2_llm.cache.spec.bytes_per_block / 2**30)
    assert tiny.cache.num_blocks == 8
    text = tiny.encode(stdlib_source("_pydecimal.py"))
    prompts = [text[:56], text[100:173]]
    params = SamplingParams(max_tokens=36, ignore_eos=True)
    alone = [tiny.generate([p], params)[0].token_ids for p in prompts]
    together = tiny.generate(prompts, params)
    assert [o.token_ids for o in together] == alone
    assert all(len(ids) == 36 for ids in alone)
    assert not tiny.has_unfinished and tiny.cache.allocator.num_free == 8


def _run_as_the_engine_does(scheduler: Scheduler, requests: list[tuple[int, int]]) -> int:
    """Drive `scheduler` as LLM.step does, without a model (every sampled token is 1, no EOS);
    return the number of steps until every request finished."""
    sequences = [Sequence([7] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                 for prompt_len, max_tokens in requests]
    for seq in sequences:
        scheduler.add(seq)
    total_tokens = sum(prompt_len + max_tokens for prompt_len, max_tokens in requests)
    allocator = scheduler.allocator
    steps = 0
    while scheduler.has_unfinished:
        steps += 1
        # Each step computes at least one token: only a livelock would recompute the whole
        # batch twice over.
        assert steps <= 2 * total_tokens, f"no end in sight for {requests}"
        batch = scheduler.schedule()
        assert batch is not None, f"stuck on {requests}: " + str(
            [(s.num_tokens, s.num_cached, len(s.block_table)) for s in scheduler.waiting])
        held = [block for seq in sequences for block in seq.block_table]
        assert len(set(held)) == len(held) and len(held) + allocator.num_free == allocator.num_blocks
        for seq, count in zip(batch.sequences, batch.num_new):
            assert len(seq.block_table) * scheduler.block_size >= seq.num_cached + count
        samplers = [seq for seq, count in zip(batch.sequences, batch.num_new) if batch.samples(seq, count)]
        scheduler.after_step(batch)
        for seq in samplers:
            seq.output_ids.append(1)
            if len(seq.output_ids) == seq.params.max_tokens:
                scheduler.finish(seq, "length")
    assert all(seq.is_finished and len(seq.output_ids) == seq.params.max_tokens for seq in sequences)
    assert allocator.num_free == allocator.num_blocks
    return steps


def test_long_context_batches_at_realistic_sizes_all_complete():
    """SmolLM2 fp32 at the default kv_cache_gb=1.0 (1,456 blocks of 16 tokens), 1,024-token
    chunks: batches of 2K-8K-token prompts run to 256-2K new tokens. Most of them stalled."""
    rng = random.Random(2)
    num_blocks, block_size = 1456, 16
    for _ in range(25):
        requests, count = [], rng.randint(3, 24)
        while len(requests) < count:
            prompt_len, max_tokens = rng.randint(2000, 8000), rng.randint(256, 2048)
            if -(-(prompt_len + max_tokens) // block_size) <= num_blocks:
                requests.append((prompt_len, max_tokens))
        _run_as_the_engine_does(Scheduler(BlockAllocator(num_blocks), block_size, 64, 1024), requests)


@pytest.mark.parametrize("seed", range(4))
def test_tiny_caches_complete_every_request_that_fits_alone(seed):
    rng = random.Random(seed)
    for _ in range(500):
        block_size = rng.choice([1, 4, 16])
        num_blocks = rng.randint(2, 12)
        capacity = num_blocks * block_size
        requests, count = [], rng.randint(2, 5)
        while len(requests) < count:
            prompt_len, max_tokens = rng.randint(1, capacity), rng.randint(1, capacity)
            if -(-(prompt_len + max_tokens) // block_size) <= num_blocks:
                requests.append((prompt_len, max_tokens))
        scheduler = Scheduler(BlockAllocator(num_blocks), block_size, rng.choice([1, 2, 64]), rng.choice([16, 24, 48]))
        _run_as_the_engine_does(scheduler, requests)


def test_a_failed_generate_leaves_no_request_behind(smollm2_llm, monkeypatch):
    prompts = ["def f(x):", "class Stack:", "import os"]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in smollm2_llm.generate(prompts, params)]
    run_model = smollm2_llm._run_model
    calls = []

    def fail_on_the_third_step(batch):
        calls.append(batch)
        if len(calls) == 3:  # the requests hold KV blocks by now
            raise RuntimeError("device lost")
        return run_model(batch)

    monkeypatch.setattr(smollm2_llm, "_run_model", fail_on_the_third_step)
    with pytest.raises(RuntimeError, match="device lost"):
        smollm2_llm.generate(prompts, params)
    monkeypatch.undo()
    assert not smollm2_llm.has_unfinished
    assert smollm2_llm.cache.allocator.num_free == smollm2_llm.cache.num_blocks
    assert [o.token_ids for o in smollm2_llm.generate(prompts, params)] == expected
