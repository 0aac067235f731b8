"""A store that fails one request (its write-back does not land, say) ends that request alone:
it keeps what it emitted, its caller gets the error, its pool rows go back, and the requests
beside it in the batch decode on. Before, the failure raised out of the step and the worker
ended every request in it."""

from __future__ import annotations

from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.kvstore import connect
from oasiskv.kvstore.errors import TransferError
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


def test_a_failed_write_back_ends_its_request_alone(smollm2_llm, store, prompts):
    config = DecodeConfig(budget_tokens=256)
    _, (expected_dense,) = run_engine(smollm2_llm, store, prompts[1:], config.model_copy(update={"mode": "dense"}),
                                      tag="-alone")
    client = connect(store)
    failing = _WriteBacksFail(client)
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
    assert failed.error is not None and "TransferError" in failed.error and failed.finish_reason is None
    assert 1 <= len(failed.token_ids) < GREEDY.max_tokens
    assert beside.error is None and beside.finish_reason == "length"
    assert beside.token_ids == expected_dense
    assert engine.pool.allocator.num_free == engine.pool.num_rows
    assert not engine.has_unfinished and store.stats().num_requests == 0
    engine.close()
