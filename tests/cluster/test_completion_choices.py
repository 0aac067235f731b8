"""A completions request's prompts and choices: how the prompt field splits into prompts, the cap
on choices a request, and how a non-streamed response gathers its choices from the same merged
events a stream sends (event sources here are plain async generators, not the cluster)."""

import asyncio

import pytest

from oasiskv.cluster.api import _collect
from oasiskv.cluster.protocol import MAX_CHOICES_PER_REQUEST, CompletionRequest, UnsupportedFeature
from oasiskv.cluster.service import Event


@pytest.mark.parametrize("prompt, expected", [
    ("def f():", ["def f():"]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["a", "b"], ["a", "b"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    ([], [[]]),  # one empty prompt: refused later as empty, not served as none
])
def test_the_prompt_field_splits_as_vllm_reads_it(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_prompts_times_n_over_the_cap_is_refused_naming_both():
    CompletionRequest(prompt=["x"] * (MAX_CHOICES_PER_REQUEST // 4), n=4).check_supported()
    with pytest.raises(UnsupportedFeature, match=r"17 prompts x n 4 is over 64 choices"):
        CompletionRequest(prompt=["x"] * 17, n=4).check_supported()


async def _events(pieces, fail_after=None):
    for i, piece in enumerate(pieces):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("the worker died")
        await asyncio.sleep(0)
        yield piece


def _stream(texts, reason="length", stop=None):
    events = [Event(t, i + 1) for i, t in enumerate(texts)]
    last = events[-1]
    events[-1] = Event(last.delta, last.num_tokens, True, reason, stop_reason=stop)
    return events


def _gather(choices, fail=None):
    async def run():
        streams = [_events(events[1:], fail_after=fail if i == 1 else None) for i, events in enumerate(choices)]
        firsts = [events[0] for events in choices]
        try:
            return await _collect(firsts, streams)
        finally:
            for s in streams:
                await s.aclose()
    return asyncio.run(run())


def test_each_choice_gets_its_own_text_count_and_reasons():
    outcomes = _gather([_stream(["a", "b", "c"]), _stream(["x", "y"], "stop", "\n"), _stream(["q"], "stop")])
    assert [o.text for o in outcomes] == ["abc", "xy", "q"]
    assert [o.num_tokens for o in outcomes] == [3, 2, 1]
    assert [(o.finish_reason, o.stop_reason) for o in outcomes] == [("length", None), ("stop", "\n"), ("stop", None)]


def test_a_choice_that_fails_fails_the_response():
    with pytest.raises(RuntimeError, match="the worker died"):
        _gather([_stream(["a", "b", "c"]), _stream(["x", "y", "z"])], fail=1)
