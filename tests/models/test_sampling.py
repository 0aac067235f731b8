"""Sampler arithmetic, checked against direct computation (no model needed)."""

from __future__ import annotations

import pytest
import torch

from oasiskv.models.sampling import SamplingParams, make_generator, sample, target_probs


def test_top_k_keeps_only_the_k_largest():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.equal(probs > 0, torch.tensor([False, True, False, True, False]))
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = target_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.8))
    # 0.5 < 0.8, 0.5 + 0.3 reaches 0.8: two tokens survive, renormalized.
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 2.0])
    cold = target_probs(logits, SamplingParams(temperature=0.5))
    warm = target_probs(logits, SamplingParams(temperature=2.0))
    assert cold[1] > warm[1] > 0.5


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    params = SamplingParams(temperature=1.0)
    gen = make_generator(123)
    draws = [sample(logits, [params], [gen])[0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]) == [1, 0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),  # it sampled from NaN
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        # Wrong types failed inside torch (topk, manual_seed) or as a bare TypeError.
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
    ],
)
def test_bad_parameters_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_the_extreme_seeds_sample_and_repeat():
    """The engines seed further generators from a request's seed (`stream_seed`): the ends of
    the range must still give torch a seed it takes, and the same seed the same tokens."""
    from oasiskv.models.sampling import SEED_MAX, SEED_MIN, make_generator, stream_seed

    logits = torch.randn(1, 50)
    for seed in (SEED_MIN, SEED_MAX):
        params = SamplingParams(temperature=1.0, seed=seed)
        for stream in ("verify", "draft"):
            runs = [sample(logits, [params], [make_generator(stream_seed(seed, stream))]) for _ in range(2)]
            assert runs[0] == runs[1]


def test_consecutive_seeds_share_no_random_stream():
    """A request's verification and draft streams were seeded with seed + 1 and seed + 2: with
    requests seeded 0, 1, 2, ... one's verification drew the numbers of the next one's first
    token, and its drafts those of the next one's verification."""
    from oasiskv.models.sampling import stream_seed

    seeds = range(-50, 50)
    streams = [s for seed in seeds for s in (seed, stream_seed(seed, "verify"), stream_seed(seed, "draft"))]
    assert len(set(streams)) == 3 * len(seeds)
    assert stream_seed(7, "verify") == stream_seed(7, "verify") != stream_seed(7, "draft")


@pytest.mark.parametrize("temperature", [1e-40, 7.35e-38, 1e-6])
def test_a_temperature_near_zero_decodes_greedily(temperature):
    """Dividing logits by such a temperature overflowed them to inf and the softmax to NaN: the
    sampler raised, and with it the step of every request beside this one."""
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    assert sample(logits, [params, SamplingParams(temperature=1.0)], [None, make_generator(0)])[0] == 1
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("top_p", [1e-320, 1e-45, 1e-12])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    """A top_p that rounds to 0 in fp32 dropped every token (NaN probabilities)."""
    logits = torch.tensor([1.0, 3.0, 2.0])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0]))
    assert sample(logits[None], [SamplingParams(temperature=1.0, top_p=top_p)], [make_generator(1)]) == [1]


def test_none_means_none_as_in_vllm():
    """vLLM's defaults for stop and stop_token_ids are None: SamplingParams(stop=None) raised a
    bare TypeError, in LLM.generate too."""
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == [] and params.stop_token_ids == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_stop_token_ids_the_model_cannot_emit_are_refused():
    from oasiskv.models.sampling import require_known_stop_tokens

    require_known_stop_tokens(SamplingParams(stop_token_ids=[0, 99]), 100)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 100\), got \[100, -1\]"):
        require_known_stop_tokens(SamplingParams(stop_token_ids=[5, 100, -1]), 100)


def test_penalties_follow_the_openai_and_vllm_formulas_row_by_row():
    """Row i of a verification pass follows the output and drafts[:i]; checked against the
    formulas written out token by token."""
    from oasiskv.models.sampling import apply_penalties

    torch.manual_seed(1)
    vocab, prompt, output, drafts = 12, [0, 1, 1, 5], [2, 3, 2], [3, 7, 3]
    logits = torch.randn(len(drafts) + 1, vocab) * 3
    params = SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.5)
    got = apply_penalties(logits, params, prompt, output, drafts)
    for i in range(len(drafts) + 1):
        generated = output + drafts[:i]
        for token in range(vocab):
            value = float(logits[i, token])
            if token in generated or token in prompt:
                value = value / 1.5 if value > 0 else value * 1.5
            count = generated.count(token)
            value -= 0.3 * count + (0.4 if count else 0.0)
            assert abs(float(got[i, token]) - value) < 1e-5, (i, token)
    assert torch.equal(apply_penalties(logits, SamplingParams(), prompt, output, drafts), logits)


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
                                          ("repetition_penalty", 0.0), ("repetition_penalty", 3.0)])
def test_penalties_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    """After temperature: at temperature 2 the probabilities go as exp(logit / 2)."""
    logits = torch.tensor([0.0, -1.0, -3.0, 1.0, 1.0 - 2 * 0.7])
    probs = target_probs(logits, SamplingParams(temperature=2.0, min_p=0.5))
    # exp((l - 1) / 2) >= 0.5 keeps l >= 1 + 2 ln 0.5 = -0.386: tokens 0, 3 and 4 (ratio 0.497 < 0.5 drops 4).
    ratio = torch.exp((logits - 1.0) / 2.0)
    assert torch.equal(probs > 0, ratio >= 0.5)
    assert torch.equal(probs > 0, torch.tensor([True, False, False, True, False]))
    kept = torch.softmax(logits[[0, 3]] / 2.0, dim=-1)
    assert torch.allclose(probs[[0, 3]], kept)
    assert torch.equal(target_probs(logits, SamplingParams(temperature=2.0, min_p=1.0)) > 0, logits == logits.max())
    # Greedy decoding is the argmax whatever min_p says.
    assert sample(logits[None], [SamplingParams(min_p=1.0)], [None]) == [3]


def test_min_p_comes_before_top_p_as_in_vllm():
    """min_p 0.5 keeps [0.4, 0.3, 0.2] (renormalized 4/9, 3/9, 2/9), then top_p 0.75 is reached
    by the first two; top_p first would have kept three."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    probs = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.5, top_p=0.75))
    assert torch.allclose(probs, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_logit_bias_is_added_to_the_logits_and_moves_greedy_decoding():
    from oasiskv.models.sampling import process_logits

    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0], [2.0, 0.0, 1.0, 0.5]])
    params = SamplingParams(logit_bias={"2": 2.5, 0: -100})  # JSON gives string keys
    assert params.logit_bias == {2: 2.5, 0: -100.0}
    got = process_logits(logits, params, [], [], drafts=[1])
    assert torch.equal(got, logits + torch.tensor([-100.0, 0.0, 2.5, 0.0]))
    assert sample(got, [params] * 2, [None, None]) == [2, 2]
    assert sample(logits, [params] * 2, [None, None]) == [1, 0]  # unbiased


def test_min_tokens_bans_eos_and_the_stop_tokens_row_by_row():
    """Row i is output position len(output) + i: with 2 tokens out and min_tokens 4, rows 0 and 1
    (positions 2 and 3) may not end the output, rows 2 and 3 may."""
    from oasiskv.models.sampling import process_logits

    logits = torch.zeros(4, 8)
    params = SamplingParams(min_tokens=4, stop_token_ids=[5])
    got = process_logits(logits, params, [7], [3, 4], drafts=[1, 2, 3], eos_token_ids={0, 2})
    banned = torch.zeros(4, 8, dtype=torch.bool)
    banned[:2, [0, 2, 5]] = True
    assert torch.equal(torch.isinf(got), banned) and (got[banned] < 0).all()
    # An ignored EOS ends nothing, so it stays; the stop tokens are still banned.
    ignoring = process_logits(logits, SamplingParams(min_tokens=4, stop_token_ids=[5], ignore_eos=True), [7],
                              [3, 4], drafts=[1, 2, 3], eos_token_ids={0, 2})
    assert torch.equal(torch.isinf(ignoring), banned & (torch.arange(8) == 5))
    assert torch.equal(process_logits(logits, params, [7], [3, 4, 1, 2], eos_token_ids={0, 2}), logits)


def test_allowed_token_ids_leave_only_those_logits():
    from oasiskv.models.sampling import process_logits

    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0], [2.0, 0.0, 1.0, 0.5]])
    params = SamplingParams(allowed_token_ids=[3, 2, 3], repetition_penalty=1.5)
    assert params.allowed_token_ids == [2, 3] and params.processed
    got = process_logits(logits, params, [3], [], drafts=[1])
    assert torch.isinf(got[:, :2]).all() and (got[:, :2] < 0).all()
    assert torch.allclose(got[:, 2:], torch.tensor([[3.0, 4.0 / 1.5], [1.0, 0.5 / 1.5]]))  # penalized as before
    assert sample(got, [params] * 2, [None, None]) == [2, 2]
    assert sample(logits, [params] * 2, [None, None]) == [1, 0]  # unrestricted


def test_min_tokens_and_logit_bias_come_before_the_penalties_as_in_vllm():
    """The repetition penalty divides the biased logit: (2 + 1) / 1.5, not 2 / 1.5 + 1."""
    from oasiskv.models.sampling import process_logits

    logits = torch.tensor([[2.0, 1.0, 0.5]])
    params = SamplingParams(logit_bias={0: 1.0}, repetition_penalty=1.5, frequency_penalty=0.5, min_tokens=1)
    got = process_logits(logits, params, [0], [], eos_token_ids={1})
    assert torch.allclose(got, torch.tensor([[3.0 / 1.5, float("-inf"), 0.5]]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"min_p": -0.1}, "min_p must be in"),
        ({"min_p": float("nan")}, "min_p must be in"),
        ({"min_p": "0.1"}, "min_p must be in .*'0.1'"),
        ({"min_p": None}, "min_p must be in"),
        ({"min_p": True}, "min_p must be in"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 2.5}, "min_tokens must be an integer"),
        ({"min_tokens": 9, "max_tokens": 8}, r"min_tokens \(9\) must be <= max_tokens \(8\)"),
        ({"logit_bias": {"abc": 1}}, "logit_bias keys must be integer token ids, got 'abc'"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias keys must be integer token ids"),
        ({"logit_bias": {"+-5": 1}}, "logit_bias keys must be integer token ids, got '\\+-5'"),
        ({"logit_bias": {"--5": 1}}, "logit_bias keys must be integer token ids"),
        ({"logit_bias": {5: 100.5}}, r"logit_bias values must be numbers in \[-100, 100\], got 100.5 for token id 5"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values must be numbers"),
        ({"logit_bias": {5: "1"}}, "logit_bias values must be numbers"),
        ({"logit_bias": {"5": 1, 5: 2}}, "logit_bias names token id 5 twice"),
        ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias may bias at most 300 tokens, got 301"),
        ({"logit_bias": [5]}, "logit_bias must be a map"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list of token ids, got \\[\\]"),
        ({"allowed_token_ids": [1, True]}, "allowed_token_ids must be a non-empty list of token ids"),
        ({"allowed_token_ids": [1.0]}, "allowed_token_ids must be a non-empty list of token ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids must be a non-empty list of token ids, got 5"),
    ],
)
def test_bad_min_p_min_tokens_and_logit_bias_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_ids_outside_the_vocabulary_are_refused_by_id():
    from oasiskv.models.sampling import require_known_tokens

    require_known_tokens(SamplingParams(logit_bias={0: 1, 99: -1}), 100)
    for bad in (100, -1):
        with pytest.raises(ValueError, match=rf"logit_bias token id {bad} is not in the model's vocabulary \[0, 100\)"):
            require_known_tokens(SamplingParams(logit_bias={5: 1, bad: 1}), 100)


def test_allowed_token_ids_outside_the_vocabulary_or_all_banned_are_refused():
    from oasiskv.models.sampling import require_known_tokens

    require_known_tokens(SamplingParams(allowed_token_ids=[0, 99]), 100)
    for bad in (100, -1):
        with pytest.raises(ValueError, match=rf"allowed_token_ids must be in \[0, 100\), got \[{bad}\]"):
            require_known_tokens(SamplingParams(allowed_token_ids=[5, bad]), 100)
    # min_tokens bans EOS and the stop tokens early: with only those allowed, nothing is left.
    for params in (SamplingParams(allowed_token_ids=[2, 5], stop_token_ids=[5], min_tokens=1),
                   SamplingParams(allowed_token_ids=[2], min_tokens=3)):
        with pytest.raises(ValueError, match="allowed_token_ids are all stop tokens"):
            require_known_tokens(params, 100, eos_token_ids=[2])
    require_known_tokens(SamplingParams(allowed_token_ids=[2], min_tokens=3, ignore_eos=True), 100, eos_token_ids=[2])
    require_known_tokens(SamplingParams(allowed_token_ids=[2, 7], min_tokens=3), 100, eos_token_ids=[2])


def test_the_new_fields_survive_the_trip_to_the_workers():
    """The API hands SamplingParams to the workers as dataclasses.asdict."""
    import dataclasses

    params = SamplingParams(min_p=0.2, min_tokens=3, logit_bias={"7": -5}, allowed_token_ids=[7, 9],
                            bad_words=["w"], bad_words_token_ids=[[3, 4]])
    assert SamplingParams(**dataclasses.asdict(params)) == params
    assert not SamplingParams().processed and params.processed and SamplingParams(min_tokens=1).processed


def test_bad_words_ban_a_token_only_where_it_would_end_a_bad_sequence():
    """Against the definition, on random outputs and drafts: row i bans token t exactly when the
    tokens generated before it (the output, then drafts[:i]) followed by t end with one of the
    sequences. The prompt does not count, as in vLLM."""
    from oasiskv.models.sampling import process_logits

    sequences = [[4], [1, 2], [2, 2, 3], [0, 5], [1, 2, 0]]
    params = SamplingParams(bad_words=["w"], bad_words_token_ids=sequences)
    assert params.processed
    gen = torch.Generator().manual_seed(0)
    vocab, drafts_per_step = 6, 3
    banned_somewhere = set()
    for _ in range(300):
        output = torch.randint(0, vocab, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()
        drafts = torch.randint(0, vocab, (drafts_per_step,), generator=gen).tolist()
        got = process_logits(torch.zeros(1 + drafts_per_step, vocab), params, [1, 2, 2], output, drafts)
        for i in range(1 + drafts_per_step):
            before = output + drafts[:i]
            for t in range(vocab):
                ends_bad = any((before + [t])[-len(s):] == s for s in sequences)
                assert bool(torch.isinf(got[i, t])) == ends_bad, (output, drafts, i, t)
                if ends_bad:
                    banned_somewhere.add(t)
    assert banned_somewhere == {0, 2, 3, 4, 5}  # every sequence's last token was met and banned


def test_bad_words_are_tokenized_as_vllm_does():
    """Each word as it begins the output, and after a space where that is another token of the
    same length; a stand-in tokenizer (one token per character, a space its own token) shows
    the rules, and tests/vllm_interop compares a real tokenizer's with vLLM's."""
    from oasiskv.models.sampling import tokenize_bad_words

    def encode(text: str) -> list[int]:  # "ab" -> [1, 2]; " ab" -> [27, 2]: the space joins the next letter
        ids = []
        for i, c in enumerate(text):
            if c != " ":
                ids.append(ord(c) - 96 + (26 if i and text[i - 1] == " " else 0))
        return ids

    assert tokenize_bad_words(["ab", "  c"], encode) == [[1, 2], [27, 2], [3], [29]]

    def merging(text: str) -> list[int]:  # the space makes one token of a whole word: another length
        return [99] if text.startswith(" ") else [ord(c) - 96 for c in text]

    assert tokenize_bad_words(["ab"], merging) == [[1, 2]]
    with pytest.raises(ValueError, match="bad_words entry 'x' has no tokens"):
        tokenize_bad_words(["x"], lambda text: [])
    calls = []

    def counting(text: str) -> list[int]:
        calls.append(text)
        return [len(text)]

    with pytest.raises(ValueError, match="bad_words make more than the 128 token sequences allowed"):
        tokenize_bad_words([chr(97 + i % 26) * (1 + i // 26) for i in range(1000)], counting)
    assert len(calls) == 2 * 65  # refused at the 129th sequence, not after every word
    with pytest.raises(ValueError, match="bad_words make more than the 1024 tokens allowed"):
        tokenize_bad_words(["a" * 1025], lambda text: [1] * len(text.strip()))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bad_words": [""]}, "bad_words entries must contain text other than spaces"),
        ({"bad_words": ["ok", "  "]}, "bad_words entries must contain text other than spaces"),
        ({"bad_words": "fox"}, "bad_words must be a list of strings, got 'fox'"),
        ({"bad_words": [5]}, "bad_words must be a list of strings"),
        ({"bad_words": ["w"], "bad_words_token_ids": [[]]}, "bad_words_token_ids must be a list of non-empty lists"),
        ({"bad_words": ["w"], "bad_words_token_ids": [[1, True]]}, "bad_words_token_ids must be a list of non-empty"),
        ({"bad_words_token_ids": [[1]]}, "bad_words_token_ids are made from bad_words"),
        ({"bad_words": [f"w{i}" for i in range(129)]}, "bad_words may name at most 128 words, got 129"),
    ],
)
def test_bad_bad_words_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_words_need_their_sequences_of_known_ids_before_an_engine_takes_them():
    from oasiskv.models.sampling import require_known_tokens

    assert SamplingParams(bad_words=["a", "a"]).bad_words == ["a"]
    assert len(SamplingParams(bad_words=["a"] * 200).bad_words) == 1  # the limit counts distinct words
    with pytest.raises(ValueError, match="bad_words were given without their token sequences"):
        require_known_tokens(SamplingParams(bad_words=["fox"]), 100)
    with pytest.raises(ValueError, match=r"bad_words token ids must be in \[0, 100\), got \[100\]"):
        require_known_tokens(SamplingParams(bad_words=["fox"], bad_words_token_ids=[[5, 100]]), 100)
    require_known_tokens(SamplingParams(bad_words=["fox"], bad_words_token_ids=[[5, 99]]), 100)


def test_bad_words_never_leave_a_request_no_token_to_generate():
    """With allowed_token_ids, bans could leave a row nothing to sample from, which failed the
    whole decode step: one-token words that ban every allowed token are refused at admission
    (with min_tokens' stops too), and a longer word that would ban the last one gives way."""
    from oasiskv.models.sampling import process_logits, require_known_tokens

    with pytest.raises(ValueError, match="allowed_token_ids are all banned by bad_words: no token"):
        require_known_tokens(SamplingParams(allowed_token_ids=[3], bad_words=["w"], bad_words_token_ids=[[3]]), 10)
    with pytest.raises(ValueError, match="allowed_token_ids are all banned by bad_words and min_tokens"):
        require_known_tokens(SamplingParams(allowed_token_ids=[3, 5], bad_words=["w"], bad_words_token_ids=[[3]],
                                            min_tokens=2, stop_token_ids=[5]), 10)
    require_known_tokens(SamplingParams(allowed_token_ids=[3, 5], bad_words=["w"], bad_words_token_ids=[[3]]), 10)
    params = SamplingParams(allowed_token_ids=[3, 4], bad_words=["w"], bad_words_token_ids=[[1, 3], [1, 4], [2, 4]])
    require_known_tokens(params, 10)
    got = process_logits(torch.zeros(3, 10), params, [7], [1], drafts=[2, 9])
    assert torch.isfinite(got[0]).tolist() == [i in (3, 4) for i in range(10)]  # after 1: 3 and 4 give way
    assert torch.isfinite(got[1]).tolist() == [i == 3 for i in range(10)]  # after 2: 4 banned, 3 left
    assert torch.isfinite(got[2]).tolist() == [i in (3, 4) for i in range(10)]
    unrestricted = process_logits(torch.zeros(1, 10), SamplingParams(bad_words=["w"], bad_words_token_ids=[[1, 3]]),
                                  [7], [1])
    assert torch.isinf(unrestricted[0, 3])  # without allowed_token_ids, no row can empty: the ban holds
