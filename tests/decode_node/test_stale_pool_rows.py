"""A pool row keeps whatever its last owner wrote there: KV, or summary pages whose bytes can read
as NaN in the KV dtype. Attention masks the keys a request must not see, but a masked value still
enters the weighted sum times zero, and 0 x NaN is NaN: a serve under mixed load died of this
(`torch.multinomial` on NaN probabilities). Admission therefore starts the rows it does not fetch
as zeros, and a batch pads with each request's own rows."""

from __future__ import annotations

import math

import pytest
import torch

from oasiskv.decode_node.config import DecodeConfig

from .conftest import run_engine


# Two of the modes run in CI's slow step, which keeps the default suite well under 25 minutes.
@pytest.mark.parametrize("mode", ["lookahead", pytest.param("sparse-current", marks=pytest.mark.slow),
                                  pytest.param("dense", marks=pytest.mark.slow)])
def test_rows_full_of_nan_bytes_change_no_token(smollm2_llm, store, prompts, mode):
    # Two prompts of different lengths: dense's batch pads the shorter one's rows.
    config = DecodeConfig(mode=mode, budget_tokens=256)
    clean_engine, expected = run_engine(smollm2_llm, store, prompts, config, tag="-clean")
    clean_engine.close()

    def poison(engine):
        engine.pool.tensor.fill_(math.nan)  # the worst a previous owner can leave

    stale_engine, tokens = run_engine(smollm2_llm, store, prompts, config, tag="-stale", prepare=poison)
    stale_engine.close()
    assert tokens == expected

def test_clear_rows_zeroes_only_those_rows(smollm2_llm):
    from oasiskv.decode_node.working_set import DevicePool
    from oasiskv.prefill_node.prefill import kv_layout_for

    pool = DevicePool(kv_layout_for(smollm2_llm.model, 16), 4 * 2**20)
    pool.tensor.fill_(math.nan)
    pool.clear_rows(torch.tensor([0, 2]))
    assert bool((pool.tensor[[0, 2]] == 0).all())
    assert bool(pool.tensor[1].isnan().all())
    pool.clear_rows(torch.tensor([], dtype=torch.long))  # nothing to clear is not an error
