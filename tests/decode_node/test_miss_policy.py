"""The miss policy on a real model and store whose reads are slowed down, so look-ahead
prefetches have not landed when their layer runs: `wait` blocks for them and decodes exactly as
with fast reads; `skip` attends without them and never blocks the model on a prefetch."""

from __future__ import annotations

import sys

import pytest

from bench.common import DelayedReads
from oasiskv.decode_node import io_thread
from oasiskv.decode_node.config import DecodeConfig
from oasiskv.models.sampling import SamplingParams

from .conftest import GREEDY, run_engine

SMALL = dict(mode="lookahead", budget_tokens=160, kv_pool_gb=0.25)


@pytest.fixture
def blocking_waits(monkeypatch):
    """The callers of every transfer wait that had to block (its transfer had not finished)."""
    callers = []
    wait = io_thread.FetchHandle.wait

    def recording(self, timeout=None):
        if not self.future.done():
            frame = sys._getframe(1)
            while frame.f_code.co_filename == io_thread.__file__:  # wait_due: who called it
                frame = frame.f_back
            callers.append(frame.f_code.co_name)
        return wait(self, timeout)

    monkeypatch.setattr(io_thread.FetchHandle, "wait", recording)
    return callers


def _run(smollm2_llm, store, prompts, config, tag, delay_s=0.0):
    """Decode both prompts, through reads `delay_s` late when it is set; everything is given back."""
    wrap = (lambda client: DelayedReads(client, delay_s)) if delay_s else None
    engine, tokens = run_engine(smollm2_llm, store, prompts, config, tag=tag, wrap_client=wrap)
    assert engine.pool.allocator.num_free == engine.pool.num_rows
    assert store.stats().num_requests == 0
    return engine.counters, tokens


def test_wait_blocks_for_late_prefetches_and_decodes_as_if_they_were_on_time(smollm2_llm, store, prompts,
                                                                             blocking_waits):
    on_time, reference = _run(smollm2_llm, store, prompts, DecodeConfig(miss_policy="wait", **SMALL), "-wait-fast")
    blocking_waits.clear()
    late, tokens = _run(smollm2_llm, store, prompts, DecodeConfig(miss_policy="wait", **SMALL), "-wait-slow",
                        delay_s=0.03)
    assert set(blocking_waits) - {"_finish", "step"}, "no layer waited for a prefetch"  # what skip must never do
    assert tokens == reference
    assert late.blocks_fetched == on_time.blocks_fetched > 0  # the same plans, only later
    assert late.prefetch_waits > 0 and late.fetch_wait_s > 0
    assert late.prefetch_misses == late.prefetch_waits
    assert late.prefetch_skips == 0


# Slow-marked for the default suite's time (50 s: every layer waits for late reads); .ci/run runs it.
@pytest.mark.slow
def test_a_block_leaving_the_window_never_lands_in_a_row_whose_fetch_is_still_landing(smollm2_llm, store, prompts):
    """Two budget rows a head, every one of them replaced at each step: with late reads all of a
    head's budget rows are in flight when a block leaves the window. Its local copy went into
    one of them anyway, the read then overwrote it under the retired block's label, and the
    model attended to the wrong KV (22 of 80 tokens in, on a hunt's text)."""
    config = dict(mode="lookahead", budget_tokens=32, kv_pool_gb=0.25, window_blocks=1, max_replace_fraction=1.0,
                  prefetch_rank_fraction=1.0, miss_policy="wait")
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    _, reference = run_engine(smollm2_llm, store, prompts, DecodeConfig(**config), params=params, tag="-all-fast")
    engine, tokens = run_engine(smollm2_llm, store, prompts, DecodeConfig(**config), params=params, tag="-all-slow",
                                wrap_client=lambda client: DelayedReads(client, 0.02))
    assert engine.counters.prefetch_waits > 0
    assert tokens == reference


def test_skip_attends_without_late_prefetches_and_never_blocks_on_one(smollm2_llm, store, prompts, blocking_waits):
    counters, tokens = _run(smollm2_llm, store, prompts, DecodeConfig(miss_policy="skip", **SMALL), "-skip-slow",
                            delay_s=0.03)
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    assert counters.prefetch_skips > 0
    assert counters.prefetch_misses == counters.prefetch_skips
    assert counters.prefetch_waits == 0 and counters.fetch_wait_s == 0
    # The model thread blocked only where rows must not be reused under a landing transfer (a
    # finished request's, and a ring row whose write-back is still queued when the window comes
    # round to it: `step`), never in a layer for a prefetch (nor for an admission's reads: the
    # request joins the batch once they have landed).
    assert set(blocking_waits) <= {"_finish", "step"}, blocking_waits
