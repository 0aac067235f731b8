"""The draft model's compute stays bounded like its KV: a prompt longer than its ring is not run
through it whole, the tokens it skips cannot change what it proposes, and a request catching up
feeds within a per-call budget while the others keep drafting."""

from __future__ import annotations

import pytest
import torch

from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.draft_model import DraftModelDrafter, build_drafter
from oasiskv.decode_node.speculative import NgramDrafter
from oasiskv.models.errors import UnknownModelError
from oasiskv.models.sampling import SamplingParams

from ..conftest import stdlib_source

SINKS, WINDOW, CHUNK, K = 16, 128, 32, 3


def drafter_counting_rows(llm, catch_up_budget: int | None = None) -> tuple[DraftModelDrafter, list[int]]:
    """A self-drafting SmolLM2 (same tokenizer, so no mismatch) and the rows of every forward it runs."""
    model, tok = llm.model, llm.tokenizer
    drafter = DraftModelDrafter(model, model.config.vocab_size, tok, tok, sink_tokens=SINKS, window_tokens=WINDOW,
                                max_chunk=CHUNK, catch_up_budget=catch_up_budget)
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


def propose_until_drafted(drafter, request_id: str, history: list[int], params) -> tuple[object, int]:
    """Call propose with the same history until the request has caught up and drafts: (draft, calls)."""
    for calls in range(1, 100):
        draft = drafter.propose([request_id], [history], K, params)[0]
        if draft.tokens:
            return draft, calls
        assert draft.probs is None
    raise AssertionError("the drafter never caught up")


@pytest.mark.parametrize("budget", [None, 0])
@pytest.mark.parametrize("length", [100, 1500])
def test_the_catch_up_runs_the_sinks_and_the_ring_only(smollm2_llm, history, length, budget):
    drafter, rows = drafter_counting_rows(smollm2_llm, budget)
    draft, calls = propose_until_drafted(drafter, "r", history[:length], [SamplingParams()])
    assert len(draft.tokens) == K
    catch_up = min(length, SINKS + drafter.ring)  # a short history is fed whole, as before
    assert sum(rows) == catch_up + (K - 1)  # then one row per draft step but the last
    # The default budget is one request's whole catch-up; without it, one chunk a call.
    assert calls == (1 if budget is None else -(-catch_up // CHUNK))
    assert max(rows) <= CHUNK


def test_skipped_tokens_cannot_change_the_proposal(smollm2_llm, history):
    drafter, _ = drafter_counting_rows(smollm2_llm)
    kept_from = len(history) - drafter.ring
    scrambled = history[:SINKS] + [history[SINKS + (7 * i) % 97] for i in range(kept_from - SINKS)] + history[kept_from:]
    assert scrambled != history and len(scrambled) == len(history)
    original, _ = propose_until_drafted(drafter, "original", history, sampled())
    other, _ = propose_until_drafted(drafter, "scrambled", scrambled, sampled())
    assert original.tokens == other.tokens
    torch.testing.assert_close(original.probs, other.probs, rtol=0, atol=1e-6)
    # The kept tokens do count: changing one of them changes the draft distribution.
    edited = history[:-1] + [history[-1] + 1]
    third, _ = propose_until_drafted(drafter, "edited", edited, sampled())
    assert not torch.allclose(original.probs[0], third.probs[0], atol=1e-4)


def test_after_the_catch_up_only_the_accepted_tokens_are_fed(smollm2_llm, history):
    drafter, rows = drafter_counting_rows(smollm2_llm)
    first = propose_until_drafted(drafter, "r", history, [SamplingParams()])[0].tokens
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


def test_a_request_catching_up_does_not_hold_back_the_others(smollm2_llm, history):
    drafter, rows = drafter_counting_rows(smollm2_llm, catch_up_budget=0)
    running = history[:700]
    propose_until_drafted(drafter, "running", running, [SamplingParams()])
    rows.clear()
    # A long prompt arrives: the running request keeps drafting in the same call, and the call
    # feeds the newcomer one chunk (its sinks, then the start of its ring).
    grown = running + [running[-10]]
    drafts = drafter.propose(["running", "new"], [grown, history], K, [SamplingParams()] * 2)
    assert len(drafts[0].tokens) == K and drafts[1].tokens == []
    newcomer_rows = sum(rows) - 1 - (K - 1)  # the running request fed its new token, then K-1 draft rows
    assert newcomer_rows == CHUNK
    # It drafts once it has caught up, alongside the running one.
    calls = 1
    while not drafts[1].tokens:
        grown = grown + [drafts[0].tokens[0]]
        drafts = drafter.propose(["running", "new"], [grown, history], K, [SamplingParams()] * 2)
        assert len(drafts[0].tokens) == K
        calls += 1
    assert calls == -(-(SINKS + drafter.ring) // CHUNK)


def test_newcomers_share_the_budget_in_order(smollm2_llm, history):
    drafter, rows = drafter_counting_rows(smollm2_llm)
    running = history[:700]
    propose_until_drafted(drafter, "running", running, [SamplingParams()])
    rows.clear()
    catch_up = SINKS + drafter.ring
    grown = running + [running[-10]]
    ids, params = ["running", "first", "second"], [SamplingParams()] * 3
    drafts = drafter.propose(ids, [grown, history, history[:1400]], K, params)
    # The budget (one catch-up beyond the first chunk) goes first to the first newcomer, which
    # drafts at once; the second feeds its own chunk and what is left; the running request
    # drafts as usual.
    assert [len(d.tokens) for d in drafts] == [K, K, 0]
    second = CHUNK + drafter.catch_up_budget - (catch_up - CHUNK)
    assert second < catch_up
    assert sum(rows) == 1 + catch_up + second + 2 * (K - 1)
    drafts = drafter.propose(ids, [grown + drafts[0].tokens[:1], history + drafts[1].tokens[:1], history[:1400]], K,
                             params)
    assert [len(d.tokens) for d in drafts] == [K, K, K]


def test_a_negative_budget_is_refused(smollm2_llm):
    model, tok = smollm2_llm.model, smollm2_llm.tokenizer
    with pytest.raises(ValueError, match="catch_up_budget"):
        DraftModelDrafter(model, model.config.vocab_size, tok, tok, catch_up_budget=-1)


def test_build_drafter_by_name(smollm2_llm, smollm2_dir):
    model, tok = smollm2_llm.model, smollm2_llm.tokenizer
    assert isinstance(build_drafter(DecodeConfig(drafter="ngram"), model, tok, torch.float32), NgramDrafter)
    config = DecodeConfig(drafter=str(smollm2_dir), draft_window_tokens=64, draft_catch_up_budget=0)
    drafter = build_drafter(config, model, tok, torch.bfloat16)
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.ring == 64 + drafter.max_chunk and drafter.catch_up_budget == 0
    assert next(drafter.model.parameters()).dtype == torch.bfloat16
    assert drafter.max_requests == config.max_num_seqs
    with pytest.raises(UnknownModelError):
        build_drafter(DecodeConfig(drafter="no-such-draft-model"), model, tok, torch.float32)


def test_the_draft_kv_has_a_ring_for_every_request_the_engine_runs(smollm2_llm, smollm2_dir):
    """build_drafter sizes the draft model's KV by the engine's max_num_seqs: a smaller fixed
    size made the engine's 33rd concurrent request fail in the drafter."""
    model, tok = smollm2_llm.model, smollm2_llm.tokenizer
    config = DecodeConfig(drafter=str(smollm2_dir), draft_window_tokens=16, max_num_seqs=40)
    drafter = build_drafter(config, model, tok, torch.float32)
    assert drafter.kv_bytes == 40 * drafter.slots_per_request // 16 * drafter.cache.spec.bytes_per_block
    params = SamplingParams(max_tokens=4)
    histories = [[1, 2, 3]] * 40
    ids = [f"r{i}" for i in range(40)]
    drafts = drafter.propose(ids, histories, 2, [params] * 40)
    assert [len(d.tokens) for d in drafts] == [2] * 40
    with pytest.raises(RuntimeError, match="holds 40 requests"):
        drafter.propose(["one-more"], [[1, 2, 3]], 2, [params])
    drafter.release("r0")
    assert len(drafter.propose(["one-more"], [[1, 2, 3]], 2, [params])[0].tokens) == 2


def test_drafts_follow_the_engines_compiled_spec_without_compiling_it_again(smollm2_llm, monkeypatch):
    """The engine hands its compiled structured output over: the draft model follows it with a
    matcher of its own (the engine's stays where it was) and compiles nothing (seconds a spec on
    Qwen's vocabulary); without it, the draft model compiles the spec itself."""
    from oasiskv.models import structured_output

    tok, vocab = smollm2_llm.tokenizer, smollm2_llm.model.config.vocab_size
    params = SamplingParams(structured_outputs={"choice": ["yes please", "no thanks"]})
    engine_state = structured_output.GrammarState.for_params(params, tok, vocab, smollm2_llm.eos_token_ids)
    first_row = engine_state.next_token_bitmask([], [], 1).clone()
    compiles = []
    compile_grammar = structured_output._COMPILERS.get(tok, vocab).compile_grammar
    monkeypatch.setattr(structured_output._COMPILERS, "get", lambda *_: type("Counting", (), {
        "compile_grammar": staticmethod(lambda g: compiles.append(g) or compile_grammar(g))}))
    prompt = smollm2_llm.encode("Answer in one word: is water wet?")

    def drafted(grammars) -> str:
        drafter = DraftModelDrafter(smollm2_llm.model, vocab, tok, tok, sink_tokens=SINKS, window_tokens=WINDOW)
        draft = drafter.propose(["r"], [prompt], 3, [params], prompt_lengths=[len(prompt)],
                                eos_token_ids=smollm2_llm.eos_token_ids, grammars=grammars)[0]
        return smollm2_llm.tokenizer.decode(draft.tokens)

    text = drafted([engine_state])
    assert compiles == [] and text and ("yes please".startswith(text) or "no thanks".startswith(text))
    assert torch.equal(engine_state.next_token_bitmask([], [], 1), first_row)  # its own matcher did not move
    assert drafted(None) == text and len(compiles) == 1
