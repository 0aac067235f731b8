"""The model runtime against an independent oracle: Hugging Face transformers loading the same
GGUF file. fp32, a 64-token prompt of real text: per-position log-probs within 1e-3 and 64
greedy tokens identical. SmolLM2 runs by default; the bigger models are `slow`."""

from __future__ import annotations

import pytest
import torch

from ..conftest import stdlib_source

MODELS = [
    "smollm2-135m",
    pytest.param("gemma3-270m", marks=pytest.mark.slow),
    pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
    pytest.param("qwen2.5-coder-1.5b", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name", MODELS)
def test_logprobs_and_greedy_tokens_match_transformers(name):
    from transformers import AutoModelForCausalLM

    from oasiskv.models.engine import LLM
    from oasiskv.models.loader import load_model_gguf
    from oasiskv.models.pull import gguf_path, resolve_model
    from oasiskv.models.sampling import SamplingParams
    from oasiskv.models.tokenizer import load_tokenizer

    gguf = gguf_path(name)
    tokenizer = load_tokenizer(resolve_model(name))
    ours = load_model_gguf(gguf, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    prompt = tokenizer.encode(stdlib_source("argparse.py"), add_special_tokens=True)[:64]
    assert len(prompt) == 64

    llm = LLM.from_model(ours, tokenizer, kv_cache_gb=0.25)
    ours_logprobs = llm.prompt_logprobs(prompt)
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([prompt])).logits[0].float()
    ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
    assert ours_logprobs.shape == ref_logprobs.shape
    assert (ours_logprobs - ref_logprobs).abs().max().item() < 1e-3

    ours_tokens = llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        ref_tokens = reference.generate(
            torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False
        )[0, len(prompt) :].tolist()
    assert ours_tokens == ref_tokens


def test_generated_token_logprobs_match_transformers():
    """Logprobs are the model's own (raw logits, as vLLM's default), not the sampling
    distribution: a temperature of 0.7 does not change them."""
    from transformers import AutoModelForCausalLM

    from oasiskv.models.engine import LLM
    from oasiskv.models.loader import load_model_gguf
    from oasiskv.models.pull import gguf_path, resolve_model
    from oasiskv.models.sampling import SamplingParams
    from oasiskv.models.tokenizer import load_tokenizer

    gguf = gguf_path("smollm2-135m")
    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    llm = LLM.from_model(load_model_gguf(gguf, dtype=torch.float32), tokenizer, kv_cache_gb=0.25)
    prompt = tokenizer.encode(stdlib_source("argparse.py"), add_special_tokens=True)[:48]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True, logprobs=3))[0]
    assert [e.token_id for e in out.logprobs] == out.token_ids
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :].float()
    ref = torch.log_softmax(logits, dim=-1)
    chosen = ref.gather(-1, torch.tensor(out.token_ids).unsqueeze(-1)).squeeze(-1)
    assert (torch.tensor([e.logprob for e in out.logprobs]) - chosen).abs().max().item() < 1e-3
    values, ids = ref.topk(3, dim=-1)
    assert [[t for t, _ in e.top] for e in out.logprobs] == ids.tolist()
    assert (torch.tensor([[lp for _, lp in e.top] for e in out.logprobs]) - values).abs().max().item() < 1e-3
    assert any(e.top[0][0] != e.token_id for e in out.logprobs)  # sampled, not greedy: the check above means something
