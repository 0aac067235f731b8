"""Build a model from a Hugging Face-style directory (config.json + *.safetensors) or a GGUF file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .transformer import DecoderModel

ARCHITECTURES: dict[str, type[DecoderModel]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> DecoderModel:
    with torch.device("meta"):
        model = ARCHITECTURES[config.model_type](config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:  # to_empty breaks the tie; restore it before loading
        model.lm_head.weight = model.embed_tokens.weight
    model.load_hf_state_dict(state)
    for rope in model._ropes.values():
        rope.inv_freq = rope.inv_freq.to(device)
    return model.eval()


def load_model_dir(
    model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> DecoderModel:
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                state[name] = handle.get_tensor(name)
    return build_model(config, state, dtype, device)


def load_model_gguf(
    gguf_file: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> DecoderModel:
    """Straight from the quantized file, dequantized in fp32: the exact weights the reference sees."""
    from .gguf_convert import read_gguf

    raw_config, state = read_gguf(gguf_file, dtype=torch.float32)
    return build_model(ModelConfig.from_dict(raw_config), state, dtype, device)


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())
