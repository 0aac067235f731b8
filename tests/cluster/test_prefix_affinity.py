"""A prompt goes, load allowing, to the prefill worker that prefilled its beginning, whose prefix
cache holds it: the map of beginnings to workers, and the service's use of it (worker handles
are stand-ins that record which worker was asked: the route is what is checked)."""

from __future__ import annotations

import asyncio

import pytest

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.launcher import ClusterHandles
from oasiskv.cluster.prefix_affinity import PrefixAffinity, prefix_keys
from oasiskv.cluster.router import WorkerSlot
from oasiskv.cluster.service import ClusterService
from oasiskv.models.sampling import SamplingParams


def test_the_prefix_affinity_names_the_worker_of_the_longest_shared_beginning():
    assert [length for length, _ in prefix_keys(list(range(1000)))] == [64, 128, 256, 512, 992]
    assert [length for length, _ in prefix_keys(list(range(65)))] == [64]
    assert prefix_keys(list(range(64))) == []  # 63 tokens before its last: under one useful beginning
    assert [length for length, _ in prefix_keys(list(range(1000)), block_tokens=32)] == [64, 128, 256, 512, 992]
    assert [length for length, _ in prefix_keys(list(range(1000)), block_tokens=48)] == [64, 128, 256, 512, 960]
    affinity = PrefixAffinity()
    chat = list(range(400))
    affinity.remember(chat, "p0")
    assert affinity.worker_for(chat) == ("p0", 384)  # the same prompt again: all its blocks
    assert affinity.worker_for(chat + list(range(5000, 5250))) == ("p0", 256)  # the next turn
    affinity.remember(chat[:130], "p1")  # a shorter prompt with the same beginning, elsewhere since
    assert affinity.worker_for(chat) == ("p0", 384)  # the longest shared beginning decides
    assert affinity.worker_for(chat[:140]) == ("p1", 128)
    assert affinity.worker_for(list(range(1, 400))) is None  # differs in its first token
    assert affinity.worker_for(chat[:64]) is None
    small = PrefixAffinity(max_entries=3)
    small.remember(list(range(1000)), "p0")  # five beginnings: the two shortest are forgotten
    assert len(small) == 3 and small.worker_for(list(range(200))) is None
    assert small.worker_for(list(range(600))) == ("p0", 512)
    with pytest.raises(ValueError, match="max_entries"):
        PrefixAffinity(0)



class _RecordingPrefill:
    """A prefill worker handle whose prefill fails at once, after saying it was asked."""

    def __init__(self, name, asked):
        outer = self

        class _Method:
            def remote(self, *args, **kwargs):
                asked.append(outer.name)
                raise RuntimeError("stand-in prefill")

        self.name = name
        self.prefill = _Method()


def make_service(prefill_workers=2, **config):
    asked = []
    prefill = [WorkerSlot(f"prefill-{i}", _RecordingPrefill(f"prefill-{i}", asked)) for i in range(prefill_workers)]
    handles = ClusterHandles(prefill, [WorkerSlot("decode-0", object(), capacity=10**6)],
                             [WorkerSlot("store-0", object(), capacity=10**9)])
    service = ClusterService(ServeConfig(**config), handles, tokenizer=None, kv_bytes_per_token=1, max_model_len=4096)
    return service, asked


def send(service, prompt):
    async def run():
        with pytest.raises(RuntimeError, match="stand-in prefill"):
            async for _ in service.generate("r", prompt, SamplingParams(max_tokens=4)):
                pass

    asyncio.run(run())


def test_the_service_sends_a_prompt_to_the_worker_that_prefilled_its_beginning():
    service, asked = make_service()
    p0, p1 = service.router.prefill
    chat = list(range(400))
    p0.load = 500  # busy: the first turn goes to p1
    send(service, chat)
    assert asked == ["prefill-1"] and service.prefix_affinity.worker_for(chat) == ("prefill-1", 384)
    # p1 is 300 tokens behind p0 now, but holds 256 of the next turn's first tokens... not enough;
    p0.load, p1.load = 0, 300
    send(service, chat + list(range(5000, 5300)))
    assert asked[-1] == "prefill-0"
    # ...and all 384 of the same prompt again: enough.
    send(service, chat)
    assert asked[-1] == "prefill-1"
    assert p1.load == 300 and p0.load == 0  # each failed request gave back what it was charged


@pytest.mark.parametrize("config", [{"prefill_workers": 1}, {"prefix_cache_gb": 0}], ids=["one-worker", "no-cache"])
def test_no_affinity_where_there_is_no_choice_or_no_cache(config):
    service, _ = make_service(config.pop("prefill_workers", 2), **config)
    assert service.prefix_affinity is None
