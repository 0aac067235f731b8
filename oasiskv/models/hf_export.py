"""Writing a converted GGUF as a Hugging Face model directory.

The directory is what transformers, vLLM and our own runtime all load: config.json,
model.safetensors (bf16 by default), tokenizer.json, tokenizer_config.json,
generation_config.json, plus `oasiskv_source.json` saying where it came from.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .gguf_convert import load_gguf
from .gguf_tokenizer import export_tokenizer
from .model_cache import CONVERSION_VERSION, SOURCE_FILE, atomic_dir

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def export_hf_dir(
    gguf_file: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    source: dict | None = None,
    progress: bool = True,
) -> Path:
    """Convert `gguf_file` into `out_dir`, which appears only once complete."""
    checkpoint = load_gguf(gguf_file, dtype=dtype, progress=progress)
    config, state = checkpoint.config, checkpoint.state
    with atomic_dir(out_dir) as tmp:
        tok_config = export_tokenizer(gguf_file, tmp, checkpoint.metadata)
        config["dtype"] = _DTYPE_NAMES[dtype]
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(
            tmp / SOURCE_FILE,
            {
                "conversion_version": CONVERSION_VERSION,
                "gguf": str(gguf_file),
                "dtype": config["dtype"],
                "add_bos_token": tok_config["add_bos_token"],
                **(source or {}),
            },
        )
    return out_dir


def _generation_config(config: dict) -> dict:
    return {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
        "pad_token_id": config.get("pad_token_id"),
    }


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
