"""A Hugging Face `config.json` for a GGUF file, from its llama.cpp metadata.

Keys are the ones transformers' LlamaConfig / Qwen2Config / Gemma3TextConfig use. Both spellings
of RoPE settings are written: `rope_parameters` (transformers 5) and the flat `rope_theta` /
`rope_local_base_freq` that transformers 4, vLLM and our own runtime also read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import UnsupportedGGUFError

# GGUF `general.architecture` -> (model_type, class name in transformers)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

# Tokens that end a chat turn or a document; generation stops on any the vocabulary has.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end_of_text|>")

# llama.cpp hard-codes these for Gemma 3 rather than storing them (src/llama-model.cpp): every
# sixth layer is global, and the sliding-window layers use RoPE base 10k.
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0


def _clean_float(value: float) -> float:
    """GGUF stores float32: 1e-5 comes back as 9.999999747378752e-06. Keep the value it meant."""
    return float(str(np.float32(value)))


def build_config(path: Path, meta: dict, tensor_shapes: dict[str, tuple[int, ...]], tokens: list[str] | None) -> dict:
    """`tensor_shapes` maps GGUF tensor names to their (out, in) shapes."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedGGUFError(
            path, f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    model_type, class_name = ARCHITECTURES[arch]

    def key(name: str, default=None):
        return meta.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedGGUFError(path, "per-layer KV head counts are not supported")
    head_dim = int(key("attention.key_length") or hidden // heads)
    rotary = key("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise UnsupportedGGUFError(path, f"partial rotary embeddings ({rotary} of {head_dim}) are not supported")
    num_layers = int(key("block_count"))
    theta = _clean_float(key("rope.freq_base", 10_000.0))
    # The embedding matrix is the truth about the vocabulary; `vocab_size` metadata is optional.
    vocab = tensor_shapes["token_embd.weight"][0]

    config = {
        "architectures": [class_name],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": _clean_float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "rope_theta": theta,
        "rope_parameters": _rope(path, key, theta),
        # llama.cpp writes `output.weight` only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        **_token_ids(meta, tokens),
    }
    if model_type == "llama":
        config.update(hidden_act="silu", mlp_bias=False)
    elif model_type == "qwen2":
        # Qwen2 always has q/k/v biases; the config has no switch for it.
        del config["attention_bias"]
        config.update(hidden_act="silu", use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    else:
        config.update(_gemma3(key, num_layers, head_dim, theta, config["rope_parameters"]))
    return config


def _rope(path: Path, key, theta: float) -> dict:
    scaling = key("rope.scaling.type")
    if scaling in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(key("rope.scaling.factor"))}
    raise UnsupportedGGUFError(path, f"RoPE scaling {scaling!r} is not supported")


def _gemma3(key, num_layers: int, head_dim: int, theta: float, global_rope: dict) -> dict:
    window = key("attention.sliding_window")
    layer_types = [
        "sliding_attention" if (i + 1) % _GEMMA3_SWA_PATTERN else "full_attention" for i in range(num_layers)
    ]
    local = {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp scales queries by 1/sqrt(head_dim) for every size but 27B (which it
        # special-cases to hidden/heads); the registry has no 27B.
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(window) if window is not None else None,
        "sliding_window_pattern": _GEMMA3_SWA_PATTERN,
        "layer_types": layer_types,
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
        "rope_parameters": {"full_attention": global_rope, "sliding_attention": local},
        "final_logit_softcapping": _optional_float(key("final_logit_softcapping")),
        "attn_logit_softcapping": _optional_float(key("attn_logit_softcapping")),
        "use_bidirectional_attention": False,
    }


def _optional_float(value) -> float | None:
    return None if value is None else _clean_float(value)


def _token_ids(meta: dict, tokens: list[str] | None) -> dict:
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    stops = [] if eos is None else [int(eos)]
    if tokens:
        index = {t: i for i, t in enumerate(tokens) if t in _STOP_TOKENS}
        stops += [index[t] for t in _STOP_TOKENS if t in index and index[t] not in stops]
    return {
        "bos_token_id": None if bos is None else int(bos),
        # A list when the chat format ends turns with a token other than the GGUF's eos.
        "eos_token_id": stops[0] if len(stops) == 1 else (stops or None),
        "pad_token_id": None if pad is None else int(pad),
    }
