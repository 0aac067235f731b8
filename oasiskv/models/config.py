"""The architecture facts the runtime needs, read from a Hugging Face `config.json`.

One flat dataclass covers Llama, Qwen2 and Gemma3: their differences are a handful of
switches (QKV bias, QK-norm, norm offset, embedding scale, per-layer sliding windows), so the
architecture files stay small and the engine never branches on the model name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CorruptModelError, ModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "gemma3_text")


class UnsupportedModelError(ModelError, ValueError):
    """The checkpoint's architecture is not one the runtime implements."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # One entry per layer: RoPE base and sliding window (None = global attention).
    rope_theta: tuple[float, ...]
    sliding_window: tuple[int | None, ...]
    rope_scaling_factor: tuple[float, ...] = ()
    qkv_bias: bool = False
    qk_norm: bool = False
    # Gemma stores RMSNorm weights as an offset from 1 and scales embeddings by sqrt(hidden).
    norm_weight_offset: float = 0.0
    embedding_scale: float = 1.0
    sandwich_norms: bool = False  # Gemma3's extra post-attention / pre- and post-MLP norms
    hidden_act: str = "silu"
    attention_scale: float = 0.0  # 0 means head_dim ** -0.5
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    add_bos_token: bool = False

    @property
    def kv_group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type == "gemma3":  # multimodal wrapper: the text part is what we run
            raw = {**raw, **raw.get("text_config", {}), "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_layers = int(raw["num_hidden_layers"])
        num_heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // num_heads)
        rope_theta, windows, scaling = _per_layer_rope_and_windows(raw, model_type, num_layers)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        gemma = model_type == "gemma3_text"
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            rope_theta=rope_theta,
            sliding_window=windows,
            rope_scaling_factor=scaling,
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=gemma,
            norm_weight_offset=1.0 if gemma else 0.0,
            embedding_scale=float(raw["hidden_size"]) ** 0.5 if gemma else 1.0,
            sandwich_norms=gemma,
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            attention_scale=float(raw["query_pre_attn_scalar"]) ** -0.5 if gemma else 0.0,
            final_logit_softcap=raw.get("final_logit_softcapping"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            add_bos_token=gemma,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Every problem with the file is named with it: a garbled or unsupported config.json was
        a traceback from json, or a KeyError, inside whatever loaded the model first."""
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise CorruptModelError(path, f"not a readable JSON file ({error})") from None
        if not isinstance(raw, dict):
            raise CorruptModelError(path, f"expected a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_dict(raw)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(f"{path}: {error}") from None
        except KeyError as error:
            raise CorruptModelError(path, f"missing field {error}") from None
        except (AttributeError, TypeError, ValueError) as error:  # a field of the wrong shape
            raise CorruptModelError(path, str(error)) from None


def _rope_params(raw: dict, layer_type: str | None, top_level_scaling: bool = True) -> dict:
    """transformers 5 nests RoPE settings under rope_parameters (per layer type for Gemma3);
    older configs keep rope_theta / rope_scaling at the top level. `top_level_scaling`: whether
    a top-level rope_scaling applies to this layer (Gemma 3's applies to its global layers only,
    as transformers reads it)."""
    params = raw.get("rope_parameters") or {}
    if layer_type and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    merged = dict(raw.get("rope_scaling") or {}) if top_level_scaling else {}
    merged.update({k: v for k, v in params.items() if not isinstance(v, dict)})
    return merged


def _per_layer_rope_and_windows(raw: dict, model_type: str, num_layers: int):
    if model_type != "gemma3_text":
        params = _rope_params(raw, None)
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        _check_rope_type(params)
        return (theta,) * num_layers, _qwen2_windows(raw, num_layers), (_linear_factor(params),) * num_layers
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % int(raw.get("sliding_window_pattern", 6)) else "full_attention"
        for i in range(num_layers)
    ]
    thetas, windows, scalings = [], [], []
    for layer_type in layer_types:
        sliding = layer_type == "sliding_attention"
        params = _rope_params(raw, layer_type, top_level_scaling=not sliding)
        _check_rope_type(params)
        default_theta = raw.get("rope_local_base_freq", 10000.0) if sliding else raw.get("rope_theta", 1e6)
        thetas.append(float(params.get("rope_theta", default_theta)))
        windows.append(int(raw["sliding_window"]) if sliding else None)
        scalings.append(_linear_factor(params))
    return tuple(thetas), tuple(windows), tuple(scalings)


def _qwen2_windows(raw: dict, num_layers: int) -> tuple:
    """Qwen2's use_sliding_window slides the layers from max_window_layers on (or those its
    layer_types name), as transformers reads it; the others attend globally."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if window is None:
        return (None,) * num_layers
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if i >= int(raw.get("max_window_layers", 28)) else "full_attention"
        for i in range(num_layers)]
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


def _check_rope_type(params: dict) -> None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported (default and linear are)")


def _linear_factor(params: dict) -> float:
    if params.get("rope_type", params.get("type")) == "linear":
        return float(params.get("factor", 1.0))
    return 1.0
