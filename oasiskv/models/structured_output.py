"""Structured output (vLLM's `structured_outputs`, OpenAI's `response_format`): the output follows
a JSON schema, any JSON object, a regular expression, one of several strings, or an EBNF grammar.

xgrammar (vLLM's default backend) compiles the spec against the model's vocabulary, and a matcher
per request limits each step's logits to the tokens that keep the output inside it.

A request's matcher follows its output (`GrammarState.sync`) rather than being told of each
token, so each engine (the single-process `LLM`, the prefill's first token, the decode node's
verification rows) needs only the output it already keeps, and a request moved to another worker
rebuilds its state from its output. A speculative step's rows are limited by accepting the
drafts in turn and rolling them back.
"""

from __future__ import annotations

import json
import re
import threading
import weakref

import torch

# The kinds of spec, as vLLM's StructuredOutputsParams names them; a spec names exactly one.
SPEC_KINDS = ("json", "json_object", "regex", "choice", "grammar")

# xgrammar prefixes its errors with a time and a C++ source position: "[04:48:24] /project/cpp/...: ".
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def check_spec(spec, field: str = "structured_outputs") -> dict:
    """`spec` as a dict naming exactly one kind: {"json": schema (a dict or its JSON text)},
    {"json_object": true}, {"regex": str}, {"choice": [str, ...]} or {"grammar": EBNF}. Raises
    ValueError naming what is wrong, a schema, expression or grammar that does not parse too;
    its message begins with `field`, the request field it came from."""
    try:
        return _checked(spec)
    except ValueError as error:
        raise ValueError(f"{field} {error}") from None


def _checked(spec) -> dict:
    if not isinstance(spec, dict):
        raise ValueError(f"must be an object naming one of {', '.join(SPEC_KINDS)}, got {spec!r}")
    given = {key: value for key, value in spec.items() if value is not None and value is not False}
    unknown = sorted(set(given) - set(SPEC_KINDS))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not supported (one of {', '.join(SPEC_KINDS)})")
    if len(given) != 1:
        raise ValueError(f"must name exactly one of {', '.join(SPEC_KINDS)}, got "
                         f"{sorted(given) or 'none'}")
    (kind, value), = given.items()
    if kind == "json" and not isinstance(value, (dict, str)):
        raise ValueError(f"json must be a JSON schema (an object or its text), got {value!r}")
    if kind == "json_object" and value is not True:
        raise ValueError(f"json_object must be true, got {value!r}")
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
    if kind == "choice" and (not isinstance(value, list) or not value
                             or not all(isinstance(c, str) and c for c in value)):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {value!r}")
    checked = {kind: value}
    _grammar(checked)  # parses it: a bad spec is refused before a worker sees it
    return checked


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
        return xgr.Grammar.from_ebnf(value)
    except RuntimeError as error:  # xgrammar raises RuntimeError for any spec it cannot parse
        raise ValueError(f"{kind} is not valid: {_native_message(error)}") from None


def _native_message(error: RuntimeError) -> str:
    """xgrammar's message without its time and C++ source position."""
    text = str(error).strip()
    return _NATIVE_PREFIX.sub("", text.splitlines()[0] if text else "")


def _choice_ebnf(choices: list[str]) -> str:
    """One of the strings exactly. EBNF's string literals take JSON's escapes."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


# How long the API lets a spec take to compile. Compiling is not bounded by the spec's size: a
# string's maxLength of 100,000 took 6 s against Qwen's vocabulary, and each worker compiles it
# again, the prefill's while every other prompt waits.
COMPILE_LIMIT_S = 10.0
# What each compiler keeps of the grammars it compiled (xgrammar keeps them all by default).
_COMPILER_CACHE_BYTES = 256 * 2**20


def compile_spec(spec: dict, tokenizer, vocab_size: int) -> None:
    """Compile `spec` against the vocabulary, as a worker will (the API runs it on a thread,
    under COMPILE_LIMIT_S). ValueError for one xgrammar cannot compile."""
    grammar = _grammar(spec)
    try:
        _COMPILERS.get(tokenizer, vocab_size).compile_grammar(grammar)
    except RuntimeError as error:
        raise ValueError(f"could not be compiled: {_native_message(error)}") from None


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
                compilers[vocab_size] = xgr.GrammarCompiler(info, max_threads=1,
                                                            cache_limit_bytes=_COMPILER_CACHE_BYTES)
            return compilers[vocab_size]


_COMPILERS = _Compilers()


class GrammarState:
    """A request's matcher, following its output. `next_token_bitmask` gives, for each row of a
    step, the tokens the spec allows there."""

    def __init__(self, spec: dict, tokenizer, vocab_size: int):
        import xgrammar as xgr

        if tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer, and this engine was given none")
        compiled = _COMPILERS.get(tokenizer, vocab_size).compile_grammar(_grammar(check_spec(spec)))
        self.vocab_size = vocab_size
        self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self._taken: list[int] = []  # the output tokens the matcher has taken

    @classmethod
    def for_params(cls, params, tokenizer, vocab_size: int) -> GrammarState | None:
        spec = params.structured_outputs
        return None if spec is None else cls(spec, tokenizer, vocab_size)

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
        output and drafts[:i]. Rows after a draft the spec refuses (or a stop token) are never
        used, as verification stops at that draft; they repeat its row. None when finished."""
        import xgrammar as xgr

        self.sync(output_ids)
        if self.finished:
            return None
        bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        taken = 0
        for row in range(rows):
            self._matcher.fill_next_token_bitmask(bitmask, row)
            if row == rows - 1:
                break
            if not self._matcher.accept_token(int(drafts[row])):
                bitmask[row + 1:] = bitmask[row]
                break
            taken += 1
            if self.finished:
                bitmask[row + 1:] = bitmask[row]
                break
        if taken:
            self._matcher.rollback(taken)
        return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, for the tokens a row's bitmask leaves out (fp32 logits [rows, V])."""
    import xgrammar as xgr

    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask)
    else:  # no kernel needed for a handful of rows: unpack the bits on the device
        bits = bitmask.to(logits.device)
        words = torch.arange(logits.shape[-1], device=logits.device)
        allowed = (bits[:, words // 32] >> (words % 32)) & 1
        logits.masked_fill_(allowed == 0, float("-inf"))
