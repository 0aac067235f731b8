"""A store that fails one request (its write-back does not land, or it refuses to extend the
request) ends that request alone: it keeps what it emitted, its caller gets the error, its pool
rows go back, and the requests beside it in the batch decode on. Before, the failure raised out
of the step and the worker ended every request in it."""

from __future__ import annotations

import pytest

from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.kvstore import connect
from oasiskv.kvstore.errors import StoreFull, TransferError
from oasiskv.prefill_node.prefill import Prefiller

from .conftest import GREEDY, run_engine


class _FailedWriteBack:
    def done(self) -> bool:
        return False

    def wait(self, timeout=None) -> None:
        raise TransferError("the write-back's link went down")


class _WriteBacksFail:
    """The store client, but every write-back fails (the test's one injected fault)."""

    def __init__(self, client):
        self._client = client
        self.write_backs = 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def write_blocks(self, *args, **kwargs):
        self.write_backs += 1
        return _FailedWriteBack()


class _ExtendsRefused(_WriteBacksFail):
    """The store client, but the store refuses to extend any request (it is full)."""

    def extend(self, request_id, num_tokens):
        self.write_backs += 1
        raise StoreFull(f"cannot extend {request_id} to {num_tokens} tokens: the store is full")

    def write_blocks(self, *args, **kwargs):
        return self._client.write_blocks(*args, **kwargs)


@pytest.mark.parametrize("fault, error", [(_WriteBacksFail, "TransferError"), (_ExtendsRefused, "StoreFull")])
def test_a_failed_write_back_ends_its_request_alone(smollm2_llm, store, prompts, fault, error):
    config = DecodeConfig(budget_tokens=256)
    _, (expected_dense,) = run_engine(smollm2_llm, store, prompts[1:], config.model_copy(update={"mode": "dense"}),
                                      tag="-alone")
    client = connect(store)
    failing = fault(client)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, failing, config)
    prefiller = Prefiller(smollm2_llm.model, client)
    # lookahead writes back every block it fills; dense writes nothing back.
    for request_id, prompt, mode in (("writes-back", prompts[0], "lookahead"), ("dense-beside", prompts[1], "dense")):
        result = prefiller.prefill(request_id, prompt, GREEDY, budget_blocks=config.budget_blocks,
                                   excluded_head_blocks=config.sink_blocks, excluded_tail_blocks=config.window_blocks)
        engine.add(result, GREEDY, mode=mode)
    outputs = engine.run_to_completion()
    assert failing.write_backs > 0, "no block filled: nothing tested"

    failed, beside = outputs["writes-back"], outputs["dense-beside"]
    assert failed.error is not None and error in failed.error and failed.finish_reason is None
    assert 1 <= len(failed.token_ids) < GREEDY.max_tokens
    assert beside.error is None and beside.finish_reason == "length"
    assert beside.token_ids == expected_dense
    assert engine.pool.allocator.num_free == engine.pool.num_rows
    assert not engine.has_unfinished and store.stats().num_requests == 0
    engine.close()


class _StopsAnswering:
    """The store client, but once `stop()` is called every call and transfer blocks until
    `answer()` (a store process frozen, say; the test's one injected fault)."""

    def __init__(self, client):
        import threading

        self._client = client
        self._answering = threading.Event()
        self._answering.set()

    def stop(self):
        self._answering.clear()

    def answer(self):
        self._answering.set()

    def __getattr__(self, name):
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            assert self._answering.wait(60), "the test never let the store answer"
            return attribute(*args, **kwargs)

        return call


def _engine_on_a_store_that_may_stop(smollm2_llm, store, prompt, config, request_id):
    """An engine reading `store` through `_StopsAnswering`, with `request_id` prefilled and added."""
    client = connect(store)
    frozen = _StopsAnswering(client)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, frozen, config)
    result = Prefiller(smollm2_llm.model, client).prefill(
        request_id, prompt, GREEDY, budget_blocks=config.budget_blocks, excluded_head_blocks=config.sink_blocks,
        excluded_tail_blocks=config.window_blocks)
    engine.add(result, GREEDY)
    return engine, frozen


def _everything_comes_back(engine, store):
    assert engine.settle(30)
    assert engine.pool.allocator.num_free == engine.pool.num_rows
    assert store.stats().num_requests == 0
    engine.close()


def test_an_abort_does_not_wait_for_a_store_that_stops_answering(smollm2_llm, store, prompts):
    """A caller gives up on a decoding request whose store stopped answering: the abort returns
    at once (the rows wait in quarantine, the free is queued on the store's I/O thread), and both
    come back once the store answers. Before, the decode loop waited out the fetch timeout for
    the request's transfers and then again for its free."""
    import threading

    config = DecodeConfig(budget_tokens=256, fetch_timeout_s=60)
    engine, frozen = _engine_on_a_store_that_may_stop(smollm2_llm, store, prompts[0], config, "aborted")
    while engine.counters.steps < 2:
        engine.step()
    frozen.stop()
    aborted = threading.Thread(target=engine.abort, args=("aborted",))
    aborted.start()
    aborted.join(20)
    try:
        assert not aborted.is_alive(), "the abort waited for the store"
        assert not engine.has_unfinished and engine.counters.store_free_failures == 0
        assert store.stats().num_requests == 1  # its free waits for the store
    finally:
        frozen.answer()
    _everything_comes_back(engine, store)


def test_a_request_that_ends_does_not_wait_for_a_store_that_stops_answering(smollm2_llm, store, prompts):
    """A dense request decodes on without its store once admitted, and ends while the store is
    frozen: the step that ends it returns (its free is queued, waited for a moment only), and
    the memory comes back once the store answers. Before, the decode loop waited out the fetch
    timeout for the free, holding up every request of the worker, on healthy stores too."""
    import threading

    config = DecodeConfig(mode="dense", fetch_timeout_s=60)
    engine, frozen = _engine_on_a_store_that_may_stop(smollm2_llm, store, prompts[0], config, "ends")
    while not engine.running:
        engine.step()
    frozen.stop()
    finished = []

    def decode_to_the_end():
        while engine.has_unfinished:
            finished.extend(out for out in engine.step() if out.finished)

    decoding = threading.Thread(target=decode_to_the_end)
    decoding.start()
    decoding.join(20)
    try:
        assert not decoding.is_alive(), "the end of the request waited for the store"
        assert [out.finish_reason for out in finished] == ["length"]
        assert store.stats().num_requests == 1  # its free waits for the store
    finally:
        frozen.answer()
    _everything_comes_back(engine, store)
    assert engine.counters.store_free_failures == 0
