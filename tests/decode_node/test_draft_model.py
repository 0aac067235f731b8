"""The draft model's compute stays bounded like its KV: a prompt longer than its ring is not run
through it whole, and the tokens it skips cannot change what it proposes."""

from __future__ import annotations

import pytest
import torch

from oasiskv.decode_node.draft_model import DraftModelDrafter, build_drafter
from oasiskv.decode_node.speculative import NgramDrafter
from oasiskv.models.errors import UnknownModelError
from oasiskv.models.sampling import SamplingParams

from ..conftest import stdlib_source

SINKS, WINDOW, CHUNK, K = 16, 128, 32, 3


def drafter_counting_rows(llm) -> tuple[DraftModelDrafter, list[int]]:
    """A self-drafting SmolLM2 (same tokenizer, so no mismatch) and the rows of every forward it runs."""
    model, tok = llm.model, llm.tokenizer
    drafter = DraftModelDrafter(model, model.config.vocab_size, tok, tok, sink_tokens=SINKS, window_tokens=WINDOW,
                                max_chunk=CHUNK)
    rows: list[int] = []
    forward = drafter._forward

    def counted(states, feeds, logits_out):
        rows.append(sum(len(feed) for feed in feeds))
        return forward(states, feeds, logits_out)

    drafter._forward = counted
    return drafter, rows


@pytest.fixture(scope="module")
def history(smollm2_llm) -> list[int]:
    return smollm2_llm.encode(stdlib_source("argparse.py"))[:1500]


def sampled(seed: int = 0) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=seed)]


@pytest.mark.parametrize("length", [100, 1500])
def test_the_catch_up_runs_the_sinks_and_the_ring_only(smollm2_llm, history, length):
    drafter, rows = drafter_counting_rows(smollm2_llm)
    drafts = drafter.propose(["r"], [history[:length]], K, [SamplingParams()])[0].tokens
    assert len(drafts) == K
    catch_up = min(length, SINKS + drafter.ring)  # a short history is fed whole, as before
    assert sum(rows) == catch_up + (K - 1)  # then one row per draft step but the last
    assert max(rows) <= CHUNK


def test_skipped_tokens_cannot_change_the_proposal(smollm2_llm, history):
    drafter, _ = drafter_counting_rows(smollm2_llm)
    kept_from = len(history) - drafter.ring
    scrambled = history[:SINKS] + [history[SINKS + (7 * i) % 97] for i in range(kept_from - SINKS)] + history[kept_from:]
    assert scrambled != history and len(scrambled) == len(history)
    original = drafter.propose(["original"], [history], K, sampled())[0]
    other = drafter.propose(["scrambled"], [scrambled], K, sampled())[0]
    assert original.tokens == other.tokens
    torch.testing.assert_close(original.probs, other.probs, rtol=0, atol=1e-6)
    # The kept tokens do count: changing one of them changes the draft distribution.
    edited = history[:-1] + [history[-1] + 1]
    third = drafter.propose(["edited"], [edited], K, sampled())[0]
    assert not torch.allclose(original.probs[0], third.probs[0], atol=1e-4)


def test_after_the_catch_up_only_the_accepted_tokens_are_fed(smollm2_llm, history):
    drafter, rows = drafter_counting_rows(smollm2_llm)
    first = drafter.propose(["r"], [history], K, [SamplingParams()])[0].tokens
    rows.clear()
    # The target accepted two drafts and emitted its own next token.
    grown = history + first[:2] + [history[5]]
    second = drafter.propose(["r"], [grown], K, [SamplingParams()])[0].tokens
    assert len(second) == K
    # Drafts 0..K-2 were fed last call and both were accepted: only the correction is fed now
    # (then K-1 draft steps).
    assert sum(rows) == 1 + (K - 1)
    drafter.release("r")
    assert not drafter.states


def test_build_drafter_by_name(smollm2_llm):
    model, tok = smollm2_llm.model, smollm2_llm.tokenizer
    assert isinstance(build_drafter("ngram", model, tok, torch.float32), NgramDrafter)
    with pytest.raises(UnknownModelError):
        build_drafter("no-such-draft-model", model, tok, torch.float32)
