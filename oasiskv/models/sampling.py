"""Sampling parameters and the sampler (greedy, temperature, min-p, top-k, top-p, per-request
seeds), and the logits processing before it (allowed_token_ids, bad_words, min_tokens,
logit_bias, penalties, and a structured output's limit)."""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch

from .structured_output import GrammarState, apply_bitmask, check_spec

# A seed is a signed 64-bit integer (OpenAI's and vLLM's range); the engines derive further
# generators from it (`stream_seed`).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# Below this temperature a request decodes greedily, as in vLLM: dividing the logits by a
# temperature near zero overflows them to inf and the softmax to NaN, which failed the sampling
# of every request in the step (1e-40 did; 1e-5 scales logits of 50 to 5e6, still finite).
GREEDY_BELOW_TEMPERATURE = 1e-5

# Most alternatives a token's logprobs may list (vLLM's default max_logprobs).
MAX_LOGPROBS = 20

# OpenAI's limits on logit_bias: a bias in [-100, 100] (-100 bans a token, +100 all but forces
# it) on at most 300 tokens.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300

# vLLM's limits on bad_words once tokenized (VLLM_MAX_NUM_BAD_WORDS and
# VLLM_MAX_BAD_WORDS_TOTAL_TOKENS): each step checks every sequence against the output.
MAX_BAD_WORD_SEQUENCES = 128
MAX_BAD_WORD_TOKENS = 1024


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the most likely alternatives
    (best first). As vLLM's default: from the raw logits, before min_tokens, logit_bias, the
    penalties, temperature, min-p, top-k and top-p."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    # How many tokens were at least as likely, itself too: prompt logprobs give it, as vLLM's.
    rank: int | None = None


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # As in vLLM: special tokens (an EOS kept by ignore_eos, say) are left out of the text, and
    # a stop string that ends the output is cut with the rest unless asked for.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # None: no logprobs; n: each token's logprob and its n most likely alternatives.
    logprobs: int | None = None
    # vLLM's prompt_logprobs: the same for each prompt token after the first (computed by the
    # prefill, which then does not take the prompt from a prefix cache: every position is needed).
    prompt_logprobs: int | None = None
    # OpenAI's penalties on tokens already generated (presence: once; frequency: per
    # occurrence), and vLLM's repetition penalty on tokens of the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's min_p: after temperature, tokens less likely than min_p times the most likely one are
    # dropped (0: off). vLLM's min_tokens: EOS and the stop tokens cannot be generated, and no stop
    # string can end the output, before this many tokens. OpenAI's logit_bias: {token id: bias}
    # added to the logits (greedy decoding too).
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's allowed_token_ids: only these tokens may be generated (None: any), e.g. a choice
    # among labels.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: words the output may not contain. Each step bans the last token of any
    # of their token sequences whose other tokens end the output (a one-token word: always).
    # The sequences come from the model's tokenizer (`tokenize_bad_words`); the API and `LLM`
    # fill them in, and an engine given words without them refuses the request.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # vLLM's structured_outputs: the output follows a spec, e.g. {"json": schema} or {"regex": ...}
    # (`structured_output.check_spec`). The engines limit each step to the tokens it allows.
    structured_outputs: dict | None = None

    def __post_init__(self):
        if self.stop is None:  # vLLM's default
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        optional = tuple(name for name in ("seed", "logprobs", "prompt_logprobs") if getattr(self, name) is not None)
        for name in ("max_tokens", "top_k", "min_tokens") + optional:
            if not _is_int(getattr(self, name)):  # a float failed inside torch, not naming the field
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < float("inf"):  # NaN too: it sampled from NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # NaN too
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a signed 64-bit integer, in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if not isinstance(self.min_p, numbers.Real) or isinstance(self.min_p, bool) \
                or not 0.0 <= self.min_p <= 1.0:  # NaN too
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids \
                    or not all(_is_int(t) for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = sorted({int(t) for t in self.allowed_token_ids})
        if self.bad_words is None:
            self.bad_words = []
        if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        if any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words entries must contain text other than spaces")
        self.bad_words = list(dict.fromkeys(self.bad_words))  # as vLLM, a word given twice counts once
        if len(self.bad_words) > MAX_BAD_WORD_SEQUENCES:  # each makes one sequence at least
            raise ValueError(f"bad_words may name at most {MAX_BAD_WORD_SEQUENCES} words, got {len(self.bad_words)}")
        if self.bad_words_token_ids is None:
            self.bad_words_token_ids = []
        if not isinstance(self.bad_words_token_ids, (list, tuple)) or not all(
                isinstance(ids, (list, tuple)) and ids and all(_is_int(t) for t in ids) for ids in self.bad_words_token_ids):
            raise ValueError(f"bad_words_token_ids must be a list of non-empty lists of token ids, got "
                             f"{self.bad_words_token_ids!r}")
        if self.bad_words_token_ids and not self.bad_words:
            raise ValueError("bad_words_token_ids are made from bad_words (tokenize_bad_words): give the words too")
        self.bad_words_token_ids = [[int(t) for t in ids] for ids in self.bad_words_token_ids]
        if self.structured_outputs is not None:
            # Parsed where it is compiled (a large one takes a while): the engines and the API's check.
            self.structured_outputs = check_spec(self.structured_outputs, parse=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before sampling (`process_logits`)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.allowed_token_ids is not None
                or bool(self.bad_words) or self.structured_outputs is not None)


def tokenize_bad_words(bad_words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's token sequences for bad_words. `encode(text)` gives a text's token ids without
    special tokens. Each word (its leading spaces dropped) is banned as it would begin the
    output, and also after a space, where the tokenizer makes that a different first token of
    the same length (a word in mid-text: 'Ġhello' rather than 'hello'). Raises ValueError for a
    word with no tokens, or past vLLM's limits (as soon as they are passed: a request of a
    million words took seconds to refuse)."""
    sequences: list[list[int]] = []
    total = 0
    for word in dict.fromkeys(bad_words):  # as vLLM, a word given twice counts once
        alone = list(encode(word.lstrip()))
        if not alone:
            raise ValueError(f"bad_words entry {word!r} has no tokens")
        spaced = list(encode(" " + word.lstrip()))
        for ids in [alone] + ([spaced] if spaced and spaced[0] != alone[0] and len(spaced) == len(alone) else []):
            sequences.append(ids)
            total += len(ids)
            if len(sequences) > MAX_BAD_WORD_SEQUENCES:
                raise ValueError(f"bad_words make more than the {MAX_BAD_WORD_SEQUENCES} token sequences allowed")
            if total > MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad_words make more than the {MAX_BAD_WORD_TOKENS} tokens allowed")
    return sequences


def require_known_stop_tokens(params: SamplingParams, vocab_size: int) -> None:
    """A stop token the model cannot emit would never stop anything: refused, as the API does."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[:5]}")


def require_known_bias_tokens(params: SamplingParams, vocab_size: int) -> None:
    """A bias on an id outside the vocabulary would index another token's logit (a negative one)
    or fail the step (one past the end): refused, naming the id."""
    bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is not in the model's vocabulary [0, {vocab_size})")


def require_known_allowed_tokens(params: SamplingParams, vocab_size: int, eos_token_ids=()) -> None:
    """Allowed ids the model does not have would index past its logits; and min_tokens that bans
    every allowed token (each a stop) would leave nothing to generate: refused, as a request that
    cannot be served."""
    allowed = params.allowed_token_ids
    if allowed is None:
        return
    bad = [t for t in allowed if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"allowed_token_ids must be in [0, {vocab_size}), got {bad[:5]}")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if params.min_tokens and set(allowed) <= stops:
        raise ValueError(f"allowed_token_ids are all stop tokens, which min_tokens ({params.min_tokens}) bans: no "
                         "token could be generated")
    always_banned = {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
    if set(allowed) <= always_banned | (stops if params.min_tokens else set()):
        raise ValueError("allowed_token_ids are all banned by bad_words" + (" and min_tokens" if params.min_tokens else "")
                         + ": no token could be generated")


def require_tokenized_bad_words(params: SamplingParams, vocab_size: int) -> None:
    """bad_words come with their token sequences, of ids the model has: words whose sequences
    were never made would ban nothing."""
    if params.bad_words and not params.bad_words_token_ids:
        raise ValueError("bad_words were given without their token sequences: fill bad_words_token_ids with "
                         "tokenize_bad_words(bad_words, encode)")
    bad = [t for ids in params.bad_words_token_ids for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"bad_words token ids must be in [0, {vocab_size}), got {bad[:5]}")


def require_known_tokens(params: SamplingParams, vocab_size: int, eos_token_ids=()) -> None:
    """Every token id the request names (stop_token_ids, logit_bias, allowed_token_ids, the
    bad_words' sequences) is one the model has."""
    require_known_stop_tokens(params, vocab_size)
    require_known_bias_tokens(params, vocab_size)
    require_known_allowed_tokens(params, vocab_size, eos_token_ids)
    require_tokenized_bad_words(params, vocab_size)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked_logit_bias(bias) -> dict[int, float]:
    """logit_bias as {token id: float}: JSON gives its keys as strings ("50256"), Python callers
    ints; anything else, or a bias out of OpenAI's range, is refused naming the entry."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map from token ids to biases, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
    checked: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_id(key)
        if token is None:
            raise ValueError(f"logit_bias keys must be integer token ids, got {key!r}")
        if token in checked:
            raise ValueError(f"logit_bias names token id {token} twice")
        if not isinstance(value, numbers.Real) or isinstance(value, bool) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN too
            raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {value!r} for token id {token}")
        checked[token] = float(value)
    return checked


def _token_id(key) -> int | None:
    if _is_int(key):
        return int(key)
    if isinstance(key, str):
        digits = key.strip()
        digits = digits[1:] if digits[:1] in ("+", "-") else digits  # one sign, as int() takes
        if digits.isdecimal():
            return int(key)
    return None


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                   drafts: list[int] = (), eos_token_ids=(), grammar: GrammarState | None = None) -> torch.Tensor:
    """The logits the request samples from, rows [1 + len(drafts), V]: row i is output position
    len(output_ids) + i and follows the output and drafts[:i] (a speculative step verifies several
    positions at once). Fewer rows where `grammar` leaves a row without a token: they end before
    it (see _limit_to_grammar). In vLLM's order: allowed_token_ids, bad_words and min_tokens (bans, which
    commute), logit_bias, the penalties, then `grammar`'s limit (structured_outputs; vLLM applies it
    first, and a ban commutes with the rest). A new fp32 tensor; the raw logits stay for the
    logprobs, which are vLLM's raw ones."""
    logits = logits.float().clone()
    if params.allowed_token_ids is not None:
        allowed = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        allowed[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=logits.device)] = True
        logits[:, ~allowed] = float("-inf")
    _ban_stops_before_min_tokens(logits, params, len(output_ids), eos_token_ids)
    if params.bad_words:
        # What a sequence's other tokens may match: the output's last tokens, then the drafts.
        tail = list(output_ids[len(output_ids) - min(len(output_ids), max(map(len, params.bad_words_token_ids)) - 1):])
        _ban_bad_words(logits, params.bad_words_token_ids, tail + list(drafts[: logits.shape[0] - 1]), len(tail),
                       keep_one=params.allowed_token_ids is not None)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=logits.device)
    if params.penalized:
        logits = apply_penalties(logits, params, prompt_ids, output_ids, drafts)
    if grammar is not None:
        logits = logits[: _limit_to_grammar(logits, grammar, output_ids, drafts)]
    return logits


def _limit_to_grammar(logits: torch.Tensor, grammar: GrammarState, output_ids: list[int], drafts: list[int]) -> int:
    """The structured output's limit, last, in place; returns how many rows may be sampled from.

    A row it leaves no token (a spec with a dead end, or one that with the other bans allows
    nothing there: min_tokens' ban of EOS where only EOS may follow, say) cannot be sampled from:
    that failed the whole decode step, and any token taken instead would break the spec. The
    first row raises ValueError naming the position. A later one ends the rows, which verifies
    fewer drafts: the row before it then gives the bonus token, and if that is the draft that led
    to the dead end, the next step's first row raises, as one token at a time would have."""
    bitmask = grammar.next_token_bitmask(output_ids, list(drafts[: logits.shape[0] - 1]), logits.shape[0])
    if bitmask is None:
        return logits.shape[0]
    apply_bitmask(logits, bitmask)
    empty = (logits.amax(dim=-1) == float("-inf")).nonzero().flatten().tolist()
    if empty and empty[0] == 0:
        raise ValueError(f"the structured output, with the request's other limits, leaves no token to generate "
                         f"at output position {len(output_ids)}")
    return empty[0] if empty else logits.shape[0]


def _ban_bad_words(logits: torch.Tensor, sequences: list[list[int]], generated: list[int], base: int,
                   keep_one: bool = False) -> None:
    """Row i follows generated[:base + i] (the output's end, then the drafts before it): a
    sequence's last token gets -inf there when the sequence's other tokens end it. In place; only
    the output counts, as in vLLM, not the prompt.

    `keep_one` (a request with allowed_token_ids): a row whose bans would leave no token keeps
    its words, which give way. Sampling from no token failed the whole decode step; allowed
    tokens that one-token words all ban are refused at admission, but what longer words ban
    depends on the output."""
    for i in range(logits.shape[0]):
        end = base + i
        tokens = [ids[-1] for ids in sequences if len(ids) - 1 <= end and generated[end - len(ids) + 1 : end] == ids[:-1]]
        if not tokens:
            continue
        ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        if not keep_one:
            # One-token words ban at every step: no vocabulary-sized copy on the decode path.
            logits[i].index_fill_(0, ids, float("-inf"))
            continue
        banned = logits[i].index_fill(0, ids, float("-inf"))
        if torch.isfinite(banned).any():
            logits[i] = banned


def _ban_stops_before_min_tokens(logits: torch.Tensor, params: SamplingParams, num_output: int, eos_token_ids) -> None:
    """Rows whose position comes before min_tokens cannot end the request: EOS (unless ignored,
    when it ends nothing) and the stop tokens get -inf there. In place."""
    short = min(logits.shape[0], params.min_tokens - num_output)
    if short <= 0:
        return
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if stops:
        logits[:short, torch.tensor(sorted(stops), dtype=torch.long, device=logits.device)] = float("-inf")


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                    drafts: list[int] = ()) -> torch.Tensor:
    """The penalized logits, rows [1 + len(drafts), V]: row i follows the output and drafts[:i]
    (a speculative step verifies several positions at once). A new tensor."""
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    rows = logits.shape[0]
    # Built on the logits' device: CPU counts against CUDA logits would fail the step on a GPU.
    device = logits.device
    generated = torch.tensor(list(output_ids) + list(drafts[: rows - 1]), dtype=torch.long, device=device)
    base = len(output_ids)
    # counts[i]: how often each token occurs in the output before row i's position.
    counts = torch.zeros((rows, vocab), dtype=torch.float32, device=device)
    if base:
        counts[:] = torch.bincount(generated[:base], minlength=vocab)[:vocab].float()
    for i in range(1, rows):
        counts[i:, generated[base + i - 1]] += 1
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            seen[:, torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).float()
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: temperature, then min-p, top-k and top-p (vLLM's
    order). [.., V] fp32."""
    logits = logits.float() / params.temperature
    if params.min_p:
        probs = torch.softmax(logits, dim=-1)
        # Relative to the most likely token, which therefore always stays.
        logits = logits.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked before it already reach top_p; never the first (a
        # top_p that rounds to 0 in fp32, 1e-320 say, dropped every token and sampled from NaN).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, V] -> one token per row."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    tokens = []
    for row, p, gen in zip(logits, params, generators):
        if p.greedy:
            tokens.append(int(row.argmax()))
        else:
            tokens.append(int(torch.multinomial(target_probs(row, p), 1, generator=gen)))
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, ranked: bool = False) -> list[TokenLogprob]:
    """logits: [len(tokens), V], row i the one token i was sampled from (or, for a prompt, the
    position before it). `ranked`: each token's rank too, as vLLM's prompt logprobs give it."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device).unsqueeze(-1))
    # As vLLM counts it: the tokens at least as likely, the token itself among them (a tie ranks
    # below its equals: bf16 logits tie often).
    ranks = (logprobs >= chosen).sum(dim=-1).tolist() if ranked else [None] * len(tokens)
    if top:
        values, ids = torch.topk(logprobs, top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, alt, rank) for t, lp, alt, rank in zip(tokens, chosen.squeeze(-1).tolist(), tops, ranks)]


def stream_seed(seed: int, stream: str) -> int:
    """The seed of one of a seeded request's further random streams (the decode node's
    verification, a draft model's drafts): the request's seed and the stream's name hashed
    together. They were seed + 1 and seed + 2, so requests seeded 0, 1, 2, ... (n samples of a
    prompt, say) shared streams: one's verification drew the next one's first token's numbers."""
    digest = hashlib.blake2b(f"{seed}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: a seed torch takes


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen
