"""A prompt goes, load allowing, to the prefill worker that prefilled its beginning, whose prefix
cache holds it: the map of beginnings to workers, and the service's use of it (worker handles
are stand-ins that record which worker was asked: the route is what is checked)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

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

    def worker_for(prompt):
        return affinity.worker_for(affinity.keys(prompt))

    chat = list(range(400))
    affinity.remember(affinity.keys(chat), "p0")
    assert worker_for(chat) == ("p0", 384)  # the same prompt again: all its blocks
    assert worker_for(chat + list(range(5000, 5250))) == ("p0", 256)  # the next turn
    affinity.remember(affinity.keys(chat[:130]), "p1")  # a shorter prompt with the same beginning, elsewhere since
    assert worker_for(chat) == ("p0", 384)  # the longest shared beginning decides
    assert worker_for(chat[:140]) == ("p1", 128)
    assert worker_for(list(range(1, 400))) is None  # differs in its first token
    assert worker_for(chat[:64]) is None
    affinity.forget(affinity.keys(chat[:130]), "p0")  # only what says p0
    assert worker_for(chat[:140]) == ("p1", 128) and worker_for(chat) == ("p0", 384)
    affinity.forget(affinity.keys(chat), "p0")  # its prefill failed there
    assert worker_for(chat) == ("p1", 128)
    # A block size that does not divide 64: what a cache can hold of a 64-token beginning is 48.
    coarse = PrefixAffinity(block_tokens=48)
    coarse.remember(coarse.keys(chat[:100]), "p0")
    assert coarse.worker_for(coarse.keys(chat)) == ("p0", 48)
    small = PrefixAffinity(max_entries=3)
    small.remember(small.keys(list(range(1000))), "p0")  # five beginnings: the two shortest are forgotten
    assert len(small) == 3 and small.worker_for(small.keys(list(range(200)))) is None
    assert small.worker_for(small.keys(list(range(600)))) == ("p0", 512)
    with pytest.raises(ValueError, match="max_entries"):
        PrefixAffinity(0)


class _Prefill:
    """A prefill worker handle that says it was asked, then answers (or fails)."""

    def __init__(self, name, asked, fails):
        self.name, self.asked, self.fails = name, asked, fails
        self.prefill = self

    def remote(self, *args):
        self.asked.append(self.name)
        if self.fails:
            raise RuntimeError("stand-in prefill")
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(SimpleNamespace(first_token=5, first_logprob=None, cached_tokens=0, prompt_logprobs=None))
        return answer


class _Decode:
    """A decode worker handle whose stream fails at once: the request ends after its prefill."""

    def __init__(self):
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, *args):
        raise RuntimeError("stand-in decode")


def make_service(prefill_workers=2, prefill_fails=False, **config):
    asked = []
    prefill = [WorkerSlot(f"prefill-{i}", _Prefill(f"prefill-{i}", asked, prefill_fails))
               for i in range(prefill_workers)]
    handles = ClusterHandles(prefill, [WorkerSlot("decode-0", _Decode(), capacity=10**6)],
                             [WorkerSlot("store-0", object(), capacity=10**9)])
    service = ClusterService(ServeConfig(**config), handles, tokenizer=None, kv_bytes_per_token=1, max_model_len=4096)
    return service, asked


def send(service, prompt, fails="stand-in decode"):
    async def run():
        with pytest.raises(RuntimeError, match=fails):
            async for _ in service.generate("r", prompt, SamplingParams(max_tokens=4)):
                pass

    asyncio.run(run())


def test_the_service_sends_a_prompt_to_the_worker_that_prefilled_its_beginning():
    service, asked = make_service()
    affinity = service.prefix_affinity
    p0, p1 = service.router.prefill
    chat = list(range(400))
    p0.load = 500  # busy: the first turn goes to p1
    send(service, chat)
    assert asked == ["prefill-1"] and affinity.worker_for(affinity.keys(chat)) == ("prefill-1", 384)
    # p1 is 300 tokens behind p0 now; it holds 256 of the next turn's first tokens, which would
    # cost 300 + (556 - 256 + 16) there against 556 on p0: p0.
    p0.load, p1.load = 0, 300
    send(service, chat + list(range(5000, 5156)))
    assert asked[-1] == "prefill-0"
    # All 384 of the same prompt again: 300 + (400 - 384 + 24) against 400: p1.
    send(service, chat)
    assert asked[-1] == "prefill-1"
    assert p1.load == 300 and p0.load == 0 and p0.active == p1.active == 0  # each request gave back its charge


def test_a_worker_whose_prefill_failed_is_not_named_for_its_prompt_again():
    service, asked = make_service(prefill_fails=True)
    affinity = service.prefix_affinity
    chat = list(range(400))
    service.router.prefill[0].load = 500
    send(service, chat, fails="stand-in prefill")
    assert asked == ["prefill-1"] and affinity.worker_for(affinity.keys(chat)) is None


@pytest.mark.parametrize("config", [{"prefill_workers": 1}, {"prefix_cache_gb": 0}], ids=["one-worker", "no-cache"])
def test_no_affinity_where_there_is_no_choice_or_no_cache(config):
    service, _ = make_service(config.pop("prefill_workers", 2), **config)
    assert service.prefix_affinity is None
