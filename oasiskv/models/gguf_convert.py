"""GGUF -> (Hugging Face config dict, state dict with transformers' parameter names).

Reads with `gguf.GGUFReader` and unpacks with `gguf.quants.dequantize`, then undoes the two
layout changes llama.cpp's converter makes on the way in: Llama q/k rows reordered for GGML's
RoPE, and Gemma's RMSNorm weights stored as 1 + w.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .errors import CorruptModelError, UnsupportedGGUFError
from .gguf_check import verify_gguf
from .gguf_config import build_config

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_COMMON = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = {
    "llama": {**_BLOCK_COMMON, "ffn_norm": "post_attention_layernorm"},
    "qwen2": {**_BLOCK_COMMON, "ffn_norm": "post_attention_layernorm"},
    # Gemma 3 has four norms per block; llama.cpp's `ffn_norm` is the one *before* the MLP.
    "gemma3": {
        **_BLOCK_COMMON,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(arch: str, gguf_name: str) -> str | None:
    """transformers' parameter name for a GGUF tensor name; None if there is none."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{suffix}"
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match and match[2] in _BLOCK[arch]:
        return f"model.layers.{match[1]}.{_BLOCK[arch][match[2]]}.{match[3]}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order.

    GGML's RoPE rotates adjacent pairs (0,1),(2,3)...; transformers rotates the two halves of a head
    against each other (i, i + d/2). The converter therefore stores each head's rows interleaved
    from the two halves; here row 2j+h of a head goes back to row h*(d/2)+j.
    """
    head_dim = weight.shape[0] // n_heads
    grouped = weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def open_reader(path: Path):
    """A GGUFReader over a file that has passed the structural check; any failure is CorruptModelError."""
    from gguf import GGUFReader

    verify_gguf(path)
    try:
        return GGUFReader(path)
    except Exception as exc:  # numpy reshape/index errors from a malformed file
        raise CorruptModelError(path, f"unreadable GGUF ({type(exc).__name__}: {exc})") from exc


def gguf_metadata(reader, with_tokens: bool = False) -> tuple[dict, list[str] | None]:
    """Scalar and string metadata (arrays skipped, they can be 250k long), plus the vocabulary if asked."""
    from gguf import GGUFValueType

    meta, tokens = {}, None
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            if with_tokens and key == "tokenizer.ggml.tokens":
                tokens = field.contents()
            continue
        meta[key] = field.contents()
    return meta, tokens


@dataclass
class GGUFCheckpoint:
    config: dict  # Hugging Face config.json contents
    state: dict[str, torch.Tensor]  # transformers parameter names
    metadata: dict  # the file's scalar/string metadata, llama.cpp key names


def read_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = False
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Config dict and state dict of a GGUF checkpoint; weights dequantized to `dtype`."""
    checkpoint = load_gguf(path, dtype, progress)
    return checkpoint.config, checkpoint.state


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = False) -> GGUFCheckpoint:
    from gguf.quants import dequantize

    path = Path(path)
    reader = open_reader(path)
    meta, tokens = gguf_metadata(reader, with_tokens=True)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    config = build_config(path, meta, shapes, tokens)
    arch = meta["general.architecture"]

    state: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"dequantize {path.name}", unit="tensor", disable=not progress):
        name = hf_name(arch, tensor.name)
        if name is None:
            raise UnsupportedGGUFError(path, f"tensor {tensor.name!r} has no transformers counterpart for {arch}")
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise CorruptModelError(path, f"tensor {tensor.name!r} could not be dequantized ({exc})") from exc
        # GGUF lists dims fastest-first; reversed, they are torch's (out, in).
        array = np.ascontiguousarray(array.reshape(shapes[tensor.name]), dtype=np.float32)
        weight = torch.from_numpy(array if array.flags.writeable else array.copy())
        state[name] = _to_hf_layout(arch, tensor.name, weight, config).to(dtype).contiguous()

    _check_complete(path, config, state)
    return GGUFCheckpoint(config, state, meta)


def _to_hf_layout(arch: str, gguf_name: str, weight: torch.Tensor, config: dict) -> torch.Tensor:
    if arch == "llama" and ".attn_q." in gguf_name:
        return unpermute_rope_rows(weight, config["num_attention_heads"])
    if arch == "llama" and ".attn_k." in gguf_name:
        return unpermute_rope_rows(weight, config["num_key_value_heads"])
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return weight - 1.0  # Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w
    return weight


def expected_parameter_names(config: dict) -> set[str]:
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    if config["model_type"] == "qwen2":
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config["model_type"] == "gemma3_text":
        per_layer += [
            "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
        ]
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    names.update(f"model.layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in per_layer)
    return names


def _check_complete(path: Path, config: dict, state: dict) -> None:
    missing = sorted(expected_parameter_names(config) - state.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CorruptModelError(path, f"tensor count mismatch: missing {len(missing)} tensors ({shown})")
