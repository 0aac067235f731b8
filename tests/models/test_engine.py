"""The continuous-batching engine on a real model: batching must not change results, and bad
requests fail with errors that say what is wrong."""

from __future__ import annotations

import pytest

from oasiskv.models.engine.llm import EmptyPromptError
from oasiskv.models.engine.scheduler import RequestTooLarge
from oasiskv.models.sampling import SamplingParams

from ..conftest import stdlib_source


def _prompts(llm, count: int) -> list[list[int]]:
    ids = llm.encode(stdlib_source("typing.py"))
    # Different lengths, crossing block boundaries in different places.
    return [ids[i * 211 : i * 211 + 20 + 13 * i] for i in range(count)]


def test_batched_decode_equals_each_sequence_alone(smollm2_llm):
    prompts = _prompts(smollm2_llm, 8)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    batched = smollm2_llm.generate(prompts, params)
    alone = [smollm2_llm.generate([p], params)[0] for p in prompts]
    assert len({len(p) for p in prompts}) == 8
    for b, a in zip(batched, alone):
        assert b.token_ids == a.token_ids
        assert len(b.token_ids) == 24


def test_chunked_prefill_equals_single_chunk(smollm2_llm, smollm2_dir):
    from oasiskv.models.engine import LLM

    chunked = LLM.from_model(smollm2_llm.model, smollm2_llm.tokenizer, max_num_batched_tokens=64, kv_cache_gb=0.1)
    prompt = smollm2_llm.encode(stdlib_source("argparse.py"))[:300]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert chunked.generate([prompt], params)[0].token_ids == smollm2_llm.generate([prompt], params)[0].token_ids


def test_preemption_under_a_tiny_cache_keeps_results(smollm2_llm):
    from oasiskv.models.engine import LLM

    # 6 blocks of 16 tokens: three 40-token requests cannot all grow at once.
    tiny = LLM.from_model(smollm2_llm.model, smollm2_llm.tokenizer, kv_cache_gb=6 * smollm2_llm.cache.spec.bytes_per_block / 2**30)
    assert tiny.cache.num_blocks == 6
    prompts = _prompts(smollm2_llm, 3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = [smollm2_llm.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in tiny.generate(prompts, params)] == expected


def test_stop_strings_and_max_tokens(smollm2_llm):
    out = smollm2_llm.generate("def add(a, b):", SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    # Stop on a string that the greedy continuation is known to contain.
    stop = out.text[5:9]
    assert stop.strip()
    cut = smollm2_llm.generate("def add(a, b):", SamplingParams(max_tokens=40, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and out.text.startswith(cut.text)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(smollm2_llm):
    hot = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    first = smollm2_llm.generate("Once upon a time", hot)[0].token_ids
    again = smollm2_llm.generate("Once upon a time", hot)[0].token_ids
    other = smollm2_llm.generate(
        "Once upon a time", SamplingParams(max_tokens=20, temperature=1.0, seed=8, ignore_eos=True)
    )[0].token_ids
    assert first == again
    assert first != other


def test_empty_prompt_is_refused(smollm2_llm):
    with pytest.raises(EmptyPromptError, match="empty"):
        smollm2_llm.generate("")
    with pytest.raises(EmptyPromptError):
        smollm2_llm.generate([[]])


def test_prompt_longer_than_context_is_refused(smollm2_llm):
    too_long = [100] * (smollm2_llm.max_model_len + 1)
    with pytest.raises(RequestTooLarge, match="context"):
        smollm2_llm.generate([too_long], SamplingParams(max_tokens=1))
    assert not smollm2_llm.has_unfinished


def test_out_of_vocabulary_token_ids_are_refused(smollm2_llm):
    with pytest.raises(ValueError, match="out of range"):
        smollm2_llm.generate([[1, 2, smollm2_llm.model.config.vocab_size]])


def test_request_bigger_than_the_cache_is_refused(smollm2_llm):
    from oasiskv.models.engine import LLM

    small = LLM.from_model(smollm2_llm.model, smollm2_llm.tokenizer, kv_cache_gb=4 * smollm2_llm.cache.spec.bytes_per_block / 2**30)
    with pytest.raises(RequestTooLarge, match="KV blocks"):
        small.generate([[5] * 100], SamplingParams(max_tokens=1))


def test_abort_frees_blocks(smollm2_llm):
    free_before = smollm2_llm.cache.allocator.num_free
    rid = smollm2_llm.add_request("hello there", SamplingParams(max_tokens=50))
    smollm2_llm.step()
    assert smollm2_llm.cache.allocator.num_free < free_before
    smollm2_llm.abort(rid)
    assert smollm2_llm.cache.allocator.num_free == free_before
    assert not smollm2_llm.has_unfinished


def test_an_unknown_engine_option_or_an_empty_model_name_is_refused():
    """A misspelled option (kv_cache_gbb) was dropped without a word, and LLM("") loaded the
    default model: vLLM refuses both."""
    from pydantic import ValidationError

    from oasiskv.models.engine import LLM

    with pytest.raises(ValidationError, match="kv_cache_gbb"):
        LLM("smollm2-135m", kv_cache_gbb=0.01)
    for name in ("", "  "):
        with pytest.raises(ValueError, match="model must be a registry name"):
            LLM(name)


def test_misused_generate_and_chat_name_the_problem(smollm2_llm):
    """They raised what the internals tripped on ('NoneType' object is not iterable, a dict with
    no attribute max_tokens, jinja2's UndefinedError)."""
    with pytest.raises(TypeError, match="prompts must be"):
        smollm2_llm.generate(None, SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        smollm2_llm.generate(["a"], {"max_tokens": 2})
    with pytest.raises(ValueError, match="conversation 0: the chat template failed"):
        smollm2_llm.chat([[{"role": "user"}]], SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="conversation 0 must be a list"):
        smollm2_llm.chat("hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="stop_token_ids must be in"):  # it never stopped: ran to max_tokens
        smollm2_llm.generate(["a"], SamplingParams(max_tokens=2, stop_token_ids=[10**9]))
    assert not smollm2_llm.has_unfinished
    assert len(smollm2_llm.generate(["a"], SamplingParams(max_tokens=2, stop=None))[0].token_ids) == 2


def test_a_bad_prompt_later_in_a_batch_leaves_no_request_behind(smollm2_llm):
    with pytest.raises(EmptyPromptError):
        smollm2_llm.generate(["def f(x):", ""], SamplingParams(max_tokens=4))
    assert not smollm2_llm.has_unfinished  # the first one was aborted, not left to the next call
    out = smollm2_llm.generate(["def g(y):"], SamplingParams(max_tokens=4))
    assert len(out) == 1 and len(out[0].token_ids) == 4


def test_a_max_model_len_beyond_the_models_context_is_refused(smollm2_llm):
    from oasiskv.models.engine import LLM

    with pytest.raises(ValueError, match="longer than the model's context"):
        LLM.from_model(smollm2_llm.model, smollm2_llm.tokenizer, kv_cache_gb=0.01, max_model_len=10**7)


def test_logit_bias_forces_or_bans_tokens_and_leaves_the_logprobs_raw(smollm2_llm):
    """+100 makes greedy decoding pick that token every time, -100 never; a request beside them
    in the batch is unchanged. The logprobs stay the model's raw ones, as with the penalties."""
    prompt = smollm2_llm.encode("def fibonacci(n):")
    plain = smollm2_llm.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids
    forced_id = smollm2_llm.encode(" banana")[0]
    forced, banned, beside = smollm2_llm.generate([prompt] * 3, [
        SamplingParams(max_tokens=8, logit_bias={forced_id: 100}, logprobs=1),
        SamplingParams(max_tokens=8, logit_bias={str(plain[0]): -100}),
        SamplingParams(max_tokens=8)])
    assert forced.token_ids == [forced_id] * 8
    assert banned.token_ids[0] != plain[0] and plain[0] not in banned.token_ids
    assert beside.token_ids == plain
    first = forced.logprobs[0]
    assert first.token_id == forced_id and first.top[0][0] == plain[0] and first.logprob < first.top[0][1]


def test_allowed_token_ids_decode_as_a_bias_that_lifts_them_over_every_other(smollm2_llm):
    """Greedy decoding over the allowed tokens alone picks, at each step, what +100 on each of them
    picks (a shift that leaves their order and puts them above the rest: raw logits span less
    than 100): the same tokens by another path."""
    prompt = smollm2_llm.encode("Is the sky blue? Answer yes or no:")
    allowed = sorted({smollm2_llm.encode(word)[0] for word in (" yes", " no", " maybe", ".", " sky")})
    plain = smollm2_llm.generate([prompt], SamplingParams(max_tokens=10))[0].token_ids
    restricted, lifted = smollm2_llm.generate([prompt] * 2, [
        SamplingParams(max_tokens=10, allowed_token_ids=allowed),
        SamplingParams(max_tokens=10, logit_bias={t: 100 for t in allowed})])
    assert set(restricted.token_ids) <= set(allowed) and not set(plain) <= set(allowed)
    assert restricted.token_ids == lifted.token_ids


def test_bad_words_keep_words_out_of_the_output(smollm2_llm):
    """A passage the model repeats. Banning "fox" (one token, with and without its space) gives
    what a -100 bias on those tokens gives (raw logits span less than 100): the same ban by
    another path. Banning "lazy dog" (two tokens) changes the output only where " dog" would
    follow " lazy". The ban is on tokens, as in vLLM's: " lazy dogs" (another token) may follow."""
    passage = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    prompt = smollm2_llm.encode(passage * 3 + "The quick")
    free = dict(max_tokens=40, ignore_eos=True)
    plain = smollm2_llm.generate([prompt], SamplingParams(**free))[0]
    assert "fox" in plain.text and "lazy dog" in plain.text
    fox = [smollm2_llm.tokenizer.encode(word, add_special_tokens=False)[0] for word in ("fox", " fox")]
    no_fox, biased = smollm2_llm.generate([prompt] * 2, [SamplingParams(**free, bad_words=["fox"]),
                                                         SamplingParams(**free, logit_bias={t: -100 for t in fox})])
    assert "fox" not in no_fox.text and no_fox.token_ids == biased.token_ids
    lazy, dog = (smollm2_llm.tokenizer.encode(word, add_special_tokens=False)[0] for word in (" lazy", " dog"))
    out = smollm2_llm.generate([prompt], SamplingParams(**free, bad_words=["lazy dog"]))[0]
    at = next(i for i in range(1, len(plain.token_ids)) if plain.token_ids[i - 1 : i + 1] == [lazy, dog])
    assert out.token_ids[:at] == plain.token_ids[:at] and out.token_ids[at] != dog
    assert all(out.token_ids[i - 1 : i + 1] != [lazy, dog] for i in range(1, len(out.token_ids)))


def test_min_tokens_holds_off_eos_and_stop_tokens(smollm2_llm):
    """The model answers "Yes." and ends; with min_tokens it goes on, and ends with EOS as soon
    as it may."""
    prompt = smollm2_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}])
    eos = smollm2_llm.eos_token_ids
    plain = smollm2_llm.generate([prompt], SamplingParams(max_tokens=60))[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 5 and plain.token_ids[-1] in eos
    for min_tokens in (12, 30):
        out = smollm2_llm.generate([prompt], SamplingParams(max_tokens=60, min_tokens=min_tokens))[0]
        assert out.finish_reason == "stop" and len(out.token_ids) > min_tokens
        assert not eos & set(out.token_ids[:min_tokens]) and out.token_ids[-1] in eos
    period = plain.token_ids[1]  # "."
    out = smollm2_llm.generate([prompt], SamplingParams(max_tokens=60, min_tokens=10, stop_token_ids=[period]))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) > 10 and period not in out.token_ids[:10]
    with pytest.raises(ValueError, match=r"min_tokens \(61\) must be <= max_tokens \(60\)"):
        SamplingParams(max_tokens=60, min_tokens=61)


def test_min_p_one_samples_only_the_most_likely_token(smollm2_llm):
    """min_p 1 keeps only the tokens as likely as the best: sampling at temperature 1 then gives
    greedy decoding's tokens, which it does not without min_p."""
    prompt = smollm2_llm.encode("Once upon a time")
    greedy = smollm2_llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    hot = dict(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    assert smollm2_llm.generate([prompt], SamplingParams(**hot))[0].token_ids != greedy
    assert smollm2_llm.generate([prompt], SamplingParams(**hot, min_p=1.0))[0].token_ids == greedy
