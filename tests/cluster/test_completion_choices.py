"""A completions request's prompts and choices: how the prompt field splits into prompts, the cap
on choices a request, and how a non-streamed response gathers its choices from the same merged
events a stream sends (event sources here are plain async generators, not the cluster)."""

import asyncio
import dataclasses

import pytest
from pydantic import ValidationError

from oasiskv.cluster.api import _cached_prompt_tokens, _collect, _Merged, _usage
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


@pytest.mark.parametrize("prompt", [[True, 2], [1.0, 2], ["1", 2], [[2], [False]], [[1.0]], [[1], 2]])
def test_a_token_id_that_is_not_a_json_integer_is_refused(prompt):
    with pytest.raises(ValidationError, match="prompt token ids must be JSON integers"):
        CompletionRequest(prompt=prompt)


def test_prompts_times_n_over_the_cap_is_refused_naming_both():
    CompletionRequest(prompt=["x"] * (MAX_CHOICES_PER_REQUEST // 4), n=4).check_supported()
    with pytest.raises(UnsupportedFeature, match=r"17 prompts x n 4 is over 64 choices"):
        CompletionRequest(prompt=["x"] * 17, n=4).check_supported()


def _merged(streams) -> _Merged:
    """The choices' events, each choice accepted with its first event (these streams do not say so
    earlier)."""
    return _Merged([lambda on_accepted, events=events: events for events in streams])


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
        streams = [_events(events, fail_after=fail if i == 1 else None) for i, events in enumerate(choices)]
        merged = _merged(streams)
        try:
            await merged.started()
            return await _collect(merged)
        finally:
            await merged.shut()
    return asyncio.run(run())


def test_each_choice_gets_its_own_text_count_and_reasons():
    outcomes = _gather([_stream(["a", "b", "c"]), _stream(["x", "y"], "stop", "\n"), _stream(["q"], "stop")])
    assert [o.text for o in outcomes] == ["abc", "xy", "q"]
    assert [o.num_tokens for o in outcomes] == [3, 2, 1]
    assert [(o.finish_reason, o.stop_reason) for o in outcomes] == [("length", None), ("stop", "\n"), ("stop", None)]


def test_the_usage_counts_a_prompts_cached_tokens_that_every_choice_found():
    """Two prompts of two choices each: the second choice of a prompt finds what the first just
    computed, which was not cached before the request; the prompt counts what both found."""
    cached = [400, 640, 0, 128]
    choices = [[dataclasses.replace(event, cached_tokens=c) for event in _stream(["a", "b"])] for c in cached]
    outcomes = _gather(choices)
    assert [o.cached_tokens for o in outcomes] == cached
    usage = _usage(1300, 8, _cached_prompt_tokens([o.cached_tokens for o in outcomes], 2))
    assert usage["prompt_tokens_details"] == {"cached_tokens": 400 + 0}
    assert _cached_prompt_tokens([16, 32, 48], 1) == 96


def test_a_choice_that_fails_fails_the_response():
    with pytest.raises(RuntimeError, match="the worker died"):
        _gather([_stream(["a", "b", "c"]), _stream(["x", "y", "z"])], fail=2)


class _Seat:
    """A resource one choice at a time may hold, as a store that has room for one: a stream takes
    it before its first event and gives it back when it is closed (as the cluster's requests)."""

    def __init__(self):
        self.free = asyncio.Event()
        self.free.set()
        self.closed: list[int] = []

    async def stream(self, index: int, tokens: int, between=0.0):
        while not self.free.is_set():
            await self.free.wait()
        self.free.clear()
        try:
            for i in range(tokens):
                await asyncio.sleep(between)
                yield Event(str(index), i + 1, i + 1 == tokens, "length" if i + 1 == tokens else None)
        finally:
            self.closed.append(index)
            self.free.set()


def test_choices_that_fit_only_in_turns_are_served_not_deadlocked():
    """Every choice's first event came before any was read on: the third waited for room that
    the first two held until the response ended, and the request waited out its timeout."""
    async def run():
        seat = _Seat()
        streams = [seat.stream(i, 3) for i in range(3)]
        merged = _merged(streams)
        try:
            await asyncio.wait_for(merged.started(), 5)
            return await asyncio.wait_for(_collect(merged), 5)
        finally:
            await merged.shut()
    assert [o.text for o in asyncio.run(run())] == ["000", "111", "222"]


def test_a_finished_choice_is_closed_while_its_sibling_still_runs():
    """A finished choice held its decode seat and store memory until the slowest choice ended."""
    async def run():
        quick, slow = _Seat(), _Seat()
        streams = [quick.stream(0, 1), slow.stream(1, 50, between=0.02)]
        merged = _merged(streams)
        try:
            await merged.started()
            async for index, event in merged:
                if index == 1 and event.num_tokens == 5:
                    return list(quick.closed), list(slow.closed)
        finally:
            await merged.shut()
    assert asyncio.run(run()) == ([0], [])


def test_a_hang_up_frees_every_choice_even_as_its_task_is_cancelled_again_and_again():
    """Starlette cancels a disconnected stream's task at every await: the cleanup stopped at the
    first, and a choice that had already finished kept its request until garbage collection."""
    async def run():
        quick, slow = _Seat(), _Seat()
        streams = [quick.stream(0, 1), slow.stream(1, 1000, between=0.01)]
        merged = _merged(streams)
        await merged.started()
        await anext(merged)
        cleanup = asyncio.ensure_future(merged.shut())
        await asyncio.sleep(0)  # begun, as in a response's finally
        for _ in range(5):
            cleanup.cancel()
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)
        return list(quick.closed + slow.closed)
    assert sorted(asyncio.run(run())) == [0, 1]


def test_a_stream_whose_client_left_before_its_body_began_shuts_its_choices():
    """The response's body generator never started, so its cleanup never ran: the choices went on
    decoding for nobody, to max_tokens."""
    from oasiskv.cluster.api import _ChoicesStream

    async def run():
        seat = _Seat()
        streams = [seat.stream(0, 1000, between=0.01)]
        merged = _merged(streams)
        await merged.started()

        async def body():
            began.append(True)
            async for _, event in merged:
                yield event.delta

        async def gone():
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.sleep(0.05)  # the disconnect is seen while the headers go out

        began = []
        response = _ChoicesStream(body(), shut=merged.shut)
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, gone, send)
        return began, list(seat.closed)
    assert asyncio.run(run()) == ([], [0])


async def _aborting_stream(index: int, log: list, tokens: int = 1000, abort_s: float = 0.05):
    """A stream whose abort awaits (as an abort sent to a worker may), and that logs its end."""
    finished = False
    log.append((index, "began"))
    try:
        for i in range(tokens):
            await asyncio.sleep(0.01)
            finished = i + 1 == tokens
            yield Event(str(index), i + 1, finished, "length" if finished else None)
    finally:
        if not finished:
            try:
                await asyncio.sleep(abort_s)
            except BaseException as error:
                log.append((index, f"abort cut short by {type(error).__name__}"))
                raise
        log.append((index, "released"))


def test_a_second_shut_waits_for_the_first_instead_of_cutting_the_aborts_short():
    """A hang-up shut the choices from the body's cleanup and again from the response's: the
    second cancelled the pumps again, inside each request's abort."""
    async def run():
        log = []
        streams = [_aborting_stream(i, log) for i in range(3)]
        merged = _merged(streams)
        await merged.started()
        first = asyncio.ensure_future(merged.shut())
        await asyncio.sleep(0.01)  # the requests are in their aborts now
        await asyncio.gather(first, merged.shut())
        return sorted(entry for entry in log if entry[1] != "began")
    assert asyncio.run(run()) == [(0, "released"), (1, "released"), (2, "released")]


class _Service:
    """What the API's request path reads of a ClusterService, with streams from `_aborting_stream`."""

    def __init__(self, log):
        from types import SimpleNamespace

        self.log = log
        self.config = SimpleNamespace(model_name="m", model="m", api_key=None, prefill_engine="none",
                                      decode=SimpleNamespace(block_size=16))
        self.tokenizer = SimpleNamespace(vocab_size=1000, encode=lambda text: [1, 2, 3])
        self.max_model_len = 4096

    def generate(self, request_id, prompt_ids, params, mode=None, budget_tokens=None, on_accepted=None):
        return _aborting_stream(int(request_id.rsplit("-", 1)[1]), self.log, tokens=params.max_tokens)


def test_a_request_cancelled_before_its_choices_began_ends_them():
    """The server cancels a request's task (at shutdown, say) while it waits for its choices' first
    tokens: they were neither aborted nor released, and decoded on for nobody."""
    import json

    from oasiskv.cluster.api import create_app

    async def run():
        log = []
        app = create_app(_Service(log))
        body = json.dumps({"model": "m", "prompt": "hi", "n": 3, "max_tokens": 1000}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        received = []

        async def receive():
            received.append(True)
            if len(received) == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Future()  # the client stays

        async def send(message):
            pass

        task = asyncio.ensure_future(app(scope, receive, send))
        while len(log) < 3:  # every choice has begun; its first token is 10 ms away
            assert not task.done(), "the request ended before its choices began"  # not a spin forever
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.3)
        return sorted(entry for entry in log if entry[1] != "began")
    assert asyncio.run(run()) == [(0, "released"), (1, "released"), (2, "released")]


async def _waiting_for_the_seat(seat: "_Seat", index: int, tokens: int, accepted, between=0.0):
    """A choice accepted at once that then waits for the seat, as a request waiting for room in a
    store is accepted when it begins to wait."""
    accepted()
    async for event in seat.stream(index, tokens, between):
        yield event


def test_a_choice_that_waits_for_room_does_not_hold_back_its_siblings_first_bytes():
    """The response began once every choice had its first token: a choice waiting for a sibling's
    room held the stream's first byte until that sibling had finished (vLLM streams each choice
    as it comes)."""
    async def run():
        seat = _Seat()
        merged = _Merged([lambda on_accepted: seat.stream(0, 1000, between=0.01),
                          lambda on_accepted: _waiting_for_the_seat(seat, 1, 2, on_accepted)])
        try:
            await asyncio.wait_for(merged.started(), 2)
            first = await anext(merged)
            return first[0], first[1].num_tokens, list(seat.closed)
        finally:
            await merged.shut()
    assert asyncio.run(run()) == (0, 1, [])


def test_a_choice_not_yet_accepted_holds_back_the_status_and_its_refusal_is_the_response_s():
    """A sibling's refusal by the router (429, 503, 400) must still be the response's status,
    not an error inside a stream that began with 200."""
    from oasiskv.cluster.router import Overloaded

    async def refused():
        await asyncio.sleep(0.05)
        raise Overloaded("every decode KV pool is full and the queue is at its limit", retry_after_s=2)
        yield  # an async generator

    async def run():
        seat = _Seat()
        merged = _Merged([lambda on_accepted: seat.stream(0, 1000, between=0.01),
                          lambda on_accepted: refused()])
        try:
            await asyncio.wait_for(merged.started(), 2)
        finally:
            await merged.shut()
    with pytest.raises(Overloaded, match="queue is at its limit"):
        asyncio.run(run())


class _LateFailure:
    """A stand-in service whose choice 0 streams, and whose other choice (or only choice, with n=1)
    is accepted at once, then fails with `error` before its first event, while choice 0 streams."""

    def __init__(self, error: Exception):
        from types import SimpleNamespace

        from oasiskv.cluster.metrics import ServingMetrics

        self.error = error
        self.config = SimpleNamespace(model_name="m", model="m", api_key=None, prefill_engine="none",
                                      decode=SimpleNamespace(block_size=16))
        self.tokenizer = SimpleNamespace(vocab_size=1000, encode=lambda text: [1, 2, 3])
        self.max_model_len = 4096
        self.metrics = ServingMetrics()

    async def generate(self, request_id, prompt_ids, params, mode=None, budget_tokens=None, on_accepted=None):
        on_accepted()
        if not request_id.endswith("-0"):
            await asyncio.sleep(0.1)
            raise self.error
        for i in range(20):
            await asyncio.sleep(0.01)
            yield Event("x", i + 1, i == 19, "length" if i == 19 else None)


def _post_stream(service, n: int):
    import httpx

    from oasiskv.cluster.api import create_app

    async def run():
        app = create_app(service)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://api") as client:
            return await client.post("/v1/completions", json={"prompt": "hi", "n": n, "stream": True, "max_tokens": 20})
    return asyncio.run(run())


def _late_errors():
    from oasiskv.cluster.router import Overloaded, TooLarge

    return [
        (TimeoutError("every KV store stayed full until the request timed out"), 504, "timeout", 0),
        (RuntimeError("ActorDiedError"), 503, "service_unavailable", 0),
        (Overloaded("every decode KV pool is full and the queue is at its limit", retry_after_s=2), 429,
         "server_overloaded", 1),
        (Overloaded("no healthy worker for some role", retry_after_s=5, status=503), 503, "service_unavailable", 1),
        (TooLarge("the request needs 9 rows of a decode KV pool; the largest pool has 8"), 400,
         "invalid_request_error", 0),
    ]


@pytest.mark.parametrize("error, status, kind, rejected", _late_errors())
def test_a_choice_that_fails_after_the_stream_began_sends_the_error_it_would_have_had(error, status, kind, rejected):
    """Each error as the status it would have been before the response began (it was 503 for all
    but a timeout), and a refusal counted once as rejected."""
    import json

    service = _LateFailure(error)
    response = _post_stream(service, n=2)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert any(json.loads(e)["choices"][0]["index"] == 0 for e in events[:-2])
    failure = json.loads(events[-2])["error"]
    assert (failure["code"], failure["type"]) == (status, kind)
    assert service.metrics.registry.get_sample_value("oasiskv_requests_total", {"status": "rejected"}) == (
        rejected or None)


@pytest.mark.parametrize("error, status, kind, rejected", _late_errors())
def test_one_choice_that_fails_before_its_first_token_is_the_response_s_status(error, status, kind, rejected):
    """n = 1 waits for the first token before the 200, as it always did: a request accepted and
    then lost in its prefill is an HTTP error, not a 200 with an error inside."""
    service = _LateFailure(error)
    response = _post_stream(service, n=1)
    assert (response.status_code, response.json()["error"]["type"]) == (status, kind)
