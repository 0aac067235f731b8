"""A worker found dead by a request takes no more requests until it answers a health poll: the
router kept choosing it until the next poll, and each request sent there failed (1 in 14 with
two decode workers, one just killed). A unit test of the service with stand-in workers."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from oasiskv.models.sampling import SamplingParams
from oasiskv.models.tokenizer import load_tokenizer

from .test_first_token import _Call, _service


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


class _DeadStream:
    def __aiter__(self):
        return self

    async def __anext__(self):
        raise ActorDiedError()


def test_a_decode_worker_found_dead_is_taken_out_of_routing(tokenizer):
    first = tokenizer.encode(" hello")[0]

    async def run():
        service, _ = _service(tokenizer, first, [])
        slot = service.handles.decode[0]
        slot.handle.generate = _Call(_DeadStream())
        assert slot.healthy
        with pytest.raises(ActorDiedError):
            async for _event in service.generate("r", [1, 2, 3], SamplingParams(max_tokens=3)):
                pass
        assert not slot.healthy and service.handles.prefill[0].healthy
        assert service.metrics.requests.labels(status="error")._value.get() == 1

    asyncio.run(run())
