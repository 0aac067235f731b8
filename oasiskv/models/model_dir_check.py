"""A local Hugging Face model directory checked before anything loads it: a garbled config or a
truncated weights file surfaced as a traceback from the first library that read it (json,
safetensors), or inside a Ray worker that then failed to start. The checks read headers only; the
tokenizer, whose parse is as costly as loading it, is checked where it is loaded
(`tokenizer.load_tokenizer`)."""

from __future__ import annotations

import json
from pathlib import Path

from .config import ModelConfig
from .errors import CorruptModelError, ModelError


def check_model_dir(model_dir: Path) -> None:
    """Raises a ModelError naming the file that cannot be read as what it should be."""
    config_file = model_dir / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CorruptModelError(config_file, f"not a readable JSON file ({error})") from None
    if not isinstance(raw, dict):
        raise CorruptModelError(config_file, f"expected a JSON object, got {type(raw).__name__}")
    try:
        ModelConfig.from_dict(raw)
    except KeyError as error:
        raise ModelError(f"{config_file}: missing field {error}") from None
    except (AttributeError, TypeError, ValueError) as error:  # UnsupportedModelError is a ValueError
        raise ModelError(f"{config_file}: {error}") from None
    from safetensors import safe_open

    for weights in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # safetensors raises its own error types, and OSError
            raise CorruptModelError(weights, f"not a readable safetensors file ({error})") from None
