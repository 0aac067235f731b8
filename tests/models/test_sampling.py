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
    """The engines seed further generators from seed + 1 and seed + 2: the ends of the range must
    still give torch a seed it takes, and the same seed the same tokens."""
    from oasiskv.models.sampling import SEED_MAX, SEED_MIN, make_generator

    logits = torch.randn(1, 50)
    for seed in (SEED_MIN, SEED_MAX):
        params = SamplingParams(temperature=1.0, seed=seed)
        for offset in (1, 2):
            runs = [sample(logits, [params], [make_generator(seed + offset)]) for _ in range(2)]
            assert runs[0] == runs[1]


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
