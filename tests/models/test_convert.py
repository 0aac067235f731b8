"""The conversion against an independent oracle: transformers reading the same GGUF itself.

Default suite: SmolLM2-135M. The other three registry models run the same checks under `-m slow`.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from oasiskv.models.gguf_convert import read_gguf, unpermute_rope_rows
from oasiskv.models.pull import gguf_path, pull_model
from oasiskv.models.tokenizer import load_tokenizer

SLOW_MODELS = ["gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]

# Keys whose values must agree with transformers' own reading of the GGUF config.
CONFIG_KEYS = [
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "pad_token_id", "sliding_window", "layer_types",
    "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "rope_parameters",
]  # fmt: skip
PROMPT_TOKENS = 600  # past Gemma 3's 512-token window, so sliding layers really slide
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a Python function that reverses a list."},
    {"role": "assistant", "content": "def rev(xs):\n    return xs[::-1]"},
    {"role": "user", "content": "Now in place, größer."},
]


def llamacpp_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to Llama q/k rows, written from its description."""
    out = torch.empty_like(weight)
    head_dim = weight.shape[0] // n_heads
    for h in range(n_heads):
        for half in range(2):
            for j in range(head_dim // 2):
                out[h * head_dim + 2 * j + half] = weight[h * head_dim + half * head_dim // 2 + j]
    return out


def test_unpermute_inverts_llamacpp_permute():
    weight = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)
    assert torch.equal(unpermute_rope_rows(llamacpp_permute(weight, 6), 6), weight)
    bias = torch.arange(16.0)
    assert torch.equal(unpermute_rope_rows(llamacpp_permute(bias[:, None], 2), 2)[:, 0], bias)


def load_reference_model(gguf_file: Path):
    """transformers reading the GGUF itself: the independent oracle for our conversion."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


def load_reference_tokenizer(gguf_file: Path):
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def smol_reference(smol_gguf):
    return load_reference_model(smol_gguf)


@pytest.fixture(scope="module")
def smol_reference_tokenizer(smol_gguf):
    return load_reference_tokenizer(smol_gguf)


# --- shared checks -------------------------------------------------------------------------------


def check_state_dict(config: dict, state: dict, reference) -> None:
    ref_state = reference.state_dict()
    expected = set(ref_state) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert set(state) == expected
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and tensor.shape == ref_state[name].shape, name
        assert torch.equal(tensor, ref_state[name]), f"{name} differs from transformers' GGUF reading"


def check_config(config: dict, model_dir, reference) -> None:
    ours = json.loads((model_dir / "config.json").read_text())
    assert ours == {**config, "dtype": "bfloat16"}
    ref = reference.config.to_dict()
    for key in CONFIG_KEYS:
        if key in ours and key in ref:  # Qwen2Config has no head_dim: it derives hidden/heads
            assert ours[key] == ref[key], key
    assert ours["head_dim"] == getattr(reference.config, "head_dim", ours["hidden_size"] // ours["num_attention_heads"])
    for key in ("rms_norm_eps",):
        assert ours[key] == pytest.approx(ref[key], rel=1e-6)
    eos = ours["eos_token_id"]
    assert ref["eos_token_id"] == (eos[0] if isinstance(eos, list) else eos)


def prompt_ids(tokenizer, source: str, n: int = PROMPT_TOKENS) -> torch.Tensor:
    ids = tokenizer.encode(source[:20_000])[:n]
    assert len(ids) == n
    return torch.tensor([ids])


@torch.no_grad()
def check_converted_dir_logits(model_dir, reference, ids: torch.Tensor) -> None:
    """transformers on our bf16 directory vs transformers on the GGUF: equal up to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert type(ours) is type(reference)
    assert next(ours.parameters()).dtype == torch.float32
    got, want = ours(ids).logits[0], reference(ids).logits[0]
    del ours
    gc.collect()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    logp, logq = want.log_softmax(-1), got.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    assert agree >= 0.97, f"top-1 agreement {agree:.3f}"
    assert kl.mean().item() < 2e-3 and kl.max().item() < 0.1, (kl.mean().item(), kl.max().item())


def check_tokenizer(model_dir, reference_tokenizer, source: str) -> None:
    ours = load_tokenizer(model_dir)
    text = source[:6_000]
    assert ours.encode(text) == reference_tokenizer(text).input_ids
    assert ours.encode(text, add_special_tokens=False) == reference_tokenizer(text, add_special_tokens=False).input_ids
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    # Whoever loads the directory with transformers (vLLM does) gets the same ids.
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(model_dir))(text).input_ids == ours.encode(text)


def check_chat_template(model_dir, reference_tokenizer) -> str:
    ours = load_tokenizer(model_dir)
    rendered = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    if reference_tokenizer.chat_template:  # the GGUF had one: it must render identically
        want = reference_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert rendered == want
    if reference_tokenizer.chat_template:  # a reply left open in its final message, as transformers leaves it
        # ("m" is also a piece of ChatML's closing <|im_end|>; "" opens an empty turn)
        for reply in ("def rev(xs):\n    return  ", "m", ""):
            left_open = [*CHAT[:2], {"role": "assistant", "content": reply}]
            assert ours.apply_chat_template(left_open, add_generation_prompt=False, continue_final_message=True,
                                            tokenize=False) == reference_tokenizer.apply_chat_template(
                left_open, continue_final_message=True, tokenize=False)
    ids = ours.apply_chat_template(CHAT)
    assert ids == ours.encode(rendered, add_special_tokens=False)
    assert ids[:2] != [ours.bos_token_id] * 2  # the template's BOS is not doubled by encoding
    return rendered


# --- SmolLM2 (default suite) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_fp32(smol_gguf):
    return read_gguf(smol_gguf, dtype=torch.float32)


def test_smol_state_dict_equals_transformers(smol_fp32, smol_reference):
    check_state_dict(*smol_fp32, smol_reference)


def test_smol_config(smol_fp32, smol_dir, smol_reference):
    config, _ = smol_fp32
    check_config(config, smol_dir, smol_reference)
    assert config["model_type"] == "llama" and config["tie_word_embeddings"]
    assert config["rope_theta"] == 100_000.0 and config["rms_norm_eps"] == 1e-5


@torch.no_grad()
def test_smol_fp32_logits_equal_transformers(smol_fp32, smol_reference, smol_reference_tokenizer, python_source):
    from transformers import AutoConfig, AutoModelForCausalLM

    config, state = smol_fp32
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == ["lm_head.weight"]  # tied to the embedding
    ids = torch.tensor([smol_reference_tokenizer(python_source[:3000]).input_ids[:200]])
    torch.testing.assert_close(model(ids).logits, smol_reference(ids).logits, rtol=1e-5, atol=1e-4)


def test_smol_converted_dir_logits(smol_dir, smol_reference, python_source):
    check_converted_dir_logits(smol_dir, smol_reference, prompt_ids(load_tokenizer(smol_dir), python_source, 300))


def test_smol_tokenizer_matches_transformers(smol_dir, smol_reference_tokenizer, python_source):
    check_tokenizer(smol_dir, smol_reference_tokenizer, python_source)
    ours = load_tokenizer(smol_dir)
    assert ours.encode("hello")[0] != ours.bos_token_id  # SmolLM2 adds no BOS
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_ids[0] == ours.eos_token_id


def test_smol_chat_template(smol_dir, smol_reference_tokenizer):
    rendered = check_chat_template(smol_dir, smol_reference_tokenizer)
    assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert rendered.endswith("<|im_start|>assistant\n")


def test_qwen_tokenizer_normalizes_as_transformers_qwen2_tokenizer(model_cache):
    """Qwen2's tokenizer NFC-normalizes; transformers (and vLLM through it) load the converted
    directory as a Qwen2Tokenizer, which does. Decomposed accents were two tokens here before."""
    from transformers import AutoTokenizer

    model_dir = pull_model("qwen2.5-coder-0.5b", model_cache, progress=False)
    ours, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    for text in ["Cafe\u0301 cre\u0300me", "A\u030angstro\u0308m", "\u00e9", "plain ascii", "\ufb01 \u212b"]:
        assert ours.encode(text) == theirs(text).input_ids, text
    assert ours.encode("e\u0301") == ours.encode("\u00e9") and len(ours.encode("e\u0301")) == 1


# --- the other registry models (slow) -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_MODELS)
def test_registry_model_against_transformers(name, model_cache, python_source):
    gguf_file = gguf_path(name, model_cache, progress=False)
    model_dir = pull_model(name, model_cache, progress=False)
    reference = load_reference_model(gguf_file)
    config, state = read_gguf(gguf_file, dtype=torch.float32)
    check_state_dict(config, state, reference)
    check_config(config, model_dir, reference)
    del state
    gc.collect()
    check_converted_dir_logits(model_dir, reference, prompt_ids(load_tokenizer(model_dir), python_source))
    if name == "gemma3-270m":
        assert config["layer_types"].count("full_attention") == 3
        assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
        assert config["sliding_window"] == 512 and config["rope_local_base_freq"] == 10_000.0


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_MODELS)
def test_registry_model_tokenizer(name, model_cache, python_source):
    gguf_file = gguf_path(name, model_cache, progress=False)
    model_dir = pull_model(name, model_cache, progress=False)
    reference = load_reference_tokenizer(gguf_file)
    check_tokenizer(model_dir, reference, python_source)
    rendered = check_chat_template(model_dir, reference)
    ours = load_tokenizer(model_dir)
    if name == "gemma3-270m":
        assert ours.encode("hello")[0] == ours.bos_token_id  # Gemma needs <bos>
        assert rendered.startswith("<bos><start_of_turn>user\nYou are terse.\n\nWrite")
        assert rendered.endswith("<start_of_turn>model\n")
        assert ours.token_to_id("<end_of_turn>") in ours.eos_token_ids
    else:
        assert ours.encode("hello")[0] != ours.bos_token_id
        assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
        assert set(ours.eos_token_ids) == {151645, 151643}


@pytest.mark.slow
def test_qwen_pair_shares_a_tokenizer(model_cache):
    small, large = (pull_model(n, model_cache, progress=False) for n in SLOW_MODELS[1:])
    assert (small / "tokenizer.json").read_bytes() == (large / "tokenizer.json").read_bytes()
