"""Speculative decoding: drafters propose k tokens, the target verifies 1 + k rows at once.

Verification keeps the target's output distribution exact: greedy acceptance at temperature 0,
and standard rejection sampling (accept draft x with probability min(1, p(x) / q(x)), else
sample from the normalized residual max(p - q, 0)) at temperature > 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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


class Drafter(Protocol):
    def propose(
        self, request_ids: list[str], histories: list[list[int]], k: int, params: list[SamplingParams]
    ) -> list[Draft]: ...

    def release(self, request_id: str) -> None: ...


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the history's last n tokens
    (longest n first) and propose the tokens that followed it. No weights, no KV."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, request_ids, histories: list[list[int]], k: int, params=None) -> list[Draft]:
        return [Draft(self._lookup(h, k)) for h in histories]

    def _lookup(self, history: list[int], k: int) -> list[int]:
        if k == 0:
            return []
        length = len(history)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            tail = history[length - n :]
            # Most recent match first: recent context predicts best.
            for start in range(length - n - 1, -1, -1):
                if history[start : start + n] == tail:
                    follow = history[start + n : start + n + k]
                    if follow:
                        return follow
        return []

    def release(self, request_id: str) -> None:
        pass


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
