"""Router accounting and refusals (a unit test of the router alone: worker handles are plain
objects because the router never calls them)."""

from __future__ import annotations

import pytest

from oasiskv.cluster.router import Overloaded, Router, StoresFull, TooLarge, WorkerSlot


def _router(max_queued=1):
    prefill = [WorkerSlot("p0", object()), WorkerSlot("p1", object())]
    decode = [WorkerSlot("d0", object(), capacity=10), WorkerSlot("d1", object(), capacity=10)]
    stores = [WorkerSlot("s0", object(), capacity=1000)]
    return Router(prefill, decode, stores, max_queued_requests=max_queued)


def test_least_loaded_workers_are_chosen_and_released():
    router = _router()
    a = router.assign("a", prompt_tokens=100, rows=6, store_bytes=100)
    b = router.assign("b", prompt_tokens=10, rows=6, store_bytes=100)
    assert a.decode is not b.decode and a.prefill is not b.prefill
    router.prefill_done(a)
    assert a.prefill.load == 0 and b.prefill.load == 10
    router.release(a)
    router.release(b)
    router.release(b)  # idempotent
    assert all(w.load == 0 and w.active == 0 for w in router.decode + router.prefill + router.stores)


def test_full_pools_queue_then_refuse_with_retry_after():
    router = _router(max_queued=1)
    router.assign("a", 1, 10, 1)
    router.assign("b", 1, 10, 1)
    queued = router.assign("c", 1, 10, 1)  # both pools full: one may wait
    assert queued.queued and router.queued == 1
    with pytest.raises(Overloaded) as info:
        router.assign("d", 1, 10, 1)
    assert info.value.status == 429 and info.value.retry_after_s >= 1
    router.release(queued)
    assert router.queued == 0


def test_a_queued_request_leaves_the_queue_once_its_engine_admits_it():
    router = _router(max_queued=1)
    router.assign("a", 1, 10, 1)
    router.assign("b", 1, 10, 1)
    queued = router.assign("c", 1, 10, 1)
    with pytest.raises(Overloaded):
        router.assign("d", 1, 10, 1)
    router.admitted(queued)  # its first decode output came
    router.admitted(queued)  # idempotent
    assert not queued.queued and router.queued == 0
    assert router.assign("d", 1, 10, 1).queued  # the queue has room again
    router.release(queued)
    assert router.queued == 1


def test_a_worker_running_max_num_seqs_requests_queues_the_next_as_a_full_pool_does():
    decode = [WorkerSlot("d0", object(), capacity=100, seats=2)]
    router = Router([WorkerSlot("p0", object())], decode, [WorkerSlot("s0", object(), capacity=1000)],
                    max_queued_requests=1)
    first, second = router.assign("a", 1, 1, 1), router.assign("b", 1, 1, 1)
    assert not first.queued and not second.queued
    third = router.assign("c", 1, 1, 1)  # rows to spare, but its engine runs two at most
    assert third.queued and router.queued == 1
    with pytest.raises(Overloaded, match="max_num_seqs"):
        router.assign("d", 1, 1, 1)
    router.release(first)
    router.release(third)
    assert not router.assign("e", 1, 1, 1).queued and router.queued == 0


def test_store_full_is_503_and_too_large_is_refused():
    """The router refuses; the service makes a request that finds every store full wait for
    room (tests/cluster/test_store_wait.py)."""
    router = _router()
    router.assign("a", 1, 1, 900)
    with pytest.raises(StoresFull) as info:
        router.assign("b", 1, 1, 200)
    assert info.value.status == 503 and isinstance(info.value, Overloaded)
    with pytest.raises(TooLarge, match="decode KV pool"):
        router.assign("c", 1, 11, 1)
    with pytest.raises(TooLarge, match="KV store"):
        router.assign("d", 1, 1, 5000)


def test_no_healthy_decode_worker_is_503():
    router = _router()
    for w in router.decode:
        w.healthy = False
    with pytest.raises(Overloaded) as info:
        router.assign("a", 1, 1, 1)
    assert info.value.status == 503


def test_a_prefill_hint_is_followed_while_it_finishes_no_later_than_the_least_loaded():
    router = _router()
    first = router.assign("first", prompt_tokens=1000, rows=1, store_bytes=1)
    assert first.prefill.name == "p0" and first.prefill.load == 1000
    # p0 holds 992 of the prompt: 1000 queued + 70 there, against 0 + 1000 on p1.
    behind = router.assign("behind", prompt_tokens=1000, rows=1, store_bytes=1, prefill_hint=("p0", 992))
    assert behind.prefill.name == "p1" and behind.prompt_tokens == 1000
    # Now p0 and p1 both have 1000 queued: on p0 the prompt costs its 8 uncached tokens plus
    # 992 / 16 for the cached ones' store write and summaries (70), against 1000 on p1.
    hinted = router.assign("hinted", prompt_tokens=1000, rows=1, store_bytes=1, prefill_hint=("p0", 992))
    assert hinted.prefill.name == "p0" and hinted.prompt_tokens == 70 and hinted.prefill.load == 1070
    router.prefill_done(hinted)
    router.prefill_done(hinted)  # once only
    assert router.prefill[0].load == 1000 and router.prefill[0].active == 1
    # A hint of more than the prompt is held to all but its last token: charged at least 1 + 1.
    whole = router.assign("whole", prompt_tokens=64, rows=1, store_bytes=1, prefill_hint=("p0", 5000))
    assert whole.prompt_tokens == 1 + 4
    router.release(whole)
    # A hint naming a worker that is down, or none of them, is the least loaded.
    router.prefill[0].healthy = False
    assert router.assign("down", 1000, 1, 1, prefill_hint=("p0", 992)).prefill.name == "p1"
    router.prefill[0].healthy = True
    assert router.assign("unknown", 100, 1, 1, prefill_hint=("p9", 64)).prompt_tokens == 100
    for a in (first, behind, hinted):
        router.release(a)

