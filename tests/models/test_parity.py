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


def _tiny_hf_dir(tmp_path, config, hub_spelling) -> str:
    """A random tiny model saved by transformers, its config.json rewritten as the Hub's
    checkpoints spell the same settings (older keys)."""
    import json

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().eval().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    hub_spelling(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def _gemma3_global_scaling(raw):
    raw.pop("rope_parameters", None)
    raw.update(rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e6, rope_local_base_freq=1e4)


def _qwen2_upper_layers_slide(raw):
    raw.pop("layer_types", None)
    raw.update(use_sliding_window=True, sliding_window=16, max_window_layers=2)


@pytest.mark.parametrize("case", ["gemma3 rope_scaling", "qwen2 max_window_layers"])
def test_per_layer_rope_scaling_and_windows_are_read_as_transformers_reads_them(tmp_path, case):
    """Gemma 3 (4B and up) scales RoPE on its global layers only; Qwen2's use_sliding_window
    slides the layers from max_window_layers on. Both were applied to every layer, and the
    logits differed from transformers' by up to 0.4 (past the window, for Qwen2)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen2Config

    from oasiskv.models.engine import LLM
    from oasiskv.models.loader import load_model_dir

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    if case.startswith("gemma3"):
        config = Gemma3TextConfig(**common, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        path, expected = _tiny_hf_dir(tmp_path, config, _gemma3_global_scaling), ((16, None) * 2, (1.0, 8.0) * 2)
    else:
        config = Qwen2Config(**common, use_sliding_window=True, sliding_window=16, max_window_layers=2)
        path, expected = _tiny_hf_dir(tmp_path, config, _qwen2_upper_layers_slide), ((None, None, 16, 16), (1.0,) * 4)
    ours = load_model_dir(path, dtype=torch.float32)
    assert (ours.config.sliding_window, ours.config.rope_scaling_factor) == expected
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(0, 200, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref_logprobs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ours_logprobs = LLM.from_model(ours, None, kv_cache_gb=0.05).prompt_logprobs(prompt)
    assert (ours_logprobs - ref_logprobs).abs().max().item() < 1e-4
