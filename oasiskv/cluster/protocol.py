"""OpenAI-compatible request and response bodies (the subset OasisKV serves), plus extensions."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..models.sampling import MAX_LOGPROBS, SEED_MAX, SEED_MIN
from ..models.structured_output import check_spec
from ..models.tokenizer import require_unicode
from .tool_calls import ToolChoice, check_tools, normalized_tools, resolve_tool_choice, tool_spec

Mode = Literal["dense", "sparse-current", "lookahead"]
# Choices (n) per prompt, and in all (prompts x n) per request: each choice is a request to the
# cluster of its own, prefilled and decoded apart.
MAX_CHOICES = 16
MAX_CHOICES_PER_REQUEST = 64


class UnsupportedFeature(ValueError):
    """A valid OpenAI field whose non-default value this server does not implement."""


def _encodable(value):
    """JSON may carry a lone UTF-16 surrogate (\\ud800), which no tokenizer can encode: refuse it
    here, by field, instead of failing inside the tokenizer."""
    texts = [value] if isinstance(value, str) else [v for v in value or () if isinstance(v, str)]
    for text in texts:
        require_unicode(text)
    return value


def _require_integers(ids, what: str) -> None:
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool):
            raise ValueError(f"{what} must be JSON integers, got {token!r}")


def _integer_ids(field: str):
    """A field's validator: JSON's true, 1.0 or "1" in a list of token ids is a client's bug, not
    token 1 (pydantic would read it so)."""
    def check(value):
        if isinstance(value, list):
            _require_integers(value, field)
        return value
    return field_validator(field, mode="before")(check)


_UNSUPPORTED_VLLM_FIELDS = ("use_beam_search", "length_penalty")

# vLLM's older names for structured_outputs' kinds (before 0.11), still sent by older clients.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# structured_outputs' options besides its kinds: refused when set (output that ignored them would
# not be what was asked).
_STRUCTURED_OPTIONS = {"disable_any_whitespace": False, "disable_additional_properties": False,
                       "whitespace_pattern": None, "structural_tag": None}


class _Lenient(BaseModel):
    # Unknown fields are kept aside, not refused (OpenAI clients send fields of newer API
    # versions), and the API logs them: a misspelt `max_token` was dropped without a trace.
    model_config = ConfigDict(extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    model: str | None = None  # None: the model served

    def check_supported(self) -> None:
        """Raises UnsupportedFeature for a valid field this server does not implement."""


class _SamplingFields(_Lenient):
    max_tokens: int | None = Field(None, ge=1)
    # null is the default for the fields OpenAI marks nullable, as vLLM takes it (`_null_is_default`):
    # the openai client sends temperature=None as null, which was a 422.
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(0, ge=-1, description="extension: 0 or -1 disables")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool | None = False
    n: int | None = 1
    presence_penalty: float | None = 0.0  # null: the default, as OpenAI and vLLM take it
    frequency_penalty: float | None = 0.0
    logprobs: bool | int | None = None
    user: str | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = Field(None, description="extension (as vLLM's): token ids that end the output")
    stream_options: dict | None = None
    # {token id: bias}; its ids and ranges are checked by SamplingParams and the vocabulary (400s).
    logit_bias: dict | None = None
    # vLLM's extensions, as vLLM does them (ranges checked by SamplingParams, as vLLM's are: 400).
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    repetition_penalty: float | None = 1.0
    min_tokens: int | None = 0
    min_p: float | None = 0.0
    # vLLM's: keep only the prompt's last k tokens (-1: max_model_len's worth), e.g. a long
    # document's end, where the question is. Checked against max_model_len by the API.
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: ids and range checked by SamplingParams and the API
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain (tokenized by the API)
    # vLLM's: the logprobs of the prompt's tokens, each with its rank and this many alternatives.
    prompt_logprobs: int | None = None
    # vLLM's extensions that are not implemented: refused unless left at these values, since a
    # request that sets one expects it to take effect (they were ignored, and the output differed).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's structured output: {"json": schema}, {"json_object": true}, {"regex": ...},
    # {"choice": [...]} or {"grammar": EBNF}; guided_* are its older names, and OpenAI's
    # response_format (json_object, json_schema) overrides it, as in vLLM.
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict | None = None
    # OasisKV extensions: how this request is decoded.
    oasiskv_mode: Mode | None = None
    oasiskv_budget_tokens: int | None = Field(None, ge=16)

    @field_validator("temperature", "top_p", "top_k", "stream", "n", "ignore_eos", "include_stop_str_in_output",
                     "skip_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                     "min_p", mode="after")
    @classmethod
    def _null_is_default(cls, value, info):
        return cls.model_fields[info.field_name].default if value is None else value

    def check_supported(self) -> None:
        super().check_supported()
        if not 1 <= self.n <= MAX_CHOICES:
            raise UnsupportedFeature(f"n must be in [1, {MAX_CHOICES}], got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFeature("stream_options is only allowed with stream: true")
        if self.prompt_logprobs and self.stream:  # as vLLM: a stream has no place for them (0 asks for none)
            raise UnsupportedFeature("prompt_logprobs are not available with stream: true")
        for name in _UNSUPPORTED_VLLM_FIELDS:
            if getattr(self, name) not in (type(self).model_fields[name].default, [], {}):
                raise UnsupportedFeature(f"{name} is not supported")
        for name, default in _STRUCTURED_OPTIONS.items():
            if (self.structured_outputs or {}).get(name, default) != default:
                raise UnsupportedFeature(f"structured_outputs {name} is not supported")
        kind = (self.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise UnsupportedFeature(f"response_format {kind!r} is not supported (text, json_object or json_schema)")

    def structured_outputs_requested(self) -> dict | None:
        """The structured output asked for, as one spec (`SamplingParams.structured_outputs`, which
        checks it): structured_outputs or the guided_* fields, with response_format's kind over
        them, as vLLM merges them. None: free text."""
        spec = {key: value for key, value in (self.structured_outputs or {}).items()
                if key not in _STRUCTURED_OPTIONS}
        for name, kind in _GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                spec[kind] = getattr(self, name)
        response_format = self.response_format or {}
        if response_format.get("type") == "json_object":
            spec["json_object"] = True
        elif response_format.get("type") == "json_schema":
            described = response_format.get("json_schema")
            if not isinstance(described, dict) or not isinstance(described.get("schema"), dict):
                raise ValueError("response_format json_schema must be an object with the schema under 'schema', "
                                 f"got {described!r}")
            if not isinstance(described.get("name"), str) or not described["name"]:  # OpenAI's and vLLM's rule
                raise ValueError("response_format json_schema needs a 'name'")
            spec["json"] = described["schema"]
        if not spec:
            if self.structured_outputs is not None:  # as vLLM: options alone, or {}, ask for nothing
                check_spec(spec, "structured_outputs", parse=False)
            return None
        return check_spec(spec, self.structured_outputs_field(), parse=False)  # parsed by the API off its loop

    def structured_outputs_field(self) -> str:
        """The field the client asked for structured output with, which a refusal names."""
        if (self.response_format or {}).get("type") in ("json_object", "json_schema"):
            return "response_format"
        return next((name for name in _GUIDED_FIELDS if getattr(self, name) is not None), "structured_outputs")

    _stop_text = field_validator("stop")(_encodable)
    _bad_words_text = field_validator("bad_words")(_encodable)

    _allowed_ids = _integer_ids("allowed_token_ids")

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _prompt_logprobs_is_a_count(cls, value):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):  # true is not 1
            raise ValueError(f"prompt_logprobs must be an integer, got {value!r}")
        return value

    def prompt_logprobs_requested(self) -> int | None:
        """How many alternatives each prompt token's logprobs list; None: none (SamplingParams
        checks the range). A stream shows none: vLLM takes 0 there, and shows nothing."""
        return None if self.stream else self.prompt_logprobs

    @field_validator("truncate_prompt_tokens", mode="before")
    @classmethod
    def _truncation_is_a_count(cls, value):
        # JSON's true is not 1 token, nor 2.0 two; 0 would serve an empty prompt.
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not (value >= 1 or value == -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {value!r}")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk, as vLLM's stream_options.continuous_usage_stats (with include_usage)."""
        return self.include_usage and bool((self.stream_options or {}).get("continuous_usage_stats"))


def _token_ids_are_integers(value):
    """JSON's true, 1.0 or "1" among token ids is a client's bug, not token 1: named here, where
    the union's first error would say that the prompt should be a string."""
    if isinstance(value, list) and not all(isinstance(item, str) for item in value):
        for ids in value if all(isinstance(item, list) for item in value) else [value]:
            _require_integers(ids, "prompt token ids")
    return value


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]  # ids checked by _token_ids_are_integers
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt alone (a prompt's score)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    _prompt_text = field_validator("prompt")(_encodable)
    _prompt_ids = field_validator("prompt", mode="before")(_token_ids_are_integers)

    def logprobs_requested(self) -> int | None:
        """How many alternatives each token's logprobs list; None: no logprobs (SamplingParams
        checks the range)."""
        if self.logprobs is None or self.logprobs is False:
            return None
        return int(self.logprobs)

    @property
    def echo_only(self) -> bool:
        """vLLM's echo with max_tokens 0: the prompt alone (and its logprobs), as a client that
        scores texts asks; one token is made and not shown."""
        return bool(self.echo) and self.max_tokens == 0

    def prompt_logprobs_requested(self) -> int | None:
        """An echoed prompt's tokens get logprobs as the output's do (vLLM's echo with logprobs):
        as many alternatives as either field asks, each cut to its own when shown."""
        echoed = self.logprobs_requested() if self.echo else None
        shown = super().prompt_logprobs_requested()
        if echoed is None or shown is None:
            return shown if echoed is None else echoed
        return max(echoed, shown)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or several (strings or token id lists), as vLLM reads the field."""
        prompt = self.prompt
        several = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        return list(prompt) if several else [prompt]

    def check_supported(self) -> None:
        super().check_supported()
        prompts = len(self.prompts())
        if prompts * self.n > MAX_CHOICES_PER_REQUEST:
            raise UnsupportedFeature(f"{prompts} prompts x n {self.n} is over {MAX_CHOICES_PER_REQUEST} choices a "
                                     "request; send them in several requests")
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedFeature("max_tokens must be at least 1 (0 only with echo: the prompt alone)")
        if self.best_of not in (None, 1):
            raise UnsupportedFeature("best_of is not supported")
        if self.suffix:
            raise UnsupportedFeature("suffix is not supported")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    # An assistant's calls ([{"id", "type": "function", "function": {"name", "arguments"}}]) and a
    # tool's answer to one (its tool_call_id), which the chat template writes into the prompt.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _flatten(cls, value):
        """Content parts: only text parts are accepted; they are joined by newlines, as vLLM
        joins them (joined by nothing, the prompt differed from vLLM's)."""
        if isinstance(value, list):
            texts = []
            for part in value:
                if part.get("type") != "text":
                    raise ValueError(f"content part type {part.get('type')!r} is not supported (text only)")
                texts.append(part.get("text", ""))
            value = "\n".join(texts)
        return _encodable(value)

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, value):
        # Arguments that are not a JSON object's text are given to the template as {} (tool_calls.py).
        for j, call in enumerate(value or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if (not isinstance(function, dict) or call.get("type", "function") != "function"
                    or not isinstance(function.get("name"), str)):
                raise ValueError(f"tool_calls[{j}] must be {{'id': ..., 'type': 'function', 'function': "
                                 f"{{'name': ..., 'arguments': JSON text}}}}, got {call!r}")
        return value

    @model_validator(mode="after")
    def _has_content(self):
        # OpenAI allows null content only beside an assistant's tool_calls; a chat template
        # would otherwise fail on the missing key with a Jinja message.
        if self.role != "assistant":
            self.tool_calls = None  # as vLLM: only an assistant's are read
        if self.content is None:
            if self.tool_calls is None:
                raise ValueError(f"a {self.role!r} message needs content")
            self.content = ""  # as vLLM gives it to the template
        return self


class _ChatTemplate:
    """How a request's chat-template fields (vLLM's: `add_generation_prompt`,
    `continue_final_message`, `chat_template_kwargs`, `chat_template`; and `tools`) are checked and
    passed to the template; each request declares the fields in its own order, which is the
    order its validation errors are found in."""

    def check_template_fields(self) -> None:
        if self.chat_template is not None:  # vLLM too refuses it unless told to trust request templates
            raise UnsupportedFeature("chat_template is not supported: the model's own template is used")
        if self.continue_final_message and self.add_generation_prompt:
            raise UnsupportedFeature("continue_final_message needs add_generation_prompt: false (the reply goes "
                                     "on inside the final message, not in a new one)")
        reserved = set(self.chat_template_kwargs or {}) & {"messages", "add_generation_prompt", "tools", "tokenize",
                                                        "bos_token", "eos_token", "pad_token",
                                                        "continue_final_message", "self"}
        if reserved:
            raise UnsupportedFeature(f"chat_template_kwargs may not set {sorted(reserved)}: they are the request's own fields")
        if self.tools is not None:
            try:
                check_tools(self.tools)
            except ValueError as exc:
                raise UnsupportedFeature(str(exc)) from None

    def template_variables(self) -> dict:
        """Tools are described to the model (Qwen's template writes them out) even where they are
        declined, as vLLM renders them."""
        variables = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                     "continue_final_message": self.continue_final_message}
        if self.tools:
            variables["tools"] = normalized_tools(self.tools)
        return variables


class ChatCompletionRequest(_SamplingFields, _ChatTemplate):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Function tools, written into the prompt by the chat template; see tool_calls.py.
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None
    logprobs: bool | None = None  # chat's is a boolean (completions' a count): 3 is refused, as in vLLM
    # vLLM's chat-template extensions; they were logged as ignored, so the prompt was not the one asked for.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # refused: see check_template_fields
    # vLLM's: the reply starts with the last message's content when that message is the assistant's.
    echo: bool | None = False

    def logprobs_requested(self) -> int | None:
        """How many alternatives each token's logprobs list; None: no logprobs."""
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0

    def check_supported(self) -> None:
        super().check_supported()
        self.check_template_fields()  # the tools among them
        try:
            named = self.tool_choice_resolved().mode == "named"
        except ValueError as exc:
            raise UnsupportedFeature(str(exc)) from None
        constrained = [kind for kind in ("json", "regex", "choice") if (self.structured_outputs or {}).get(kind) is not None
                       or getattr(self, f"guided_{kind}") is not None]
        if named and constrained:  # as vLLM: the call's arguments are the constraint
            raise UnsupportedFeature(f"tool_choice naming a function and structured output ({constrained[0]}) "
                                     "cannot both be given: use one or the other")

    def tool_choice_resolved(self) -> ToolChoice:
        return resolve_tool_choice(self.tools, self.tool_choice)

    def structured_outputs_requested(self) -> dict | None:
        """A required or named tool call limits the reply to calls, over any other structured
        output asked for (as vLLM)."""
        return tool_spec(self.tool_choice_resolved(), self.tools or [], self.parallel_tool_calls) \
            or super().structured_outputs_requested()

    def structured_outputs_field(self) -> str:
        return "tools" if self.tool_choice_resolved().mode in ("required", "named") else super().structured_outputs_field()

    def echoed(self) -> str:
        """What the reply starts with under `echo`: the last message's content when that message
        is the assistant's (a reply being continued), else nothing, as vLLM does it."""
        last = self.messages[-1]
        return last.content if self.echo and last.role == "assistant" and last.content else ""


class TokenizeRequest(_Lenient, _ChatTemplate):
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template as the chat endpoint
    renders them, so a client can size a long prompt against max_model_len before sending it."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None
    # None: True for a prompt, False for messages (the template writes any BOS), as vLLM's defaults.
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False

    _prompt_text = field_validator("prompt")(_encodable)

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self

    def check_supported(self) -> None:
        super().check_supported()
        if self.messages is not None:  # a prompt's request has no template to render
            self.check_template_fields()


class DetokenizeRequest(_Lenient):
    tokens: list[int]

    _token_ids = _integer_ids("tokens")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
