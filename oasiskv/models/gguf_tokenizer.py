"""The tokenizer files of a converted model, built from a GGUF's tokenizer metadata.

transformers knows how to turn llama.cpp's vocabulary/merges/token types into a `tokenizers`
pipeline (byte-level BPE for SmolLM2/Qwen, sentencepiece-style BPE with byte fallback for Gemma);
we let it, and keep only what it produces: `tokenizer.json`, plus a `tokenizer_config.json` we
write ourselves so that the chat template and the BOS rule travel with it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import normalizers

from .chat_templates import FALLBACK_CHAT_TEMPLATES
from .errors import UnsupportedGGUFError

# Qwen2's own tokenizer NFC-normalizes its input (Qwen2Tokenizer, and the normalizer of the
# model's tokenizer.json); transformers' GGUF reader leaves it out. Without it "e" + U+0301 was two
# tokens here and one in vLLM, which loads the converted directory as a Qwen2Tokenizer.
_NFC_ARCHITECTURES = {"qwen2"}


def export_tokenizer(gguf_file: Path, out_dir: Path, metadata: dict) -> dict:
    """Write tokenizer.json + tokenizer_config.json into `out_dir`; return the config written."""
    import transformers
    from transformers import AutoTokenizer

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # it warns about every GGUF key it does not use
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as exc:  # whatever transformers raises for a vocabulary it cannot build
        raise UnsupportedGGUFError(gguf_file, f"tokenizer conversion failed ({type(exc).__name__}: {exc})") from exc
    finally:
        transformers.logging.set_verbosity(verbosity)

    arch = metadata.get("general.architecture")
    if arch in _NFC_ARCHITECTURES and tok.backend_tokenizer.normalizer is None:
        tok.backend_tokenizer.normalizer = normalizers.NFC()
    tok.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    template = metadata.get("tokenizer.chat_template") or tok.chat_template or FALLBACK_CHAT_TEMPLATES.get(arch)
    probe = tok("x").input_ids  # whatever tokenizer.json's post-processor does is the truth
    config = {
        # The generic fast class: every transformers version (and vLLM) loads tokenizer.json as is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "unk_token": tok.unk_token,
        "pad_token": tok.pad_token,
        "add_bos_token": bool(tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id]),
        "add_eos_token": bool(tok.eos_token_id is not None and probe[-1:] == [tok.eos_token_id]),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get(f"{arch}.context_length", 4096)),
        "chat_template": template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    specials = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config[k]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")
    return config
