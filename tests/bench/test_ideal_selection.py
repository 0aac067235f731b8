"""`bench/sparse_quality.py`'s ideal-selection backend against the model's own forward: its
`dense` rule is the check of the backend, and on a model with sliding-window layers it read
Gemma 3's perplexity 539x too high (no window mask)."""

import pytest

from bench.sparse_quality import ideal_selection, prefill_once
from oasiskv.kvstore import KVStore, connect

from ..conftest import stdlib_source

CONTEXT, NEW_TOKENS = 400, 8


@pytest.mark.parametrize("rule", ["dense", "exact"])
def test_every_rule_that_can_hold_every_visible_block_equals_the_models_own_forward(sliding_llm, rule):
    full = sliding_llm.encode(stdlib_source("argparse.py"))[: CONTEXT + NEW_TOKENS + 1]
    client = connect(KVStore(64 * 2**20), transport="inproc")
    stored = prefill_once(sliding_llm, client, full[:CONTEXT], budget_blocks=8, sinks=1, window=4)
    # A 128-token window sees at most 9 blocks of 16: 8 budget blocks and the 4-block window hold them all.
    logprob, _ = ideal_selection(sliding_llm, stored, full, CONTEXT, NEW_TOKENS, rule, 8, 1, 4)
    expected = sliding_llm.prompt_logprobs(full[: CONTEXT + NEW_TOKENS])  # row i predicts token i + 1
    assert sorted(logprob) == list(range(CONTEXT + 1, CONTEXT + NEW_TOKENS + 1))
    for position, value in logprob.items():
        assert value == pytest.approx(float(expected[position - 1, full[position]]), abs=1e-4)
