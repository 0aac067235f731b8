"""Speculative verification keeps the target's distribution; prompt lookup proposes what followed."""

from __future__ import annotations

import random

import pytest
import torch

from oasiskv.decode_node.speculative import Draft, NgramDrafter, verify
from oasiskv.models.sampling import SamplingParams

# Chi-square critical value, 4 degrees of freedom, p = 0.001: a correct sampler exceeds it
# once in a thousand seeds; the seeds below are fixed, so the test is deterministic.
CHI2_4DF_P001 = 18.47


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("drafter_kind", ["point-mass", "model"])
def test_rejection_sampling_reproduces_the_target_distribution(drafter_kind):
    torch.manual_seed(0)
    vocab, k = 5, 3
    target_logits = torch.randn(k + 1, vocab) * 1.5
    draft_probs = torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    params = SamplingParams(temperature=1.0, max_tokens=4)
    p0 = torch.softmax(target_logits[0], dim=-1)
    gen = torch.Generator().manual_seed(1234)
    first = torch.zeros(vocab)
    accepted_first = 0
    trials = 3000
    for _ in range(trials):
        if drafter_kind == "model":
            tokens = [int(torch.multinomial(draft_probs[i], 1, generator=gen)) for i in range(k)]
            draft = Draft(tokens, draft_probs)
        else:
            tokens = [1, 2, 3]
            draft = Draft(tokens)
        emitted = verify(target_logits, draft, params, gen)
        assert 1 <= len(emitted) <= k + 1
        first[emitted[0]] += 1
        accepted_first += emitted[0] == tokens[0] and len(emitted) > 1
    assert _chi_square(first, p0) < CHI2_4DF_P001
    assert accepted_first > 0  # drafts do get accepted


def test_greedy_accepts_the_matching_prefix_and_corrects():
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([7, 3, 9, 1]):
        logits[row, token] = 5.0
    params = SamplingParams()
    assert verify(logits, Draft([7, 3, 9]), params) == [7, 3, 9, 1]  # all accepted + bonus
    assert verify(logits, Draft([7, 4, 9]), params) == [7, 3]  # rejected at 2nd, corrected
    assert verify(logits[:1], Draft([]), params) == [7]  # k = 0 is plain decoding


def test_verify_refuses_mismatched_rows():
    with pytest.raises(ValueError, match="target rows"):
        verify(torch.zeros(2, 5), Draft([1, 2]), SamplingParams())


def _scan(history: list[int], k: int, max_ngram: int = 4) -> list[int]:
    """The lookup by its definition: longest n first, then the latest earlier match that has a
    token after it."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == history[len(history) - n :]:
                return history[start + n : start + n + k]
    return []


def test_ngram_lookup_equals_the_scan_as_requests_grow_restart_and_interleave():
    rng = random.Random(7)
    drafter = NgramDrafter()
    texts = {rid: [rng.randrange(5) for _ in range(3000)] for rid in ("a", "b")}
    for step in range(400):
        rid = rng.choice("ab")
        length = min(3000, 1 + step * 7 + rng.randrange(5))
        if rng.random() < 0.05:  # the same id with a history that does not continue the last one
            texts[rid] = [rng.randrange(5) for _ in range(3000)]
        history = texts[rid][:length]
        k = rng.randrange(0, 5)
        assert drafter.propose([rid], [history], k)[0].tokens == _scan(history, k)
    drafter.release("a")
    drafter.release("never-seen")  # harmless
    assert set(drafter._histories) == {"b"}


def test_ngram_lookup_follows_one_list_as_the_engine_extends_it():
    """The decode engine hands over the same history list every step, extended in place."""
    rng = random.Random(5)
    drafter, history = NgramDrafter(), [rng.randrange(4)]
    for _ in range(300):
        history.extend(rng.randrange(4) for _ in range(rng.randrange(1, 4)))
        assert drafter.propose(["x"], [history], 3)[0].tokens == _scan(history, 3)


def test_ngram_lookup_proposes_the_continuation_of_the_latest_match():
    drafter = NgramDrafter(max_ngram=3)
    history = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    # "5 6 7" occurred twice before; the most recent was followed by 2, 3.
    assert drafter.propose(["r"], [history], 2)[0].tokens == [2, 3]
    assert drafter.propose(["r"], [[1, 2, 3]], 4)[0].tokens == []  # nothing repeats
    assert drafter.propose(["r"], [history], 0)[0].tokens == []
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)
