"""The tokenizer of a model directory: `tokenizer.json` plus the chat template, nothing heavier.

`tokenizers` does the encoding; the chat template is rendered with jinja2 the way transformers
renders it (sandboxed, trim_blocks/lstrip_blocks, `raise_exception`, a `tojson` that keeps
non-ASCII), so a prompt built here is the prompt transformers or vLLM would build.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from .chat_templates import developer_as_system
from .errors import CorruptModelError


class ChatTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict, eos_token_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.pad_token: str | None = _token_text(config.get("pad_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)
        stops = list(eos_token_ids) or ([self.eos_token_id] if self.eos_token_id is not None else [])
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens` applies tokenizer.json's post-processor: Gemma's `<bos>`; nothing for Qwen/SmolLM2.
        Through `encode_batch`, which lets go of the GIL while it works (`encode` holds it: an API
        server tokenizing a 6 MB prompt on a thread still stopped its event loop for 8 s); the
        same ids, at the same cost."""
        require_unicode(text)  # tokenizers raised a bare TypeError
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        continue_final_message: bool = False,
        **template_vars,
    ) -> str | list[int]:
        """Token ids by default, like transformers: encoding the returned text again with
        `encode()` would add a second BOS for Gemma, whose template writes `<bos>` itself.
        `continue_final_message` ends the prompt inside the last message (a reply the model goes on
        with), where transformers ends it: at a marker written after the message's text."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if continue_final_message:
            final = messages[-1]
            messages = [*messages[:-1], {**final, "content": (final.get("content") or "") + _FINAL_MARK}]
        rendered_messages = developer_as_system(messages, self.chat_template)
        if continue_final_message and _FINAL_MARK.strip() not in (rendered_messages[-1].get("content") or ""):
            raise ValueError("continue_final_message cannot continue a developer message: this template has no "
                             "developer role, and it is merged into the system prompt at the start")
        text = self._template.render(
            messages=rendered_messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **template_vars,
        )
        if continue_final_message:
            text = _up_to_final_message(text)
        # The template writes any BOS itself; encoding must not add a second one.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _template(self):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


# Written after the final message's text when its turn is left open; the space at its end tells
# whether the template trims messages (Llama 3's does), and then the text before it is trimmed too.
_FINAL_MARK = "<|oasiskv-final-message|> "


def _up_to_final_message(rendered: str) -> str:
    """The rendered chat cut where the final message's text ends, so the turn is left open (its
    text may also be a piece of the template's own closing tag, so the text itself is no guide)."""
    mark = _FINAL_MARK.strip()
    if mark not in rendered:
        raise ValueError("continue_final_message: the chat template did not write the final message's text as given")
    at = rendered.rindex(mark)
    return rendered[:at] if rendered.startswith(_FINAL_MARK, at) else rendered[:at].rstrip()


def require_unicode(text: str) -> None:
    """ValueError naming the first character no tokenizer can encode: a lone UTF-16 surrogate,
    as JSON may carry (\\ud800) and a command line makes of bytes that are not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: {text[exc.start]!r} at character {exc.start} (a lone "
                         "surrogate, or bytes that are not UTF-8)") from None


def load_tokenizer(model_dir: str | Path) -> ChatTokenizer:
    model_dir = Path(model_dir)
    try:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        raise CorruptModelError(model_dir / "tokenizer.json", f"not a readable tokenizer ({error})") from None
    config = _read_json(model_dir / "tokenizer_config.json")
    if not config.get("chat_template") and (model_dir / "chat_template.jinja").is_file():
        config["chat_template"] = (model_dir / "chat_template.jinja").read_text()  # transformers 5 layout
    eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    if eos is None:
        eos = _read_json(model_dir / "config.json").get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return ChatTokenizer(tokenizer, config, eos_ids)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)
