"""Speculative decoding: drafters propose k tokens, the target verifies 1 + k rows at once.

Verification keeps the target's output distribution exact: greedy acceptance at temperature 0,
and standard rejection sampling (accept draft x with probability min(1, p(x) / q(x)), else
sample from the normalized residual max(p - q, 0)) at temperature > 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..models.sampling import SamplingParams, target_probs


class DrafterMismatch(ValueError):
    """The drafter cannot serve this target (different vocabulary / tokenizer)."""


@dataclass
class Draft:
    tokens: list[int]
    # [len(tokens), vocab] distributions the tokens were drawn from; None for deterministic
    # drafters (prompt lookup), whose proposal is a point mass.
    probs: torch.Tensor | None = None

    def first(self, n: int) -> Draft:
        """Its first n tokens (verification may check fewer than were drafted)."""
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n])


class Drafter(Protocol):
    def propose(
        self, request_ids: list[str], histories: list[list[int]], k: int, params: list[SamplingParams], *,
        prompt_lengths: list[int] | None = None, eos_token_ids=(), grammars=None,
    ) -> list[Draft]:
        """Up to k drafts per request. histories: prompt then output; prompt_lengths splits them
        (for the penalties) and eos_token_ids are the ones min_tokens bans, for a drafter that
        processes its logits as the target does; grammars: each request's compiled structured
        output (a GrammarState or None), for a drafter that drafts under it."""
        ...

    def release(self, request_id: str) -> None: ...


class _TokenArray:
    """One request's history as a growing int64 array, kept between steps so that a lookup scans
    it in numpy instead of comparing Python slices (at 32K tokens of history those took 4 to 15 ms
    per request and step, bench/step_host_work.py; a GPU's whole step is tens of milliseconds),
    and appends only the tokens a step accepted."""

    def __init__(self):
        self.tokens: list[int] = []
        self.array = np.empty(1024, dtype=np.int64)
        self.source: list[int] | None = None  # the list last synced from

    def sync(self, history: list[int]) -> np.ndarray:
        known = len(self.tokens)
        # The engine hands over the same list, only ever extended: then no comparison is needed.
        continues = len(history) >= known and (history is self.source or history[:known] == self.tokens)
        self.source = history
        if not continues:  # start again
            known = 0
            self.tokens = []
        if len(history) > self.array.size:
            grown = np.empty(max(len(history), 2 * self.array.size), dtype=np.int64)
            grown[:known] = self.array[:known]
            self.array = grown
        self.array[known : len(history)] = history[known:]
        self.tokens.extend(history[known:])
        return self.array[: len(history)]


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the history's last n tokens
    (longest n first) and propose the tokens that followed it. No weights, no KV; each request's
    history is kept as an array until `release`."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._histories: dict[str, _TokenArray] = {}

    def propose(self, request_ids, histories: list[list[int]], k: int, params=None, **_) -> list[Draft]:
        if k == 0:
            return [Draft([]) for _ in histories]
        return [Draft(self._lookup(self._histories.setdefault(rid, _TokenArray()).sync(h), k))
                for rid, h in zip(request_ids, histories)]

    def _lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            tail = tokens[length - n :]
            # Starts s <= length - n - 1: an earlier occurrence with at least one token after it.
            match = tokens[: length - n] == tail[0]
            for j in range(1, n):
                match &= tokens[j : length - n + j] == tail[j]
            starts = np.flatnonzero(match)
            if starts.size:
                start = int(starts[-1])  # the most recent: recent context predicts best
                return tokens[start + n : start + n + k].tolist()
        return []

    def release(self, request_id: str) -> None:
        self._histories.pop(request_id, None)


def verify(
    target_logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> list[int]:
    """target_logits: [1 + len(draft.tokens), vocab] for the rows (last token, drafts...).

    Returns the emitted tokens: the accepted prefix of the draft plus one token from the target
    (the correction at the first rejection, or the bonus token when every draft is accepted).
    """
    drafts = draft.tokens
    if target_logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{target_logits.shape[0]} target rows for {len(drafts)} draft tokens")
    if params.greedy:
        choices = target_logits.argmax(dim=-1).tolist()
        emitted = []
        for i, token in enumerate(drafts):
            if token != choices[i]:
                break
            emitted.append(token)
        emitted.append(choices[len(emitted)])
        return emitted

    probs = target_probs(target_logits, params)
    emitted = []
    for i, token in enumerate(drafts):
        p = probs[i]
        q_token = 1.0 if draft.probs is None else float(draft.probs[i, token])
        accept_prob = min(1.0, float(p[token]) / q_token) if q_token > 0 else 0.0
        if torch.rand((), generator=generator).item() < accept_prob:
            emitted.append(token)
            continue
        if draft.probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft.probs[i]).clamp_min(0.0)
        total = residual.sum()
        # A residual of zero mass means p == q: any sample from p is then exact.
        dist = residual / total if total > 0 else p
        emitted.append(int(torch.multinomial(dist, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return emitted
