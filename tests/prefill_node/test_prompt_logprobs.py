"""vLLM's prompt_logprobs, computed by the prefill: against transformers on the same weights (an
independent oracle), across chunks and slices of rows, and never from a prefix cache, whose
blocks have no logits."""

from __future__ import annotations

import pytest
import torch

from oasiskv.kvstore import connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node import prefill as prefill_module
from oasiskv.prefill_node.prefill import Prefiller
from oasiskv.prefill_node.prefix_cache import PrefixCache

from ..conftest import stdlib_source


@pytest.fixture(scope="module")
def reference_logprobs(smollm2_dir):
    """transformers' log-softmax over a prompt of 300 tokens, and the prompt: the weights the
    `smollm2_llm` fixture loads."""
    from transformers import AutoModelForCausalLM

    from oasiskv.models.tokenizer import load_tokenizer

    prompt = load_tokenizer(smollm2_dir).encode(stdlib_source("heapq.py"))[:300]
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt])).logits[0].float()
    return prompt, torch.log_softmax(logits, dim=-1)


def _assert_match_transformers(entries, prompt, reference, top):
    """Entry i is prompt token i + 1, scored from position i."""
    assert [e.token_id for e in entries] == prompt[1:]
    ref = reference[: len(prompt) - 1]
    chosen = ref.gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1))
    assert (torch.tensor([e.logprob for e in entries]) - chosen.squeeze(-1)).abs().max().item() < 1e-3
    ranks = (ref >= chosen).sum(dim=-1)  # vLLM's: the tokens at least as likely, the token too
    # A rank may differ by a near-tie (logprobs within the two runtimes' rounding): a few at most.
    assert (torch.tensor([e.rank for e in entries]) - ranks).abs().le(1).all()
    assert (torch.tensor([e.rank for e in entries]) == ranks).float().mean().item() > 0.97
    assert (ranks > 1).any() and (ranks == 1).any()  # the ranks say something
    if top:
        values, ids = ref.topk(top, dim=-1)
        assert (torch.tensor([[lp for _, lp in e.top] for e in entries]) - values).abs().max().item() < 1e-3
        same = (torch.tensor([[t for t, _ in e.top] for e in entries]) == ids).float().mean().item()
        assert same > 0.97
    else:
        assert all(e.top == () for e in entries)


@pytest.mark.parametrize("top", [0, 4])
def test_prompt_logprobs_match_transformers_across_chunks(smollm2_llm, store, reference_logprobs, monkeypatch, top):
    prompt, reference = reference_logprobs
    monkeypatch.setattr(prefill_module, "PROMPT_LOGITS_ROWS", 48)  # several slices in each chunk
    client = connect(store.address, transport="tcp")
    prefiller = Prefiller(smollm2_llm.model, client, chunk_tokens=128)  # 3 chunks
    result = prefiller.prefill(f"prompt-logprobs-{top}", prompt, SamplingParams(max_tokens=4, prompt_logprobs=top))
    client.free(f"prompt-logprobs-{top}")
    _assert_match_transformers(result.prompt_logprobs, prompt, reference, top)
    plain = prefiller.prefill("no-prompt-logprobs", prompt, SamplingParams(max_tokens=4))
    client.free("no-prompt-logprobs")
    assert plain.prompt_logprobs is None and plain.first_token == result.first_token


def test_a_prompt_with_prompt_logprobs_is_computed_whole_not_taken_from_the_prefix_cache(
        smollm2_llm, store, reference_logprobs):
    prompt, reference = reference_logprobs
    client = connect(store.address, transport="tcp")
    prefiller = Prefiller(smollm2_llm.model, client, chunk_tokens=128, prefix_cache=PrefixCache(64 * 2**20, 16))
    prefiller.prefill("cached-1", prompt, SamplingParams(max_tokens=4))
    client.free("cached-1")
    again = prefiller.prefill("cached-2", prompt, SamplingParams(max_tokens=4))
    client.free("cached-2")
    assert again.cached_tokens > 0  # the cache holds the prompt
    scored = prefiller.prefill("cached-3", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
    client.free("cached-3")
    assert scored.cached_tokens == 0
    _assert_match_transformers(scored.prompt_logprobs, prompt, reference, 1)


def test_prompt_logprobs_are_refused_by_the_single_process_engine_and_out_of_range():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer"):
        SamplingParams(prompt_logprobs=1.5)


def test_the_single_process_engine_says_it_does_not_compute_prompt_logprobs(smollm2_llm):
    with pytest.raises(ValueError, match="prompt_logprobs are computed by the cluster's prefill"):
        smollm2_llm.generate(["hi"], SamplingParams(max_tokens=2, prompt_logprobs=1))
