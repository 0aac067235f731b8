"""A decode step that raises takes only the requests it held: their streams end with the error,
their pool rows and store memory are given back, and the worker serves the next request. Steps
that keep failing mean a broken engine: the worker then reports unhealthy and refuses work."""

from __future__ import annotations

import asyncio

import pytest

from oasiskv.decode_node.worker import DecodeWorker
from oasiskv.kvstore import KVStore, connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller

PARAMS = {"max_tokens": 24, "ignore_eos": True}


@pytest.fixture
def worker():
    worker = DecodeWorker("smollm2-135m", {"kv_pool_gb": 0.05, "budget_tokens": 64}, transport="inproc")
    yield worker
    worker.shutdown()


def failing_steps(worker, count: int):
    """Make the engine's next `count` steps raise (an injected fault, as a NaN in sampling was)."""
    real_step = worker.engine.step
    left = [count]

    def step():
        if left[0]:
            left[0] -= 1
            real_step()  # the step runs (and moves state) before it fails, as a real fault would
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_step()

    worker.engine.step = step


async def collect(worker, result, store):
    return await drain(worker.generate(result, PARAMS, store))


async def drain(stream):
    """(the items of a stream, the error it ended with or None)."""
    items = []
    try:
        async for item in stream:
            items.append(item)
    except RuntimeError as error:
        return items, error
    return items, None


def prefill_long_requests(smollm2_llm, worker, addresses, params):
    """One 600-token slice of json/decoder.py per store address, prefilled into that store with
    the worker's working-set geometry, so every decode step prefetches blocks."""
    import json.decoder

    source = smollm2_llm.encode(open(json.decoder.__file__).read())
    config = worker.config
    return [Prefiller(smollm2_llm.model, connect(address)).prefill(
        f"long-{i}", source[i * 50 : i * 50 + 600], SamplingParams(**params), budget_blocks=config.budget_blocks,
        excluded_head_blocks=config.sink_blocks, excluded_tail_blocks=config.window_blocks)
        for i, address in enumerate(addresses)]


def prefill(smollm2_llm, store, request_id, text):
    return Prefiller(smollm2_llm.model, connect(store)).prefill(
        request_id, smollm2_llm.encode(text), SamplingParams(**PARAMS))


def test_a_failed_step_ends_its_requests_and_the_worker_goes_on(smollm2_llm, worker):
    store = KVStore(64 * 2**20)
    first = [prefill(smollm2_llm, store, f"failing-{i}", f"def function_{i}(x):\n    return") for i in range(2)]
    failing_steps(worker, 1)

    async def run_failing():
        return await asyncio.gather(*(collect(worker, r, store) for r in first))

    outcomes = asyncio.run(run_failing())
    # The request(s) in the engine at the failing step end with its error; one that reached the
    # engine only after it is served in full.
    assert any(error is not None for _, error in outcomes)
    for items, error in outcomes:
        if error is not None:
            assert "decode step failed" in str(error) and "nan" in str(error)
            assert not any(item["finished"] for item in items)
        else:
            assert items[-1]["finished"] and items[-1]["num_tokens"] == PARAMS["max_tokens"]
    stats = worker.stats()
    assert stats["healthy"] and stats["step_failures"] == 1
    assert stats["pool_rows_used"] == 0 and stats["running"] == stats["waiting"] == 0
    assert store.stats().num_requests == 0  # the failed requests' KV was freed

    later = prefill(smollm2_llm, store, "after", "class Point:\n    def __init__(self")
    items, error = asyncio.run(collect(worker, later, store))
    assert error is None and items[-1]["finished"] and items[-1]["num_tokens"] == PARAMS["max_tokens"]
    assert worker.stats()["healthy"] and store.stats().num_requests == 0

    from oasiskv.cluster.metrics import ServingMetrics
    from prometheus_client import generate_latest

    metrics = ServingMetrics()
    metrics.worker_stats["decode-0"] = worker.stats()
    assert 'oasiskv_decode_step_failures_total{worker="decode-0"} 1.0' in generate_latest(metrics.registry).decode()


def test_steps_that_keep_failing_make_the_worker_unhealthy(smollm2_llm, worker):
    store = KVStore(64 * 2**20)
    failing_steps(worker, DecodeWorker.MAX_CONSECUTIVE_FAILURES)
    for i in range(DecodeWorker.MAX_CONSECUTIVE_FAILURES):
        result = prefill(smollm2_llm, store, f"broken-{i}", f"import os\nprint({i}")
        _, error = asyncio.run(collect(worker, result, store))
        assert error is not None
    stats = worker.stats()
    assert not stats["healthy"] and "in a row failed" in stats["error"]
    result = prefill(smollm2_llm, store, "refused", "x = 1")
    _, error = asyncio.run(collect(worker, result, store))
    assert error is not None and "decode worker failed" in str(error)
    store.free("refused")  # refused before the engine saw it: the caller still owns its KV
    assert store.stats().num_requests == 0


def test_a_store_that_dies_ends_its_requests_and_leaves_the_worker_healthy(smollm2_llm):
    """The store holding the running requests stops (its pod lost, say): their streams end with
    its error, each alone (no step fails), the worker gives back their pool rows although it
    cannot tell the store to free them (counted), stays healthy, and serves a request on another
    store."""
    from oasiskv.kvstore import KVStoreServer

    worker = DecodeWorker("smollm2-135m", {"kv_pool_gb": 0.05, "budget_tokens": 64}, transport="tcp")
    dying = KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp")
    other = KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp")
    dying.start()
    other.start()
    try:
        params = {**PARAMS, "max_tokens": 200}

        async def run_until_the_store_dies():
            results = [Prefiller(smollm2_llm.model, connect(dying.address)).prefill(
                f"doomed-{i}", smollm2_llm.encode(f"def function_{i}(x):\n    return"), SamplingParams(**params))
                for i in range(2)]
            streams = [worker.generate(r, params, dying.address) for r in results]
            for stream in streams:
                await anext(stream)
            dying.stop()
            errors = []
            for stream in streams:
                try:
                    async for _ in stream:
                        pass
                except Exception as error:
                    errors.append(error)
            return errors

        errors = asyncio.run(run_until_the_store_dies())
        assert len(errors) == 2 and all("its store failed it: StoreUnavailable" in str(e) for e in errors)
        stats = worker.stats()
        assert stats["healthy"], stats["error"]
        assert stats["store_free_failures"] == 2 and stats["step_failures"] == 0
        assert stats["pool_rows_used"] == 0 and stats["running"] == stats["waiting"] == 0

        later = Prefiller(smollm2_llm.model, connect(other.address)).prefill(
            "after", smollm2_llm.encode("class Point:\n    def __init__(self"), SamplingParams(**PARAMS))
        items, error = asyncio.run(collect(worker, later, other.address))
        assert error is None and items[-1]["finished"] and items[-1]["num_tokens"] == PARAMS["max_tokens"]
        assert other.store.stats().num_requests == 0
    finally:
        worker.shutdown()
        other.stop()
        dying.stop()


def test_a_request_whose_store_is_gone_at_admission_fails_alone(smollm2_llm):
    """A request waits in the queue while its store dies: at admission it ends with the store's
    error, and the request decoding beside it (on another store) is not touched. Before, the
    failed admission failed the whole step, and the request being admitted was in no list:
    its stream waited forever and its pool rows were lost."""
    from oasiskv.kvstore import KVStoreServer

    worker = DecodeWorker("smollm2-135m", {"kv_pool_gb": 0.05, "budget_tokens": 64, "max_num_seqs": 1},
                          transport="tcp")
    stores = [KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp") for _ in range(2)]
    for store in stores:
        store.start()
    running_store, dying = stores
    try:
        results = [Prefiller(smollm2_llm.model, connect(store.address)).prefill(
            f"queued-{i}", smollm2_llm.encode(f"def function_{i}(x):\n    return"), SamplingParams(**PARAMS))
            for i, store in enumerate(stores)]

        async def run():
            first = worker.generate(results[0], PARAMS, running_store.address)
            await anext(first)  # admitted and decoding; the other waits (one request at a time)
            waiting = asyncio.ensure_future(collect(worker, results[1], dying.address))
            while worker.stats()["waiting"] == 0:  # bound to its store and queued
                await asyncio.sleep(0.01)
            dying.stop()
            rest = [item async for item in first]
            return rest, await waiting

        rest, (items, error) = asyncio.run(run())
        assert rest[-1]["finished"] and rest[-1]["num_tokens"] == PARAMS["max_tokens"]
        assert items == [] and error is not None and "not admitted" in str(error)
        stats = worker.stats()
        assert stats["healthy"] and stats["step_failures"] == 0
        assert stats["pool_rows_used"] == 0 and stats["running"] == stats["waiting"] == 0
        assert running_store.store.stats().num_requests == 0
    finally:
        worker.shutdown()
        for store in stores:
            store.stop()


def test_a_store_that_dies_under_the_prefetches_ends_only_its_request(smollm2_llm):
    """Two long requests decode in one batch, each from its own store, and each step prefetches
    blocks for both in one I/O job. One store stops: its request ends with the failed read, the
    other decodes to the end, and the worker stays healthy. Before, the shared job's failure
    failed the step, and the worker, unable to confirm the transfers had ended, broke for good."""
    from oasiskv.kvstore import KVStoreServer

    config = {"kv_pool_gb": 0.05, "budget_tokens": 64, "max_replace_fraction": 1.0, "prefetch_rank_fraction": 1.0}
    worker = DecodeWorker("smollm2-135m", config, transport="tcp")
    stores = [KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp") for _ in range(2)]
    for store in stores:
        store.start()
    surviving, dying = stores
    try:
        params = {**PARAMS, "max_tokens": 96}
        results = prefill_long_requests(smollm2_llm, worker, [store.address for store in stores], params)

        async def run():
            streams = [worker.generate(r, params, s.address) for r, s in zip(results, stores)]
            for stream in streams:
                await anext(stream)
            fetched = worker.engine.counters.blocks_fetched
            dying.stop()
            return fetched, [await drain(stream) for stream in streams]

        fetched, ((items, error), (_, dying_error)) = asyncio.run(run())
        assert fetched > 0, "no block was prefetched before the store stopped: nothing tested"
        assert error is None and items[-1]["finished"] and items[-1]["num_tokens"] == params["max_tokens"]
        assert dying_error is not None and "a block read from its store failed: StoreUnavailable" in str(dying_error)
        stats = worker.stats()
        assert stats["healthy"], stats["error"]
        assert stats["step_failures"] == 0 and stats["pool_rows_used"] == 0
        assert surviving.store.stats().num_requests == 0
    finally:
        worker.shutdown()
        for store in stores:
            store.stop()


@pytest.fixture
def freezable_store():
    """A TCP store in a process of its own, which a test can freeze (SIGSTOP: a node under memory
    pressure, a network partition) and thaw; its address and process."""
    import signal
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "oasiskv.kvstore", "--port", "0", "--transport", "tcp",
                                "--capacity-gb", "0.0625", "--no-prefault"], stdout=subprocess.PIPE, text=True)
    try:
        ready = process.stdout.readline()
        assert ready.startswith("READY "), ready
        yield ready.split()[1], process
    finally:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        process.wait(30)


def wait_for_rows_and_store(worker, address, timeout_s=30):
    """Once a frozen store answers again: every pool row comes back, and the store holds nothing."""
    import time

    deadline = time.monotonic() + timeout_s
    while worker.stats()["pool_rows_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker.stats()["pool_rows_used"] == 0 and worker.stats()["pool_rows_quarantined"] == 0
    store = connect(address)
    while store.stats().num_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.stats().num_requests == 0


def test_a_store_that_stops_answering_holds_up_only_its_own_request(smollm2_llm, freezable_store):
    """The store of one of two long requests stops answering while both decode in one batch.
    Its request ends with a StoreTimeout after fetch_timeout_s; the other, on another store,
    decodes to the end; the worker stays healthy. The frozen store's transfers may still write
    into the failed request's pool rows, so the rows wait in quarantine until those have ended
    (here: the store answers again), and the request's store memory is freed then too. Before,
    the decode step raised, every request in it ended, and the worker, unable to confirm the
    transfers had ended, broke for good; every layer of a step also waited out the timeout again."""
    import signal
    import time

    from oasiskv.kvstore import KVStoreServer

    frozen_address, frozen = freezable_store
    config = {"kv_pool_gb": 0.05, "budget_tokens": 64, "max_replace_fraction": 1.0, "prefetch_rank_fraction": 1.0,
              "fetch_timeout_s": 2.0}
    surviving = KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp")
    surviving.start()
    worker = DecodeWorker("smollm2-135m", config, transport="tcp")
    try:
        params = {**PARAMS, "max_tokens": 96}
        addresses = [surviving.address, frozen_address]
        results = prefill_long_requests(smollm2_llm, worker, addresses, params)

        async def run():
            streams = [worker.generate(r, params, address) for r, address in zip(results, addresses)]
            for stream in streams:
                await anext(stream)
            frozen.send_signal(signal.SIGSTOP)
            return [await drain(stream) for stream in streams]

        started = time.monotonic()
        (items, error), (_, frozen_error) = asyncio.run(run())
        assert error is None and items[-1]["finished"] and items[-1]["num_tokens"] == params["max_tokens"]
        assert frozen_error is not None and "a block read from its store failed: StoreTimeout" in str(frozen_error)
        # One timeout, not one per layer (30 layers x 2 s).
        assert time.monotonic() - started < 40
        stats = worker.stats()
        assert stats["healthy"], stats["error"]
        assert stats["step_failures"] == 0 and stats["running"] == 0
        assert stats["pool_rows_quarantined"] > 0 and stats["pool_rows_used"] == stats["pool_rows_quarantined"]
        assert stats["pool_quarantined"] == stats["pool_rows_quarantined"] / stats["pool_rows"]
        assert surviving.store.stats().num_requests == 0

        frozen.send_signal(signal.SIGCONT)
        wait_for_rows_and_store(worker, frozen_address)
    finally:
        worker.shutdown()
        surviving.stop()


def decode_beside_a_late_request(smollm2_llm, frozen_address, frozen, contacted_before: bool):
    """A request decodes from a healthy store while the frozen store's process stops; then a
    request for the frozen store arrives. Returns the running request's stream
    (items, error), the late one's error, the order in which the two ended, and the worker's
    stats; once the frozen store answers again, every pool row and the store memory of the
    requests the worker took are back.
    `contacted_before`: the worker served a short request from the frozen store first, so it
    has a client for it."""
    import signal

    from oasiskv.kvstore import KVStoreServer

    config = {"kv_pool_gb": 0.05, "budget_tokens": 64, "fetch_timeout_s": 15.0}
    surviving = KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp")
    surviving.start()
    worker = DecodeWorker("smollm2-135m", config, transport="tcp")
    try:
        params = {**PARAMS, "max_tokens": 64}
        running, late, *earlier = prefill_long_requests(
            smollm2_llm, worker, [surviving.address, frozen_address] + [frozen_address] * contacted_before, params)
        ended: list[str] = []

        async def watch(name, stream):
            try:
                outcome = await drain(stream)
            except Exception as error:  # generate raises before its first item when it cannot connect
                outcome = [], error
            ended.append(name)
            return outcome

        async def run():
            if contacted_before:
                assert (await drain(worker.generate(earlier[0], {**params, "max_tokens": 4}, frozen_address)))[1] is None
            stream = worker.generate(running, params, surviving.address)
            await anext(stream)
            frozen.send_signal(signal.SIGSTOP)
            return await asyncio.gather(watch("running", stream),
                                        watch("late", worker.generate(late, params, frozen_address)))

        (items, error), (_, late_error) = asyncio.run(run())
        stats = worker.stats()
        assert surviving.store.stats().num_requests == 0
        frozen.send_signal(signal.SIGCONT)
        if contacted_before:
            wait_for_rows_and_store(worker, frozen_address)
        # else the late request never reached the worker, which neither took rows for it nor holds
        # its store memory (the API frees it through the store)
        return (items, error), late_error, ended, stats
    finally:
        worker.shutdown()
        surviving.stop()


@pytest.mark.slow  # in CI's slow step: keeps the default suite well under 25 minutes
@pytest.mark.parametrize("contacted_before, late_error_text", [
    (True, "not admitted: StoreTimeout"),  # its first working set is read off the decode loop
    (False, "did not answer 'ping'"),  # the worker connects to the store off the decode loop
], ids=["admission", "first-contact"])
def test_a_request_for_a_store_that_stops_answering_does_not_hold_up_the_batch(
        smollm2_llm, freezable_store, contacted_before, late_error_text):
    """A request arrives for a store that has stopped answering while another request decodes
    from a healthy store. Its reads (its first working set; and first, for a store the worker
    has not used yet, the connect) wait on threads of their own: the running request decodes to
    the end before the new one fails with the timeout. Before, the decode loop waited for them,
    so every running request stalled for the timeout (30 s by default) once per request sent to
    that store."""
    (items, error), late_error, ended, stats = decode_beside_a_late_request(
        smollm2_llm, *freezable_store, contacted_before=contacted_before)
    assert error is None and items[-1]["finished"] and items[-1]["num_tokens"] == 64
    assert late_error is not None and late_error_text in str(late_error)
    assert ended == ["running", "late"]
    assert stats["healthy"], stats["error"]
    assert stats["step_failures"] == 0 and stats["running"] == stats["admitting"] == stats["waiting"] == 0


def decode_while_a_store_stops_answering(smollm2_llm, freezable_store, config, num_frozen, max_tokens):
    """One request decodes from a healthy store beside `num_frozen` requests from a store that
    stops answering once all have emitted a first token. Returns the healthy request's stream
    (items, error), the frozen requests' errors, the order in which they ended (the healthy one
    is 'running'), the longest gap between the healthy request's items, and the worker's stats;
    once the frozen store answers again, every pool row and all store memory are back."""
    import signal
    import time

    from oasiskv.kvstore import KVStoreServer

    frozen_address, frozen = freezable_store
    surviving = KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp")
    surviving.start()
    worker = DecodeWorker("smollm2-135m", config, transport="tcp")
    try:
        params = {**PARAMS, "max_tokens": max_tokens}
        addresses = [surviving.address] + [frozen_address] * num_frozen
        results = prefill_long_requests(smollm2_llm, worker, addresses, params)
        ended: list[str] = []
        arrivals: list[float] = []

        async def watch(name, stream):
            items, error = [], None
            try:
                async for item in stream:
                    items.append(item)
                    if name == "running":
                        arrivals.append(time.monotonic())
            except RuntimeError as failure:
                error = failure
            ended.append(name)
            return items, error

        async def run():
            streams = [worker.generate(r, params, address) for r, address in zip(results, addresses)]
            firsts = [await anext(stream) for stream in streams]
            assert all(not first["finished"] for first in firsts)
            frozen.send_signal(signal.SIGSTOP)
            return await asyncio.gather(*(watch("running" if i == 0 else f"frozen-{i}", stream)
                                          for i, stream in enumerate(streams)))

        (items, error), *frozen_outcomes = asyncio.run(run())
        stats = worker.stats()
        assert surviving.store.stats().num_requests == 0
        frozen.send_signal(signal.SIGCONT)
        wait_for_rows_and_store(worker, frozen_address)
        longest_gap = max((b - a for a, b in zip(arrivals, arrivals[1:])), default=0.0)
        return (items, error), [e for _, e in frozen_outcomes], ended, longest_gap, stats
    finally:
        worker.shutdown()
        surviving.stop()


@pytest.mark.slow  # in CI's slow step: keeps the default suite under 25 minutes
def test_a_write_back_to_a_store_that_stops_answering_holds_out_only_its_own_request(smollm2_llm, freezable_store):
    """Under the 'skip' miss policy a request whose store has stopped answering decodes on
    until a block it wrote back is due to be overwritten in the local window: it sits out the
    steps from then on, while the batch decodes on, and ends with a StoreTimeout once the
    write-back is a fetch timeout late. Before, the decode loop waited for that write-back, and
    every running request stalled for the timeout."""
    config = {"kv_pool_gb": 0.05, "budget_tokens": 64, "miss_policy": "skip", "fetch_timeout_s": 20.0}
    (items, error), (frozen_error,), ended, longest_gap, stats = decode_while_a_store_stops_answering(
        smollm2_llm, freezable_store, config, num_frozen=1, max_tokens=160)
    # The healthy request never waited for the frozen store's write-back (a 20 s stall before).
    # Which of the two ends first is the machine's speed: 160 tokens took over 20 s under load.
    assert longest_gap < 0.5 * 20.0, longest_gap
    assert sorted(ended) == ["frozen-1", "running"]
    assert error is None and items[-1]["finished"] and items[-1]["num_tokens"] == 160
    assert frozen_error is not None and "its store failed it: StoreTimeout" in str(frozen_error)
    assert "20.0s after it was issued" in str(frozen_error)
    assert stats["healthy"], stats["error"]
    assert stats["step_failures"] == 0 and stats["running"] == 0


@pytest.mark.slow  # in CI's slow step: keeps the default suite under 25 minutes
def test_the_transfers_of_a_store_that_stops_answering_time_out_together(smollm2_llm, freezable_store):
    """Two requests read from a store that stops answering, under the 'wait' miss policy: the
    layer that waits for their prefetches waits once, until the transfers' common deadline
    (fetch_timeout_s after they were issued), and both end with a StoreTimeout. Before, each
    wait started its own timeout, so the batch stalled for the timeout once per request."""
    config = {"kv_pool_gb": 0.05, "budget_tokens": 64, "max_replace_fraction": 1.0, "prefetch_rank_fraction": 1.0,
              "fetch_timeout_s": 6.0}
    (items, error), frozen_errors, ended, longest_gap, stats = decode_while_a_store_stops_answering(
        smollm2_llm, freezable_store, config, num_frozen=2, max_tokens=64)
    assert error is None and items[-1]["finished"] and items[-1]["num_tokens"] == 64
    assert all(e is not None and "StoreTimeout" in str(e) for e in frozen_errors), frozen_errors
    assert ended[-1] == "running"
    # One stall of at most the timeout, against two (12 s) before.
    assert 0.5 * 6.0 < longest_gap < 1.5 * 6.0, longest_gap
    assert stats["healthy"], stats["error"]
    assert stats["step_failures"] == 0 and stats["running"] == 0


def test_a_request_ended_in_a_step_that_then_failed_gets_its_end(smollm2_llm, worker):
    """It had left the engine when the step raised, so the abort of the step's requests did not
    name it, and its stream waited for ever."""
    store = KVStore(64 * 2**20)
    one_token = {"max_tokens": 1}
    result = Prefiller(smollm2_llm.model, connect(store)).prefill(
        "one-token", smollm2_llm.encode("def f(x):"), SamplingParams(**one_token))
    join = worker.engine._join_admitted
    failures = [RuntimeError("injected after the first token ended its request")]

    def join_once_failing(wait_s):
        if failures:
            raise failures.pop()
        return join(wait_s)

    worker.engine._join_admitted = join_once_failing

    async def run():
        return await asyncio.wait_for(drain(worker.generate(result, one_token, store)), timeout=30)

    items, error = asyncio.run(run())
    assert error is None and items[-1]["finished"] and items[-1]["finish_reason"] == "length"
    assert worker.stats()["step_failures"] == 1 and store.stats().num_requests == 0


def test_a_request_id_already_decoding_is_refused_without_touching_the_first(smollm2_llm, worker):
    """The engine's refusal of the second freed the first's store memory under the shared id."""
    store = KVStore(64 * 2**20)
    first = prefill(smollm2_llm, store, "shared-id", "def function(x):\n    return")

    async def run():
        stream = worker.generate(first, PARAMS, store)
        head = await stream.__anext__()
        with pytest.raises(ValueError, match="'shared-id' is already decoding on this worker"):
            await worker.generate(first, PARAMS, store).__anext__()
        rest, error = await drain(stream)
        return [head, *rest], error

    items, error = asyncio.run(run())
    assert error is None and items[-1]["finished"] and items[-1]["num_tokens"] == PARAMS["max_tokens"]
    assert store.stats().num_requests == 0
