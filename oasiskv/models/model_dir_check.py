"""A local Hugging Face model directory checked before anything loads it: a garbled config or a
truncated weights file surfaced as a traceback from the first library that read it (json,
safetensors), or inside a Ray worker that then failed to start. The checks read the config and
the weights' headers only; the tokenizer, whose parse is as costly as loading it, is checked where
it is loaded (`tokenizer.load_tokenizer`)."""

from __future__ import annotations

from pathlib import Path

from .config import ModelConfig
from .errors import CorruptModelError


def check_model_dir(model_dir: Path) -> None:
    """Raises a ModelError naming the file that cannot be read as what it should be."""
    ModelConfig.from_dir(model_dir)
    from safetensors import safe_open

    for weights in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # safetensors raises its own error types, and OSError
            raise CorruptModelError(weights, f"not a readable safetensors file ({error})") from None
