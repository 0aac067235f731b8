"""Structured output (vLLM's `structured_outputs`, OpenAI's `response_format`): the output follows
a JSON schema, any JSON object, a regular expression, one of several strings, or a grammar (EBNF
or Lark).

xgrammar (vLLM's default backend) compiles the spec against the model's vocabulary, and a matcher
per request limits each step's logits to the tokens that keep the output inside it.

A request's matcher follows its output (`GrammarState.sync`) rather than being told of each
token, so each engine (the single-process `LLM`, the prefill's first token, the decode node's
verification rows, a draft model's drafts) needs only the output it already keeps; where the
output goes back (a draft model's rejected drafts), so does the matcher. A speculative step's rows
are limited by accepting the drafts in turn and rolling them back. EOS and the request's
stop_token_ids are the matcher's stop tokens, as in vLLM: they may come only where the spec may
end.
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref

import numpy as np
import torch

# The kinds of spec, as vLLM's StructuredOutputsParams names them; a spec names exactly one.
SPEC_KINDS = ("json", "json_object", "regex", "choice", "grammar")

# vLLM's limit on how deep a JSON schema's objects and arrays may nest: parsing one costs about
# the cube of its depth (600 levels, a 17 KB body, took 10 s).
MAX_JSON_NESTING = 64

# The string formats xgrammar enforces (vLLM's list); another is ignored by it.
_ENFORCED_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}

# xgrammar's errors carry a time and a C++ source position ("[04:48:24] /project/cpp/x.cc:83: "),
# at their start and before each message they wrap.
_NATIVE_POSITION = re.compile(r"\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def check_spec(spec, field: str = "structured_outputs", parse: bool = True) -> dict:
    """`spec` as a dict naming exactly one kind: {"json": schema (a dict or its JSON text)},
    {"json_object": true}, {"regex": str}, {"choice": [str, ...]} or {"grammar": EBNF or Lark}. Raises
    ValueError naming what is wrong, its message beginning with `field` (the request field it came
    from). `parse`: parse it too (a schema, expression or grammar that does not parse is refused);
    parsing a large spec takes a while, which an API does off its event loop (`compile_spec`).
    A spec it returned is not checked again (a request's passes the API, its SamplingParams and
    each engine)."""
    try:
        checked = spec if isinstance(spec, CheckedSpec) else CheckedSpec(_checked(spec))
        if parse:
            _grammar(checked)
        return checked
    except ValueError as error:
        raise ValueError(f"{field} {error}") from None


class CheckedSpec(dict):
    """A spec as `check_spec` returns it: {kind: value}, its checks passed."""


def _checked(spec) -> dict:
    if not isinstance(spec, dict):
        raise ValueError(f"must be an object naming one of {', '.join(SPEC_KINDS)}, got {spec!r}")
    given = {key: value for key, value in spec.items() if value is not None}  # as vLLM: false names a kind too
    unknown = sorted(set(given) - set(SPEC_KINDS))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not supported (one of {', '.join(SPEC_KINDS)})")
    if len(given) != 1:
        raise ValueError(f"must name exactly one of {', '.join(SPEC_KINDS)}, got {sorted(given) or 'none'}")
    (kind, value), = given.items()
    if kind == "json" and not isinstance(value, (dict, str)):
        raise ValueError(f"json must be a JSON schema (an object or its text), got {value!r}")
    if kind == "json_object" and value is not True:
        raise ValueError(f"json_object must be true, got {value!r}")
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
    if kind in ("regex", "grammar") and "\0" in value:  # xgrammar's native parsers do not take it
        raise ValueError(f"{kind} contains a NUL character")
    if kind == "choice" and (not isinstance(value, list) or not value
                             or not all(isinstance(c, str) and c for c in value)):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {value!r}")
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except RecursionError:
                raise ValueError(f"json nests objects and arrays deeper than {MAX_JSON_NESTING} levels") from None
            except ValueError:
                schema = None  # not JSON: parsing says where
        if schema is not None:
            _require_shallow(schema)
            unsupported = _unsupported_json_feature(schema)
            if unsupported:
                raise ValueError(f"json uses {unsupported}, which is not enforced (xgrammar would ignore it)")
    return {kind: value}


def _require_shallow(schema) -> None:
    level = [schema]
    for _ in range(MAX_JSON_NESTING):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return
    raise ValueError(f"json nests objects and arrays deeper than {MAX_JSON_NESTING} levels")


def _unsupported_json_feature(schema) -> str | None:
    """The first constraint of `schema` that xgrammar 0.2.8 leaves unenforced (vLLM sends such
    schemas to another backend; output under them broke the schema: ["maybe"] for an enum in
    allOf, [1, 1] for uniqueItems). None: it enforces them all."""
    nodes = [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, list):
            nodes.extend(item for item in node if isinstance(item, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        types = node.get("type")
        types = {types} if isinstance(types, str) else {t for t in types if isinstance(t, str)} \
            if isinstance(types, list) else set()
        bounded = "minLength" in node or "maxLength" in node
        if types & {"integer", "number"} and "multipleOf" in node:
            return "multipleOf"
        if "array" in types:
            for key in ("uniqueItems", "contains", "minContains", "maxContains"):
                if key in node:
                    return key
        if "string" in types:
            if "format" in node and node["format"] not in _ENFORCED_FORMATS:
                return f"format {node['format']!r}"
            if ("pattern" in node or "format" in node) and bounded:
                return "a pattern or format with minLength or maxLength"
        if "object" in types:
            names = node.get("propertyNames")
            if names is not None:
                if isinstance(names, dict) and ("pattern" in names or "format" in names) \
                        and ("minLength" in names or "maxLength" in names):
                    return "propertyNames with a pattern or format and a length"
                for key in ("patternProperties", "properties"):
                    if key in node:
                        return f"propertyNames with {key}"
                if node.get("unevaluatedProperties", True) is not True:
                    return "propertyNames with unevaluatedProperties"
            patterns = node.get("patternProperties")
            if isinstance(patterns, dict) and ("properties" in node or len(patterns) > 1):
                return "patternProperties with properties, or more than one pattern"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) >= 2:
            return "allOf with more than one schema"
        nodes.extend(value for value in node.values() if isinstance(value, (dict, list)))
    return None


def _grammar(spec: dict):
    """The spec's xgrammar Grammar (tokenizer-free: parsing checks it)."""
    import xgrammar as xgr

    (kind, value), = spec.items()
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(value if isinstance(value, str) else json.dumps(value))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}')
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(value))
        return xgr.Grammar.from_lark(value) if _is_lark(value) else xgr.Grammar.from_ebnf(value)
    except RuntimeError as error:  # xgrammar raises RuntimeError for any spec it cannot parse
        raise ValueError(f"{kind} is not valid: {_native_message(error)}") from None


def _is_lark(grammar: str) -> bool:
    """A grammar with no EBNF rule ("name ::= ...") outside comments is read as Lark ("name: ..."),
    as vLLM tells them apart."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.splitlines())


def _native_message(error: RuntimeError) -> str:
    """xgrammar's message, its first line, without its times and C++ source positions."""
    text = str(error).strip()
    return _NATIVE_POSITION.sub("", text.splitlines()[0] if text else "")


def _choice_ebnf(choices: list[str]) -> str:
    """One of the strings exactly. EBNF's string literals take JSON's escapes."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


# How long the API lets a spec take to compile. Compiling is not bounded by the spec's size: a
# string's maxLength of 100,000 took 6 s against Qwen's vocabulary, and each worker compiles it
# again (on a thread, while its batch goes on).
COMPILE_LIMIT_S = 10.0
# What each compiler keeps of the grammars it compiled (xgrammar keeps them all by default).
_COMPILER_CACHE_BYTES = 256 * 2**20
# Threads a compile may use (vLLM's 8): one vocabulary pass split among them.
_COMPILE_THREADS = max(1, min(8, os.cpu_count() or 1))


def compile_spec(spec: dict, tokenizer, vocab_size: int, field: str = "structured_outputs") -> None:
    """Parse and compile `spec` against the vocabulary, as a worker will, and check that it
    allows a first token (the API runs it on a thread, under COMPILE_LIMIT_S). ValueError for a
    spec that does not parse or compile, or allows nothing, its message beginning with `field`."""
    state = GrammarState(spec, tokenizer, vocab_size, field=field)
    if not bool(state.next_token_bitmask([], [], 1).any()):
        raise ValueError(f"{field} {next(iter(spec))} allows no output at all")


class _Compilers:
    """One xgrammar compiler per (tokenizer, logits width): its vocabulary tables take a second
    to build for Qwen's 151,936 tokens, and it caches what it compiles."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, tokenizer, vocab_size: int):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        with self._lock:
            compilers = self._by_tokenizer.setdefault(tokenizer, {})
            if vocab_size not in compilers:
                info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer),
                                                          vocab_size=vocab_size,
                                                          stop_token_ids=list(tokenizer.eos_token_ids))
                compilers[vocab_size] = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS,
                                                            cache_limit_bytes=_COMPILER_CACHE_BYTES)
            return compilers[vocab_size]


_COMPILERS = _Compilers()


class GrammarState:
    """A request's matcher, following its output. `next_token_bitmask` gives, for each row of a
    step, the tokens the spec allows there."""

    def __init__(self, spec: dict, tokenizer, vocab_size: int, stop_token_ids=None, field: str = "structured_outputs"):
        """`stop_token_ids`: the tokens that end the request (EOS and its stop_token_ids, as vLLM
        gives its matcher): the spec lets one come only where the output may end. Default: the
        tokenizer's EOS. ValueError for a spec that does not parse or compile, its message
        beginning with `field`."""
        if tokenizer is None:
            raise ValueError(f"{field} need the model's tokenizer, and this engine was given none")
        spec = check_spec(spec, field, parse=False)
        try:
            compiled = _COMPILERS.get(tokenizer, vocab_size).compile_grammar(_grammar(spec))
        except ValueError as error:
            raise ValueError(f"{field} {error}") from None
        except RuntimeError as error:
            raise ValueError(f"{field} could not be compiled: {_native_message(error)}") from None
        stops = sorted(set(tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids))
        self._start(compiled, stops, vocab_size)

    def _start(self, compiled, stops: list[int], vocab_size: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self._compiled, self._stops = compiled, stops
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None, max_rollback_tokens=-1)
        self._taken: list[int] = []  # the output tokens the matcher has taken

    def fresh_copy(self) -> GrammarState:
        """A state on the same compiled spec and stop tokens that has taken nothing: a draft model
        follows its own drafts with it, and need not compile the spec again (seconds)."""
        copy = GrammarState.__new__(GrammarState)
        copy._start(self._compiled, self._stops, self.vocab_size)
        return copy

    @classmethod
    def for_params(cls, params, tokenizer, vocab_size: int, eos_token_ids=None) -> GrammarState | None:
        """The request's state, its stop tokens `eos_token_ids` (the engine's) and its own
        stop_token_ids; None without a spec."""
        if params.structured_outputs is None:
            return None
        eos = list(tokenizer.eos_token_ids if eos_token_ids is None and tokenizer is not None else eos_token_ids or [])
        return cls(params.structured_outputs, tokenizer, vocab_size, eos + list(params.stop_token_ids))

    @property
    def finished(self) -> bool:
        """The spec is complete and a stop token was taken: nothing further is limited (a
        request that ignores EOS goes on as free text, as in vLLM)."""
        return self._matcher.is_terminated()

    def sync(self, output_ids: list[int]) -> None:
        """Take the output tokens not yet taken, first going back to where `output_ids` parts from
        what was taken (a draft model's drafts are its output until verification rejects them).
        Raises ValueError for a token the spec does not allow (the output was not made under it)."""
        taken = self._taken
        if output_ids[: len(taken)] != taken:
            common = next((i for i, (a, b) in enumerate(zip(taken, output_ids)) if a != b), len(output_ids))
            self._matcher.rollback(len(taken) - common)
            del taken[common:]
        for at in range(len(taken), len(output_ids)):
            if self.finished:  # what follows a stop token (ignore_eos) is not the spec's
                break
            if not self._matcher.accept_token(int(output_ids[at])):
                raise ValueError(f"output token {output_ids[at]} (position {at}) does not follow the request's "
                                 "structured_outputs")
            taken.append(int(output_ids[at]))

    def next_token_bitmask(self, output_ids: list[int], drafts: list[int], rows: int) -> torch.Tensor | None:
        """xgrammar's bitmask [rows, words] of the tokens allowed at each row: row i follows the
        output and drafts[:i]. Rows after a draft the spec refuses are never used, as verification
        stops at that draft; they repeat its row. Rows after a drafted stop token (ignore_eos goes
        on past it) allow every token, as the output is free there. None when finished."""
        import xgrammar as xgr

        self.sync(output_ids)
        if self.finished:
            return None
        bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)  # all ones: every token allowed
        taken = 0
        for row in range(rows):
            self._matcher.fill_next_token_bitmask(bitmask, row)
            if row == rows - 1:
                break
            if not self._matcher.accept_token(int(drafts[row])):
                bitmask[row + 1:] = bitmask[row]
                break
            taken += 1
            if self.finished:  # a drafted stop token (ignore_eos): after it the output is free
                break
        if taken:
            self._matcher.rollback(taken)
        return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, for the tokens a row's bitmask leaves out (logits [rows, V] on any device;
    bit j of little-endian int32 word w allows token 32w + j). Unpacked by numpy on the host:
    with xgrammar's CPU kernel, applying it took 5x as long (bench/structured_output.py)."""
    words = bitmask.cpu().numpy().astype("<i4", copy=False).view(np.uint8)  # little-endian on any host
    allowed = torch.from_numpy(np.unpackbits(words, axis=-1, bitorder="little")[:, : logits.shape[-1]].view(bool))
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
