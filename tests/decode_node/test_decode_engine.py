"""The decode engine on a real model and a real store: sparse modes against `dense` and the
single-process engine, resource accounting, and bad input."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.draft_model import DraftModelDrafter
from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.decode_node.speculative import DrafterMismatch
from oasiskv.kvstore import KVStore, StoreFull, UnknownRequest, connect, ranking_radius_weight
from oasiskv.models.engine.scheduler import RequestTooLarge
from oasiskv.models.sampling import SamplingParams, tokenize_bad_words
from oasiskv.prefill_node.prefill import Prefiller

from ..conftest import stdlib_source
from .conftest import GREEDY, run_engine

@pytest.fixture(scope="module")
def reference(smollm2_llm, prompts):
    return [o.token_ids for o in smollm2_llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("mode", ["dense", "sparse-current", "lookahead"])
def test_full_budget_matches_the_single_process_engine(smollm2_llm, store, prompts, reference, mode):
    engine, tokens = run_engine(smollm2_llm, store, prompts, DecodeConfig(mode=mode, budget_tokens=2048, kv_pool_gb=0.25))
    assert tokens == reference
    counters = engine.counters
    assert counters.drafts_proposed > 0
    if mode != "dense":
        assert counters.prediction_recall == pytest.approx(1.0)
        assert counters.blocks_written_back >= 1
    # Everything was given back: pool rows and store memory.
    assert engine.pool.allocator.num_free == engine.pool.num_rows
    assert store.stats().num_requests == 0


@pytest.mark.parametrize("mode", ["sparse-current", "lookahead"])
def test_a_request_whose_every_block_is_a_sink_decodes_as_dense(smollm2_llm, store, prompts, mode):
    """Four sinks hold a 20-token prompt and its 24 tokens: no budget rows, so no summaries were
    read, and the first write-back's summaries raised; the failed step ended every request of
    the worker."""
    short = [p[:20] for p in prompts]
    dense = DecodeConfig(mode="dense", kv_pool_gb=0.25)
    _, expected = run_engine(smollm2_llm, store, short, dense, tag="-sinks-dense")
    engine, tokens = run_engine(smollm2_llm, store, short, dense.model_copy(update={"mode": mode, "sink_blocks": 4}),
                                tag=f"-sinks-{mode}")
    assert tokens == expected
    assert engine.counters.blocks_written_back >= 2
    assert engine.pool.allocator.num_free == engine.pool.num_rows and store.stats().num_requests == 0


def test_a_failed_admission_read_lets_the_request_waiting_for_its_seat_in(smollm2_llm, store, prompts):
    """A request whose first read fails gives its rows back as it ends: the one waiting behind
    it for the only seat is admitted at the next step. The step raised "no request fits the
    device KV pool although it is empty", which failed the waiting request too, and the failed
    one's output was lost with the step (its stream waited for ever)."""
    from oasiskv.kvstore import TransferError

    class FailsReadsOf:
        def __init__(self, client, request_id):
            self.client, self.request_id = client, request_id

        def __getattr__(self, name):
            return getattr(self.client, name)

        def read_blocks(self, request_id, *args, **kwargs):
            if request_id == self.request_id:
                raise TransferError(f"{request_id}'s store failed its read")
            return self.client.read_blocks(request_id, *args, **kwargs)

    config = DecodeConfig(kv_pool_gb=0.25, max_num_seqs=1)
    client = connect(store)
    prefiller = Prefiller(smollm2_llm.model, client)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, FailsReadsOf(client, "failing"), config)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for request_id, prompt in (("failing", prompts[0]), ("waiting", prompts[1])):
        engine.add(prefiller.prefill(request_id, prompt, params, budget_blocks=config.budget_blocks,
                                     excluded_head_blocks=config.sink_blocks, excluded_tail_blocks=config.window_blocks),
                   params)
    ended = {}
    while engine.has_unfinished:
        ended.update({out.request_id: out for out in engine.step() if out.finished or out.error})
    assert "failing's store failed its read" in ended["failing"].error
    assert ended["waiting"].error is None and len(ended["waiting"].token_ids) == 6
    assert engine.pool.allocator.num_free == engine.pool.num_rows and store.stats().num_requests == 0
    engine.close()


def test_the_requests_a_failing_step_had_ended_are_handed_over(smollm2_llm, store, prompts, monkeypatch):
    """They left the engine before the step raised, so abort_all cannot name them."""
    config = DecodeConfig(kv_pool_gb=0.25)
    client = connect(store)
    prefiller = Prefiller(smollm2_llm.model, client)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, config)
    one = SamplingParams(max_tokens=1)
    engine.add(prefiller.prefill("first-token-only", prompts[0][:40], one, budget_blocks=config.budget_blocks,
                                 excluded_head_blocks=config.sink_blocks, excluded_tail_blocks=config.window_blocks), one)
    monkeypatch.setattr(engine, "_join_admitted", lambda wait_s: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    ended = engine.take_ended_before_failure()
    assert [(o.request_id, o.finish_reason) for o in ended] == [("first-token-only", "length")]
    assert engine.take_ended_before_failure() == [] and not engine.has_unfinished
    engine.close()


def test_a_request_ended_by_its_first_token_does_not_wait_for_a_seat(smollm2_llm, store, prompts):
    """max_tokens=1 (or a first token that stops) needs no decoding, seat or rows: it waited
    behind the running request for the only seat, holding its store memory meanwhile."""
    config = DecodeConfig(kv_pool_gb=0.25, max_num_seqs=1)
    client = connect(store)
    prefiller = Prefiller(smollm2_llm.model, client)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, config)

    def prefilled(request_id, prompt, params):
        return prefiller.prefill(request_id, prompt, params, budget_blocks=config.budget_blocks,
                                 excluded_head_blocks=config.sink_blocks, excluded_tail_blocks=config.window_blocks)

    long, one = SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=1)
    engine.add(prefilled("seat-taken", prompts[0], long), long)
    while not engine.running:
        engine.step()
    engine.add(prefilled("one-token", prompts[1][:50], one), one)
    ended = {o.request_id: o for o in engine.step() if o.finished}
    assert ended["one-token"].finish_reason == "length" and len(ended["one-token"].token_ids) == 1
    assert "seat-taken" not in ended and engine.running
    assert store.stats().num_requests == 1  # the one-token request's KV is freed already
    engine.abort("seat-taken")
    engine.settle(5)
    engine.close()
    assert store.stats().num_requests == 0


@pytest.mark.parametrize("mode", [pytest.param("sparse-current", marks=pytest.mark.slow), "lookahead"])
def test_sliding_window_layers_spend_their_budget_on_blocks_they_can_see(sliding_llm, store, prompts, mode):
    """A 256-token budget holds the whole 128-token window of every layer, so sparse attention
    is exact. The selection ranked every block of the context, and kept blocks the position mask
    then hid (on Gemma 3 at this budget, 98% of a local layer's): the tokens differed from
    dense's at the 7th."""
    expected = [o.token_ids for o in sliding_llm.generate(prompts, GREEDY)]
    engine, tokens = run_engine(sliding_llm, store, prompts, DecodeConfig(mode=mode, budget_tokens=256, kv_pool_gb=0.25),
                                tag=f"-sliding-{mode}")
    assert tokens == expected
    assert engine.counters.prediction_recall == pytest.approx(1.0)


def test_plain_decoding_with_k_zero(smollm2_llm, store, prompts, reference):
    engine, tokens = run_engine(smollm2_llm, store, prompts, DecodeConfig(num_draft_tokens=0, kv_pool_gb=0.25), tag="-k0")
    assert tokens == reference
    assert engine.counters.drafts_proposed == 0
    assert engine.counters.steps == GREEDY.max_tokens - 1  # one token per step after the prefill's


@pytest.mark.parametrize("stop, include", [(["liquor"], False), (["liquor"], True), ([" five doz"], False)])
def test_a_stop_string_inside_an_accepted_run_ends_the_output_there(smollm2_llm, store, stop, include):
    """The tokens accepted after a stop string were output and counted (19 tokens against the
    single-process engine's 14), though the text was cut right."""
    passage = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick!\n"
    prompt = smollm2_llm.encode(passage * 3 + "The quick brown")
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=include)
    (expected,) = smollm2_llm.generate([prompt], params)
    engine, (tokens,) = run_engine(smollm2_llm, store, [prompt], DecodeConfig(num_draft_tokens=8, kv_pool_gb=0.25),
                                   params=params, tag=f"-stop{len(stop[0])}{include}")
    assert engine.counters.drafts_accepted > 8  # the repeated passage is drafted in long runs
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 40
    assert tokens == expected.token_ids
    assert engine.counters.generated_tokens == len(tokens) - 1  # the first is the prefill's
    assert store.stats().num_requests == 0


@pytest.mark.parametrize("mode", ["dense", "lookahead"])
def test_token_logprobs_match_the_single_process_engine(smollm2_llm, store, prompts, mode):
    """Each token's logprob comes from the verification row it was chosen from; the prefill's
    token from the prefill's logits."""
    params = dataclasses.replace(GREEDY, logprobs=2)
    (expected,) = smollm2_llm.generate([prompts[0]], params)
    config = DecodeConfig(mode=mode, budget_tokens=2048, kv_pool_gb=0.25)
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, config)
    result = Prefiller(smollm2_llm.model, client).prefill(
        f"logprobs-{mode}", prompts[0], params, budget_blocks=config.budget_blocks,
        excluded_head_blocks=config.sink_blocks, excluded_tail_blocks=config.window_blocks)
    engine.add(result, params)
    tokens, logprobs = [result.first_token], [result.first_logprob]
    while engine.has_unfinished:
        for out in engine.step():
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            tokens += out.new_token_ids
            logprobs += out.logprobs
    assert engine.counters.drafts_accepted > 0  # several tokens came from one verification pass
    assert tokens == expected.token_ids
    assert [e.token_id for e in logprobs] == tokens
    got = torch.tensor([e.logprob for e in logprobs])
    want = torch.tensor([e.logprob for e in expected.logprobs])
    assert (got - want).abs().max().item() < 1e-3
    assert [[t for t, _ in e.top] for e in logprobs] == [[t for t, _ in e.top] for e in expected.logprobs]
    assert all(e.top[0] == (e.token_id, e.logprob) and e.top[0][1] >= e.top[1][1] for e in logprobs)  # greedy


def _repeated_passage(llm) -> list[int]:
    """A passage three times and the start of a fourth: the model wants to repeat it, which
    penalties, biases and min_p change."""
    passage = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick!\n"
    return llm.encode(passage * 3 + "The quick brown")


class _BlindDrafter(DraftModelDrafter):
    """The draft model without the request's logits processing: it proposes what the processing
    rules out, so verification has drafts to reject for it."""

    def propose(self, request_ids, histories, k, params, **_):
        return super().propose(request_ids, histories, k, params)


def _decode_drafting_for_itself(llm, store, prompt: list[int], params: SamplingParams, tag: str, blind: bool = True):
    """The decode engine, 4 drafts a step from the model itself (blind: its drafts see none of the
    request's logits processing): the engine and the request's tokens."""
    model, tok = llm.model, llm.tokenizer
    drafter = (_BlindDrafter if blind else DraftModelDrafter)(model, model.config.vocab_size, tok, tok,
                                                              window_tokens=256, max_chunk=64)
    engine, (tokens,) = run_engine(llm, store, [prompt], DecodeConfig(num_draft_tokens=4, kv_pool_gb=0.25),
                                   params=params, drafter=drafter, tag=tag)
    return engine, tokens


# The slow tests and cases of this file run in CI's slow step, which keeps the default suite well
# under 25 minutes; the API's tests still check penalties and logits processing end to end.
@pytest.mark.slow
@pytest.mark.parametrize("penalties", [{"presence_penalty": 2.0, "frequency_penalty": 2.0}, {"repetition_penalty": 1.3}])
def test_penalized_decoding_matches_the_single_process_engine(smollm2_llm, store, penalties):
    """Each verification row is penalized for the drafts before it, so accepted runs decode as
    one token at a time would."""
    prompt = _repeated_passage(smollm2_llm)
    params = SamplingParams(max_tokens=64, ignore_eos=True, **penalties)
    (expected,) = smollm2_llm.generate([prompt], params)
    assert expected.token_ids != smollm2_llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0].token_ids
    # The model drafting for itself, unpenalized: most drafts still match the penalized choice.
    engine, tokens = _decode_drafting_for_itself(smollm2_llm, store, prompt, params, f"-penalty{len(penalties)}")
    assert engine.counters.drafts_accepted > 8
    assert tokens == expected.token_ids


@pytest.mark.parametrize("case", [pytest.param("repetition_penalty", marks=pytest.mark.slow),
                                  pytest.param("logit_bias", marks=pytest.mark.slow), "min_tokens-12",
                                  pytest.param("allowed_token_ids", marks=pytest.mark.slow),
                                  pytest.param("structured_outputs", marks=pytest.mark.slow)])
def test_a_draft_model_processes_its_logits_as_the_target_does(smollm2_llm, store, case):
    """Drafts from the model itself under the request's penalties, biases, min_tokens and
    structured output (its drafts followed by the spec, and rolled back when rejected) are what
    the target then picks: nearly all accepted, against far fewer from the same model blind to them."""
    if case == "repetition_penalty":
        prompt, params = _repeated_passage(smollm2_llm), SamplingParams(max_tokens=64, ignore_eos=True,
                                                                        repetition_penalty=1.3)
    else:
        prompt, params = _processed_case(smollm2_llm, case)
    (expected,) = smollm2_llm.generate([prompt], params)
    blind, blind_tokens = _decode_drafting_for_itself(smollm2_llm, store, prompt, params, f"-blind-{case}")
    aware, aware_tokens = _decode_drafting_for_itself(smollm2_llm, store, prompt, params, f"-aware-{case}", blind=False)
    assert blind_tokens == aware_tokens == expected.token_ids
    rate = aware.counters.drafts_accepted / aware.counters.drafts_proposed
    assert rate > 0.9 and aware.counters.drafts_accepted > blind.counters.drafts_accepted, (
        rate, blind.counters.drafts_accepted, blind.counters.drafts_proposed)


def _processed_case(llm, case: str) -> tuple[list[int], SamplingParams]:
    """A prompt and the parameters whose processing changes its output (checked by the test)."""
    repeated = _repeated_passage(llm)
    if case == "logit_bias":  # bans two words of the passage, and leans to another
        bias = {llm.encode(" fox")[0]: -100, llm.encode(" dozen")[0]: -100, llm.encode(" cat")[0]: 4}
        return repeated, SamplingParams(max_tokens=64, ignore_eos=True, logit_bias=bias)
    if case == "allowed_token_ids":  # the passage's own tokens but two of its words
        banned = {llm.encode(" fox")[0], llm.encode(" dozen")[0]}
        return repeated, SamplingParams(max_tokens=64, ignore_eos=True, allowed_token_ids=sorted(set(repeated) - banned))
    if case == "bad_words":  # a word of one token and one of two, each where drafts propose it
        words = ["fox", "five dozen"]
        sequences = tokenize_bad_words(words, lambda text: llm.tokenizer.encode(text, add_special_tokens=False))
        return repeated, SamplingParams(max_tokens=64, ignore_eos=True, bad_words=words, bad_words_token_ids=sequences)
    if case == "structured_outputs":  # JSON where the model would answer in prose: blind drafts are refused
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a large city and its population."}])
        schema = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
                  "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}
        return prompt, SamplingParams(max_tokens=64, structured_outputs={"json": schema})
    if case.startswith("min_tokens"):  # the model says "Yes." and ends, with EOS as soon as it may
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}])
        return prompt, SamplingParams(max_tokens=60, min_tokens=int(case.split("-")[1]))
    # min_p 1 at temperature 1 keeps the most likely token alone: the output is deterministic.
    return repeated, SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0, min_p=1.0, seed=5)


@pytest.mark.parametrize("case", [pytest.param("logit_bias", marks=pytest.mark.slow), "min_tokens-12",
                                  "min_tokens-30", pytest.param("min_p", marks=pytest.mark.slow),
                                  "allowed_token_ids", "bad_words", "structured_outputs"])
def test_min_p_min_tokens_and_logit_bias_decode_as_the_single_process_engine(smollm2_llm, store, case):
    """Verification processes each draft row for its own output position (min_tokens bans EOS
    only on the rows before it), and the prefill's first token too; the drafts come from the
    model itself, unprocessed, so they propose what the processing rules out."""
    prompt, params = _processed_case(smollm2_llm, case)
    (expected,) = smollm2_llm.generate([prompt], params)
    unprocessed = dataclasses.replace(params, logit_bias={}, min_tokens=0, min_p=0.0, allowed_token_ids=None,
                                      bad_words=[], bad_words_token_ids=[], structured_outputs=None)
    assert expected.token_ids != smollm2_llm.generate([prompt], unprocessed)[0].token_ids
    if case.startswith("min_tokens"):
        assert expected.finish_reason == "stop" and len(expected.token_ids) > params.min_tokens
    engine, tokens = _decode_drafting_for_itself(smollm2_llm, store, prompt, params, f"-{case}")
    assert engine.counters.drafts_accepted > 4
    assert tokens == expected.token_ids
    assert store.stats().num_requests == 0


def test_small_budget_fetches_only_the_predicted_blocks(smollm2_llm, store, prompts):
    config = DecodeConfig(mode="lookahead", budget_tokens=160, kv_pool_gb=0.25)
    engine, tokens = run_engine(smollm2_llm, store, prompts, config, tag="-small")
    counters = engine.counters
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    assert 0.0 < counters.prediction_recall < 1.0
    assert counters.prefetch_hits + counters.prefetch_misses > 0
    # Admission moved a working set, not the whole prompt: far less than the full KV.
    full_kv = sum(len(p) for p in prompts) / 16 * engine.layout.num_layers * engine.layout.num_kv_heads * engine.layout.unit_bytes
    assert counters.admission_bytes_fetched < 0.5 * full_kv
    # The key summaries of every prompt block came as 8-bit codes (the default), with each
    # request's per-channel ranges (two float32 numbers a channel).
    layout = engine.layout
    blocks = sum(-(-len(p) // layout.block_size) for p in prompts)
    channels = layout.num_layers * layout.num_kv_heads * 2 * layout.head_dim
    assert counters.summary_bytes_fetched == blocks * channels + len(prompts) * channels * 8
    assert engine.pool.allocator.num_free == engine.pool.num_rows


@pytest.mark.slow
def test_uint8_summaries_move_a_quarter_and_rank_as_the_values_do(smollm2_llm, store, prompts, reference):
    """Summaries read as 8-bit codes: with a budget covering the context, lookahead still emits
    dense's tokens; with a small one it fetches by its prediction, the summaries moved are a
    quarter of float32's (plus each channel's range) and every held block's codes, on the
    request's ranges (widened for the written-back blocks where they needed it), decode to a box
    around the store's own summaries, within five of its channel's steps (`SummaryPages._widen`)."""
    full = DecodeConfig(mode="lookahead", budget_tokens=2048, kv_pool_gb=0.25, summary_read_dtype="uint8")
    engine, tokens = run_engine(smollm2_llm, store, prompts, full, tag="-uint8-full")
    assert tokens == reference
    config = DecodeConfig(mode="lookahead", budget_tokens=160, kv_pool_gb=0.25, summary_read_dtype="uint8")
    engine, tokens = run_engine(smollm2_llm, store, prompts, config, tag="-uint8-small")
    counters, layout = engine.counters, engine.layout
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    assert 0.0 < counters.prediction_recall < 1.0 and counters.blocks_fetched > 0
    blocks = sum(-(-len(p) // layout.block_size) for p in prompts)
    channels = layout.num_layers * layout.num_kv_heads * 2 * layout.head_dim
    assert counters.summary_bytes_fetched == blocks * channels + len(prompts) * channels * 8

    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, config)
    result = Prefiller(smollm2_llm.model, client).prefill(
        "uint8-write-back", prompts[0], budget_blocks=config.budget_blocks, excluded_head_blocks=config.sink_blocks,
        excluded_tail_blocks=config.window_blocks)
    engine.add(result, SamplingParams(max_tokens=64, ignore_eos=True))
    try:
        while engine.counters.blocks_written_back < 2:
            engine.step()
        pages = engine.running[0].summaries
        assert pages.quantized and pages.blocks().dtype == torch.uint8
        for write_back in engine.running[0].write_backs:
            write_back.handle.wait()
        stored = client.read_summaries("uint8-write-back", dtype="float32")[:, :, : pages.num_blocks]
        held = pages.dequantized()
        step = pages.step.unsqueeze(2)
        assert (held[..., 0, :] <= stored[..., 0, :] + 1e-6).all() and (held[..., 1, :] >= stored[..., 1, :] - 1e-6).all()
        assert ((held - stored).abs() <= 5 * step + 1e-6).all()
    finally:
        engine.abort("uint8-write-back")
        engine.close()
    assert store.stats().num_requests == 0


@pytest.mark.slow
def test_lookahead_topped_up_to_the_whole_budget_attends_as_sparse_current(smollm2_llm, store, prompts):
    """A top-up as large as the budget fetches every block of the current query's top-K that the
    prediction missed before attending: the attended set is sparse-current's, so are the tokens."""
    small = dict(budget_tokens=160, kv_pool_gb=0.25)
    _, current = run_engine(smollm2_llm, store, prompts, DecodeConfig(mode="sparse-current", **small), tag="-topup-ref")
    pure, predicted = run_engine(smollm2_llm, store, prompts, DecodeConfig(mode="lookahead", **small), tag="-topup0")
    config = DecodeConfig(mode="lookahead", lookahead_topup_blocks=160 // 16, **small)
    topped, tokens = run_engine(smollm2_llm, store, prompts, config, tag="-topup")
    assert tokens == current
    assert topped.counters.blocks_fetched > pure.counters.blocks_fetched  # the top-up fetched on demand
    assert topped.pool.allocator.num_free == topped.pool.num_rows


def test_sparse_current_counts_its_fetches_as_on_demand_not_as_prefetches(smollm2_llm, store, prompts):
    engine, _ = run_engine(smollm2_llm, store, prompts, DecodeConfig(mode="sparse-current", budget_tokens=160, kv_pool_gb=0.25),
                     tag="-ondemand")
    c = engine.counters
    assert c.blocks_fetched > 0
    assert c.prefetch_hits == c.prefetch_misses == c.prefetch_waits == 0  # it never prefetches
    assert c.on_demand_waits <= c.steps * engine.layout.num_layers  # at most one wait per layer and step
    assert "on_demand_waits" in c.snapshot()


@pytest.mark.slow
def test_a_shallow_prefetch_depth_fetches_fewer_blocks(smollm2_llm, store, prompts):
    """prefetch_rank_fraction: only blocks the prediction ranks near the top are worth a transfer;
    the rest of the top-K is kept when resident. Same prompts, same budget: fewer blocks move."""
    small = dict(mode="lookahead", budget_tokens=160, kv_pool_gb=0.25)
    full, _ = run_engine(smollm2_llm, store, prompts, DecodeConfig(prefetch_rank_fraction=1.0, **small), tag="-depth1")
    shallow, tokens = run_engine(smollm2_llm, store, prompts, DecodeConfig(prefetch_rank_fraction=0.2, **small), tag="-depth")
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    assert 0 < shallow.counters.blocks_fetched < full.counters.blocks_fetched
    assert shallow.pool.allocator.num_free == shallow.pool.num_rows


def test_grouped_selection_fetches_and_decodes_as_per_layer_selection(smollm2_llm, store, prompts):
    """lookahead_layer_group: the draft rows of several layers are ranked together after the
    group's last layer. The ranking inputs are the same, so are the plans: the same blocks move,
    the same tokens come out, the same recall is counted, in fewer I/O jobs. 4 does not divide
    SmolLM2's 30 layers, so the last group is a short one."""
    small = dict(mode="lookahead", budget_tokens=160, kv_pool_gb=0.25)
    runs = {}
    for group in (1, 4):
        jobs = []

        def counting(read_many):
            def wrapper(reads):
                jobs.append({layer for _, layer, *_ in reads})
                return read_many(reads)
            return wrapper

        def count_jobs(engine):
            engine.client.read_many = counting(engine.client.read_many)

        engine, tokens = run_engine(smollm2_llm, store, prompts, DecodeConfig(lookahead_layer_group=group, **small),
                                    tag=f"-group{group}", prepare=count_jobs)
        runs[group] = (engine.counters, tokens, jobs)
    (per_layer, tokens_1, jobs_1), (grouped, tokens_4, jobs_4) = runs[1], runs[4]
    assert tokens_4 == tokens_1
    assert grouped.blocks_fetched == per_layer.blocks_fetched > 0
    assert grouped.recall_samples == per_layer.recall_samples > 0
    assert grouped.prediction_recall == pytest.approx(per_layer.prediction_recall)
    assert max(len(layers) for layers in jobs_1) == 1
    assert max(len(layers) for layers in jobs_4) == 4
    assert all(len({layer // 4 for layer in layers}) == 1 for layers in jobs_4)  # one group per job
    assert any(max(layers) == smollm2_llm.model.config.num_layers - 1 for layers in jobs_4)
    assert len(jobs_4) < len(jobs_1)


@pytest.mark.parametrize("kind", ["minmax", "moments"])
def test_write_back_summarizes_as_the_prompt_was(smollm2_llm, store, prompts, kind):
    """The node summarizes the blocks it writes back itself (no read from the store) with the
    summary kind the prompt's layout names, so both agree with the store; the ranking uses that
    kind's radius weight. (Summaries read as bfloat16 values, which the store narrows bit for bit
    as the node does; uint8 codes depend on the range they are coded over.)"""
    client = connect(store)
    config = DecodeConfig(mode="lookahead", budget_tokens=160, kv_pool_gb=0.25, summary_read_dtype="bfloat16")
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, config)
    request_id = f"write-back-{kind}"
    result = Prefiller(smollm2_llm.model, client, summary_kind=kind).prefill(
        request_id, prompts[0], budget_blocks=config.budget_blocks, excluded_head_blocks=config.sink_blocks,
        excluded_tail_blocks=config.window_blocks)
    assert result.layout.summary_kind == kind
    engine.add(result, SamplingParams(max_tokens=64, ignore_eos=True))
    try:
        while engine.counters.blocks_written_back < 2:
            engine.step()
        req = engine.running[0]
        assert engine._radius_weight(req) == ranking_radius_weight(kind)
        prompt_blocks = len(prompts[0]) // 16  # 640 tokens: whole blocks only
        written = req.summaries.blocks(prompt_blocks)  # held in the pool as read: bf16, narrowed as the store does
        assert written.shape[2] >= 2 and written.dtype == torch.bfloat16
        for write_back in req.write_backs:  # the store summarizes a block once its write has landed
            write_back.handle.wait()
        stored = client.read_summaries(request_id, first_block=prompt_blocks, num_blocks=written.shape[2],
                                       dtype=config.summary_read_dtype)
        assert torch.equal(written, stored)
    finally:
        engine.abort(request_id)
    assert engine.settle(10)  # an abort does not wait for the store's free
    assert store.stats().num_requests == 0


@pytest.mark.parametrize("catch_up_budget", [pytest.param(None, marks=pytest.mark.slow), 0])
def test_self_drafting_model_matches_and_is_accepted(smollm2_llm, store, prompts, reference, catch_up_budget):
    """With budget 0 every request catches up one chunk a step, verifying one row meanwhile."""
    model, tok = smollm2_llm.model, smollm2_llm.tokenizer
    drafter = DraftModelDrafter(model, model.config.vocab_size, tok, tok, window_tokens=256, max_chunk=64,
                                catch_up_budget=catch_up_budget)
    engine, tokens = run_engine(smollm2_llm, store, prompts, DecodeConfig(kv_pool_gb=0.25), drafter=drafter,
                          tag=f"-draft{catch_up_budget}")
    assert tokens == reference
    assert engine.counters.acceptance_rate > 0.5  # the same model drafting, with a bounded window
    assert not drafter.states  # released with their requests


def test_drafter_with_another_vocabulary_is_refused(smollm2_llm):
    model = smollm2_llm.model
    with pytest.raises(DrafterMismatch, match="vocabulary"):
        DraftModelDrafter(model, model.config.vocab_size + 1000)


def test_a_request_id_already_in_the_engine_is_refused(smollm2_llm, store):
    """Two requests under one id would share one store request: the first to finish frees it and
    the other fails in the middle of a step."""
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, DecodeConfig(kv_pool_gb=0.1, budget_tokens=64))
    try:
        prefill = Prefiller(smollm2_llm.model, client).prefill("twice", smollm2_llm.encode("def add(a, b):" * 20))
        engine.add(prefill, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="'twice' is already in this engine"):
            engine.add(prefill, SamplingParams(max_tokens=4))
        assert len(engine.run_to_completion()["twice"].token_ids) == 4
    finally:
        engine.close()


def test_a_first_token_its_structured_output_refuses_ends_that_request_alone(smollm2_llm, store):
    """A first token not chosen under the request's spec (a prefill that was not given it) cannot
    go on under it: the request ends with an error naming it, its store memory is given back, and
    the engine goes on."""
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, DecodeConfig(kv_pool_gb=0.1, budget_tokens=64))
    try:
        prefill = Prefiller(smollm2_llm.model, client).prefill("free-first", smollm2_llm.encode("def add(a, b):" * 20))
        engine.add(prefill, SamplingParams(max_tokens=4, structured_outputs={"choice": ["zzzz"]}))
        (out,) = engine.run_to_completion().values()
        assert out.finish_reason is None and "does not follow the request's structured_outputs" in out.error
        assert store.stats().num_requests == 0
    finally:
        engine.close()


def test_a_request_whose_spec_compiles_waits_while_the_batch_goes_on(smollm2_llm, store):
    """A spec takes seconds to compile (Qwen's vocabulary: a string's maxLength of 500 took 6 s):
    on the decode loop it stopped every request. The request waits for its compile; the free one
    behind it decodes meanwhile; then it decodes under its spec."""
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, DecodeConfig(kv_pool_gb=0.1, budget_tokens=64))
    prefiller = Prefiller(smollm2_llm.model, client, tokenizer=smollm2_llm.tokenizer)
    spec = {"json": {"type": "string", "maxLength": 40}}
    compile_may_end = threading.Event()  # the compile lasts until the free request has decoded
    compile_grammar = engine._compile_grammar
    engine._compile_grammar = lambda *args: compile_may_end.wait(30) and compile_grammar(*args)
    try:
        prompt = smollm2_llm.encode('Say "hi" as a JSON string: ')
        # The prefill (in this process, whose compiler would then have it) gives the string's quote alone.
        quote = smollm2_llm.tokenizer.encode('"', add_special_tokens=False)
        first = prefiller.prefill("structured", prompt, SamplingParams(max_tokens=12, allowed_token_ids=quote))
        engine.add(first, SamplingParams(max_tokens=12, structured_outputs=spec))
        free = prefiller.prefill("free", smollm2_llm.encode("def add(a, b):"), SamplingParams(max_tokens=12))
        engine.add(free, SamplingParams(max_tokens=12))
        decoded_while_compiling, final = 0, {}
        while "free" not in final:
            for out in engine.step():
                decoded_while_compiling += len(out.new_token_ids) if out.request_id == "free" else 0
                final.update({out.request_id: out} if out.finished else {})
            assert any(r.request_id == "structured" for r in engine.waiting)
        assert decoded_while_compiling == 11  # all but the prefill's first token
        compile_may_end.set()
        final.update(engine.run_to_completion())
        text = final["structured"].text
        assert final["structured"].error is None and text.startswith('"')
        assert isinstance(json.loads(text), str) if final["structured"].finish_reason == "stop" else '"' not in text[1:]
        free_alone = smollm2_llm.generate([smollm2_llm.encode("def add(a, b):")], SamplingParams(max_tokens=12))[0]
        assert final["free"].token_ids == free_alone.token_ids
    finally:
        engine.close()


def test_a_request_whose_spec_still_compiles_can_be_aborted_or_time_out(smollm2_llm, store):
    """A compile cannot be stopped once it runs: the request it was for is aborted, or fails
    past its deadline, and gives its store memory back; nothing is left waiting."""
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, DecodeConfig(kv_pool_gb=0.1, budget_tokens=64))
    prefiller = Prefiller(smollm2_llm.model, client, tokenizer=smollm2_llm.tokenizer)
    compile_may_end = threading.Event()
    compile_grammar = engine._compile_grammar
    engine._compile_grammar = lambda *args: compile_may_end.wait(30) and compile_grammar(*args)
    spec = {"regex": "[a-z ]{1,30}"}
    try:
        for name in ("aborted", "late"):
            first = prefiller.prefill(name, smollm2_llm.encode("hello"), SamplingParams(max_tokens=8, structured_outputs=spec))
            engine.add(first, SamplingParams(max_tokens=8, structured_outputs=spec))
        engine.step()
        engine.abort("aborted")
        next(r for r in engine.waiting if r.request_id == "late").grammar_deadline = 0.0
        (late,) = [o for o in engine.step() if o.finished]
        assert late.request_id == "late" and "took over 30 s to compile on this worker" in late.error
        assert not engine.has_unfinished
        engine.settle(5.0)
        assert store.stats().num_requests == 0
    finally:
        compile_may_end.set()
        engine.close()


def test_a_prefill_of_another_kv_layout_is_refused_by_name(smollm2_llm, store):
    """A 32-token-block or bf16 prefill decoded by this 16-token-block fp32 engine output garbage
    (or failed as BlockOutOfRange) without naming why."""
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, DecodeConfig(kv_pool_gb=0.1, budget_tokens=64))
    prompt = smollm2_llm.encode("def add(a, b):" * 20)
    try:
        wide_store = KVStore(32 * 2**20, block_size=32)  # the store refuses a layout of another block size
        wide = Prefiller(smollm2_llm.model, connect(wide_store), block_size=32).prefill("wide", prompt)
        with pytest.raises(ValueError, match=r"another layout: block_size 32 \(this engine: 16\)"):
            engine.add(wide, SamplingParams(max_tokens=4))
        prefill = Prefiller(smollm2_llm.model, client).prefill("narrow", prompt)
        relabelled = dataclasses.replace(prefill, layout=dataclasses.replace(prefill.layout, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"dtype torch.bfloat16 \(this engine: torch.float32\)"):
            engine.add(relabelled, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="stop_token_ids must be in"):
            engine.add(prefill, SamplingParams(max_tokens=4, stop_token_ids=[10**9]))
        other_kind = "minmax" if prefill.layout.summary_kind != "minmax" else "moments"
        # The summary kind is each request's own, not the engine's.
        engine.add(dataclasses.replace(prefill, layout=dataclasses.replace(prefill.layout, summary_kind=other_kind)),
                   SamplingParams(max_tokens=4))
        assert len(engine.run_to_completion()["narrow"].token_ids) == 4
        assert store.stats().num_requests == 0
    finally:
        engine.close()


def test_a_request_past_the_models_context_is_refused_by_name(smollm2_llm, store):
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, DecodeConfig(kv_pool_gb=0.1))
    prefiller = Prefiller(smollm2_llm.model, client)
    context = smollm2_llm.model.config.max_position_embeddings
    try:
        prefill = prefiller.prefill("long-output", smollm2_llm.encode("x = 1\n" * 10))
        try:  # named as the context, before the pool is asked
            with pytest.raises(RequestTooLarge, match=f"exceeds the model's context of {context} tokens"):
                engine.add(prefill, SamplingParams(max_tokens=context))
        finally:
            client.free("long-output")
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        prefiller.prefill("bad-token", [1, smollm2_llm.model.config.vocab_size])
    with pytest.raises(ValueError, match="no room in the model's context"):
        prefiller.prefill("too-long", [1] * context)
    for refused in ("bad-token", "too-long"):  # refused before the store was asked for anything
        with pytest.raises(UnknownRequest):
            client.free(refused)


def test_prompt_larger_than_the_store_is_refused_cleanly(smollm2_llm):
    tiny_store = KVStore(4 * 2**20)
    client = connect(tiny_store)
    prompt = smollm2_llm.encode(stdlib_source("typing.py"))[:4000]
    with pytest.raises(StoreFull):
        Prefiller(smollm2_llm.model, client).prefill("too-big", prompt)
    assert tiny_store.stats().num_requests == 0


def test_request_larger_than_the_pool_is_refused(smollm2_llm, store, prompts):
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, DecodeConfig(mode="dense", kv_pool_gb=0.002))
    result = Prefiller(smollm2_llm.model, client).prefill("no-room", prompts[0])
    try:
        with pytest.raises(RequestTooLarge, match="device KV pool"):
            engine.add(result, GREEDY)
    finally:
        client.free("no-room")


def test_bad_per_request_overrides_are_refused(smollm2_llm, store, prompts):
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, DecodeConfig(kv_pool_gb=0.25))
    result = Prefiller(smollm2_llm.model, client).prefill("bad-override", prompts[0])
    try:
        with pytest.raises(ValueError, match="mode must be"):
            engine.add(result, GREEDY, mode="sparse")
        for budget in (0, 100, 32.0):  # a float failed later, in range()
            with pytest.raises(ValueError, match="budget_tokens must be a positive multiple of 16"):
                engine.add(result, GREEDY, budget_tokens=budget)
        assert not engine.waiting
    finally:
        engine.close()
        client.free("bad-override")
    assert store.stats().num_requests == 0


def test_a_request_that_ends_at_its_first_token_never_takes_pool_rows(smollm2_llm, store, prompts):
    """max_tokens=1: the prefill's token is the whole output; admission gives the store's KV back
    without fetching anything."""
    client = connect(store)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, DecodeConfig(kv_pool_gb=0.25))
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    result = Prefiller(smollm2_llm.model, client).prefill("one-token", prompts[0], one)
    engine.add(result, one)
    outputs = engine.run_to_completion()
    assert outputs["one-token"].token_ids == [result.first_token]
    assert outputs["one-token"].finish_reason == "length"
    assert engine.counters.steps == 0 and engine.counters.admission_bytes_fetched == 0
    assert store.stats().num_requests == 0
    engine.close()


def test_aborting_a_waiting_request_frees_its_store_memory(smollm2_llm, store, prompts):
    """The pool holds one request; the second waits, and aborting it gives its KV back."""
    client = connect(store)
    config = DecodeConfig(mode="dense", kv_pool_gb=0.25)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, config)
    prefiller = Prefiller(smollm2_llm.model, client)
    rows = engine.row_plan(len(prompts[0]), GREEDY.max_tokens).total
    engine.pool.allocator.allocate(engine.pool.num_rows - rows)  # room for exactly one request
    for i in range(2):
        engine.add(prefiller.prefill(f"abort-waiting-{i}", prompts[0], GREEDY), GREEDY)
    engine.step()
    assert [r.request_id for r in engine.running] == ["abort-waiting-0"]
    assert [r.request_id for r in engine.waiting] == ["abort-waiting-1"]
    engine.abort("abort-waiting-1")
    assert engine.settle(10)  # an abort does not wait for the store's free
    assert not engine.waiting and store.stats().num_requests == 1
    engine.abort("abort-waiting-0")
    assert engine.settle(10)
    assert not engine.running and store.stats().num_requests == 0
    engine.close()


def test_config_validates_early():
    with pytest.raises(ValueError, match="multiple of block_size"):
        DecodeConfig(budget_tokens=100)
    with pytest.raises(ValueError):
        DecodeConfig(mode="sparse")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        DecodeConfig(num_draft_tokens=16)
    with pytest.raises(ValueError, match="summary_read_dtype"):
        DecodeConfig(summary_read_dtype="float16")
    with pytest.raises(ValueError, match="prefetch_rank_fraction"):
        DecodeConfig(prefetch_rank_fraction=0)
    with pytest.raises(ValueError, match="lookahead_layer_group"):
        DecodeConfig(lookahead_layer_group=0)
    with pytest.raises(ValueError, match="draft_window_tokens"):
        DecodeConfig(draft_window_tokens=8)
    with pytest.raises(ValueError, match="draft_catch_up_budget"):
        DecodeConfig(draft_catch_up_budget=-1)
    with pytest.raises(ValueError, match="budget_token\n.*Extra inputs are not permitted"):  # ran as the default 2048
        DecodeConfig(budget_token=64)
    with pytest.raises(ValueError, match="kv_pool_gb\n.*finite"):  # overflowed in the engine
        DecodeConfig(kv_pool_gb=float("inf"))
    with pytest.raises(ValueError, match="drafter\n"):  # was taken for a model in the current folder
        DecodeConfig(drafter="")
