"""A request that finds every KV store full waits for room, first come first served, within the
queue's limit and its own timeout (it was refused with 503 at once). A unit test of the service's
admission alone: the router's accounting is real, the worker handles are plain objects because
admission never calls them."""

from __future__ import annotations

import asyncio
import time

import pytest

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.launcher import ClusterHandles
from oasiskv.cluster.router import Overloaded, WorkerSlot
from oasiskv.cluster.service import ClusterService, _Deadline
from oasiskv.models.sampling import SamplingParams


def make_service(max_queued_requests=8, store_bytes=1000, request_timeout_s=600.0):
    handles = ClusterHandles([WorkerSlot("prefill-0", object())], [WorkerSlot("decode-0", object(), capacity=1000)],
                             [WorkerSlot("store-0", object(), capacity=store_bytes)])
    config = ServeConfig(max_queued_requests=max_queued_requests, request_timeout_s=request_timeout_s)
    return ClusterService(config, handles, tokenizer=None, kv_bytes_per_token=1, max_model_len=2048)


def assign(service, request_id, store_bytes, timeout_s=30.0):
    return asyncio.ensure_future(service._assign(request_id, 1, 1, store_bytes, _Deadline(timeout_s)))


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_request_that_finds_the_store_full_waits_for_room_in_order():
    async def run():
        service = make_service()
        first = await assign(service, "a", 900)
        big = assign(service, "b", 200)
        await settle()
        small = assign(service, "c", 50)  # it would fit now, but waits behind the one before it
        await settle()
        assert not big.done() and not small.done() and service.queued == 2
        service._release(first)
        b, c = await asyncio.wait_for(asyncio.gather(big, small), 5)
        assert (b.request_id, c.request_id) == ("b", "c") and service.queued == 0
        assert service.router.stores[0].load == 250

    asyncio.run(run())


def test_the_wait_counts_against_the_queue_limit():
    async def run():
        service = make_service(max_queued_requests=1)
        await assign(service, "a", 900)
        waiting = assign(service, "b", 200)
        await settle()
        with pytest.raises(Overloaded, match="queue is at its limit") as info:
            await assign(service, "c", 200)
        assert info.value.status == 503 and info.value.retry_after_s >= 1
        waiting.cancel()

    asyncio.run(run())


def test_a_wait_ends_at_the_request_timeout_and_leaves_the_queue():
    async def run():
        service = make_service()
        await assign(service, "a", 900)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="stayed full"):
            await assign(service, "b", 200, timeout_s=0.3)
        assert 0.25 < time.monotonic() - started < 2 and service.queued == 0

    asyncio.run(run())


def queue_length(service) -> float:
    return service.metrics.registry.get_sample_value("oasiskv_queue_length")


def test_requests_that_time_out_or_hang_up_while_waiting_are_counted():
    """oasiskv_requests_total counted neither: the wait happens before the request is running."""
    def count(service, status):
        return service.metrics.requests.labels(status=status)._value.get()

    async def run():
        service = make_service(request_timeout_s=0.3)
        await assign(service, "a", 900)
        params = SamplingParams(max_tokens=100)
        with pytest.raises(TimeoutError, match="stayed full"):
            await anext(service.generate("late", [1] * 100, params))
        assert (count(service, "error"), count(service, "abort")) == (1, 0)
        service.config = service.config.model_copy(update={"request_timeout_s": 60.0})
        gone = asyncio.ensure_future(anext(service.generate("gone", [1] * 100, params)))
        await settle()
        assert service.queued == 1 and queue_length(service) == 1.0  # no health poll ran: the gauge reads it
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert (count(service, "error"), count(service, "abort"), service.queued) == (1, 1, 0)
        assert service.metrics.running._value.get() == 0 and queue_length(service) == 0.0

    asyncio.run(run())


def test_a_waiter_that_hangs_up_lets_the_next_one_in():
    async def run():
        service = make_service()
        first = await assign(service, "a", 900)
        gone = assign(service, "b", 200)
        await settle()
        next_one = assign(service, "c", 200)
        await settle()
        gone.cancel()  # the client hung up while it waited
        await settle()
        assert service.queued == 1 and not next_one.done()
        service._release(first)
        assert (await asyncio.wait_for(next_one, 5)).request_id == "c"
        assert service.queued == 0

    asyncio.run(run())


def test_a_request_larger_than_any_store_is_refused_at_once():
    async def run():
        service = make_service()
        with pytest.raises(ValueError, match="KV store"):
            await assign(service, "huge", 5000)
        assert service.queued == 0

    asyncio.run(run())


def test_a_request_larger_than_any_store_is_refused_at_once_even_behind_waiters():
    """Behind a waiting request it joined the wait without asking the router, and was refused
    only at the head of the line, once the requests before it had room."""
    async def run():
        service = make_service()
        await assign(service, "a", 900)
        waiting = assign(service, "b", 200)
        await settle()
        with pytest.raises(ValueError, match="KV store"):
            await asyncio.wait_for(assign(service, "huge", 5000), 1)
        assert service.queued == 1
        waiting.cancel()

    asyncio.run(run())


def test_a_request_is_accepted_when_it_is_assigned_or_when_it_begins_to_wait():
    """The API starts a response once every choice is accepted: a choice waiting for room in a
    store must not hold back its siblings' first bytes, and a refused one must not be accepted."""
    async def run():
        service = make_service()
        accepted = []

        def assign_noting(request_id, store_bytes):
            return asyncio.ensure_future(service._assign(request_id, 1, 1, store_bytes, _Deadline(30.0),
                                                         lambda: accepted.append(request_id)))

        first = await assign_noting("a", 900)
        waiting = assign_noting("b", 200)
        await settle()
        assert accepted == ["a", "b"] and not waiting.done()
        with pytest.raises(ValueError, match="KV store"):
            await assign_noting("huge", 5000)
        service._release(first)
        await asyncio.wait_for(waiting, 5)
        assert accepted == ["a", "b"]  # once each

    asyncio.run(run())


def test_an_acceptance_callback_that_raises_leaves_nothing_held():
    """Raised from the wait's path, it left the request's ticket at the head of the line, and every
    later request waited behind it until its timeout; from the fast path, its store memory."""
    def refuse():
        raise RuntimeError("the response is gone")

    async def run():
        service = make_service()
        with pytest.raises(RuntimeError, match="gone"):
            await service._assign("fast", 1, 1, 900, _Deadline(30.0), refuse)
        assert service.router.stores[0].load == 0
        first = await assign(service, "a", 900)
        with pytest.raises(RuntimeError, match="gone"):
            await service._assign("waiting", 1, 1, 200, _Deadline(30.0), refuse)
        assert service._store_waiters == []
        service._release(first)
        assert (await asyncio.wait_for(assign(service, "b", 200), 5)).request_id == "b"

    asyncio.run(run())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_tokens, max_tokens", [(7, 1008), (1000, 1049), (1, 1), (16, 16), (4000, 81)])
def test_a_reservation_covers_what_the_store_takes_for_the_whole_request(smollm2_dir, dtype, prompt_tokens, max_tokens):
    """The reservation left out the store's padding of each block to 4 KiB: 7 + 1008 tokens in
    bf16 were 15 KB short, and a store filled to its reservations refused the request's last
    write-back (a 503 after 30 s of decoding)."""
    import torch

    from oasiskv.cluster.server import store_bytes_per_token
    from oasiskv.kvstore import KVLayout, KVStore
    from oasiskv.models.config import ModelConfig

    config = ServeConfig(dtype=dtype)
    model_config = ModelConfig.from_dir(smollm2_dir)
    handles = ClusterHandles([WorkerSlot("prefill-0", object())], [WorkerSlot("decode-0", object(), capacity=1000)],
                             [WorkerSlot("store-0", object(), capacity=1)])
    service = ClusterService(config, handles, tokenizer=None,
                             kv_bytes_per_token=store_bytes_per_token(config, model_config), max_model_len=8192)
    reserved = service.store_bytes_needed(prompt_tokens, max_tokens)
    store = KVStore(reserved)  # a store holding exactly the reservation
    layout = KVLayout(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                      config.decode.block_size, getattr(torch, dtype))
    store.allocate("r", layout, prompt_tokens)
    store.extend("r", prompt_tokens + max_tokens)  # what the write-backs grow it to, at most
    assert store.stats().used_bytes <= reserved


def test_a_hang_up_while_the_wait_ends_its_recheck_is_not_lost():
    """The wait re-checks each second: it cancels its inner wait and waits for that to end. A
    hang-up in those turns was taken for the inner wait's own cancel and swallowed: the request
    went on waiting, and was prefilled and decoded for nobody once room came."""
    async def run():
        ending = asyncio.Event()

        async def slow_to_end():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                ending.set()
                await asyncio.sleep(0.2)  # turns it takes to end (a Ray call's cancel, say)
                raise

        deadline = _Deadline(30)
        waiter = asyncio.ensure_future(deadline.wait(slow_to_end(), at_most=0.05))
        await ending.wait()
        waiter.cancel()  # the client hangs up now
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, 5)

    asyncio.run(run())


class _Ref:
    """Stands in for a Ray ObjectRef: awaitable any number of times, set by the test."""

    def __init__(self):
        self.error, self.done = None, asyncio.Event()

    def set(self, error=None):
        self.error = error
        self.done.set()

    def __await__(self):
        return self._get().__await__()

    async def _get(self):
        await self.done.wait()
        if self.error is not None:
            raise self.error


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args):
        return self.fn(*args)


def test_a_hung_up_requests_room_goes_back_once_its_kv_has_left_the_store():
    """A hang-up during the prefill gave the request's room back at once, while its KV stayed in
    the store until the prefill stopped at its next chunk: the request waiting for that room was
    routed into a store that still held it (StoreFull, a 503 for a request that did nothing)."""
    from types import SimpleNamespace

    from oasiskv.cluster.api import _Merged

    in_store, prefills = {}, {}

    def prefill(request_id, ids, *_):
        in_store[request_id] = len(ids)  # one byte a token
        prefills[request_id] = _Ref()
        return prefills[request_id]

    async def free(request_id):
        in_store.pop(request_id, None)

    tokenizer = SimpleNamespace(eos_token_ids=(), vocab_size=1000, decode=lambda ids, skip_special_tokens=True: "")
    prefill_actor = SimpleNamespace(prefill=_Method(prefill), cancel=_Method(lambda request_id: None))
    handles = ClusterHandles([WorkerSlot("prefill-0", prefill_actor)],
                             [WorkerSlot("decode-0", SimpleNamespace(), capacity=10**6)],
                             [WorkerSlot("store-0", SimpleNamespace(free=_Method(free)), capacity=2000, address="s:1")])
    service = ClusterService(ServeConfig(), handles, tokenizer, kv_bytes_per_token=1, max_model_len=8192)
    params = SamplingParams(max_tokens=100)

    async def run():
        first = _Merged([lambda on_accepted: service.generate("a", [1] * 1500, params, on_accepted=on_accepted)])
        await settle()
        second = _Merged([lambda on_accepted: service.generate("b", [1] * 1500, params, on_accepted=on_accepted)])
        await settle()
        assert service.queued == 1
        await first.shut()  # a's client hangs up while it prefills
        await settle()
        assert "b" not in in_store and service.queued == 1  # a's KV is still there
        prefills["a"].set(RuntimeError("prefill cancelled"))  # it stops at its next chunk, and is freed
        for _ in range(50):
            await settle()
        assert set(in_store) == {"b"} and service.queued == 0
        await second.shut()

    asyncio.run(run())
