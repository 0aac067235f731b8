"""The prefill's token is streamed as soon as the prefill returns, not with the decode worker's
first step (TTFT counted the working set's transfer and a whole step). A unit test of the
service alone: the prefill and decode workers are stand-ins whose answers the test releases, and
the tokenizer is the model's own."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.launcher import ClusterHandles
from oasiskv.cluster.router import WorkerSlot
from oasiskv.cluster.service import ClusterService
from oasiskv.models.sampling import SamplingParams
from oasiskv.models.tokenizer import load_tokenizer


class _Call:
    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args):
        return self.answer

    def options(self, **_):
        return self


class _DecodeStream:
    """What `generate.options(num_returns="streaming").remote()` gives: refs, one per output,
    each released by the test."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.released = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.outputs:
            raise StopAsyncIteration
        await self.released.wait()
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.outputs.pop(0))
        return future


def _service(tokenizer, first_token, decode_outputs):
    loop = asyncio.get_running_loop()
    prefilled = loop.create_future()
    prefilled.set_result(SimpleNamespace(first_token=first_token, first_logprob=None, cached_tokens=0,
                                         prompt_logprobs=None))
    stream = _DecodeStream(decode_outputs)
    prefill = SimpleNamespace(prefill=_Call(prefilled))
    decode = SimpleNamespace(generate=_Call(stream), abort=_Call(None))
    handles = ClusterHandles([WorkerSlot("prefill-0", prefill)], [WorkerSlot("decode-0", decode, capacity=10**6)],
                             [WorkerSlot("store-0", SimpleNamespace(free=_Call(None)), capacity=10**12, address="s:1")])
    return ClusterService(ServeConfig(), handles, tokenizer, kv_bytes_per_token=1, max_model_len=2048), stream


def _output(num_tokens, text_delta, finished=False, reason=None):
    return {"num_tokens": num_tokens, "text_delta": text_delta, "finished": finished, "finish_reason": reason}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def test_the_prefills_token_is_sent_before_the_decode_worker_answers(tokenizer):
    first, rest = tokenizer.encode(" hello")[0], " world"

    async def run():
        service, stream = _service(tokenizer, first, [_output(3, tokenizer.decode([first]) + rest, True, "length")])
        events = service.generate("r", [1, 2, 3], SamplingParams(max_tokens=3))
        early = await asyncio.wait_for(anext(events), 5)  # the decode worker has not answered
        assert (early.delta, early.num_tokens, early.finished) == (tokenizer.decode([first]), 1, False)
        assert service.metrics.ttft._sum.get() > 0  # TTFT is taken here
        stream.released.set()
        last = await asyncio.wait_for(anext(events), 5)
        assert (last.delta, last.num_tokens, last.finish_reason) == (rest, 3, "length")  # not repeated
        with pytest.raises(StopAsyncIteration):
            await anext(events)

    asyncio.run(run())


@pytest.mark.parametrize("case", ["ends the request", "may start a stop string"])
def test_a_first_token_whose_text_is_not_settled_waits_for_the_decode_worker(tokenizer, case):
    first = tokenizer.encode(" hello")[0]
    text = tokenizer.decode([first])
    params = (SamplingParams(max_tokens=4, stop_token_ids=[first]) if case == "ends the request"
              else SamplingParams(max_tokens=4, stop=[text + "XYZ"]))

    async def run():
        service, stream = _service(tokenizer, first, [_output(2, text + "!", True, "length")])
        events = service.generate("r", [1, 2, 3], params)
        waiting = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # nothing to show before the worker's answer
        stream.released.set()
        event = await asyncio.wait_for(waiting, 5)
        assert (event.delta, event.num_tokens) == (text + "!", 2)  # the worker's text, whole

    asyncio.run(run())
