"""Two prefill workers, each with its own prefix cache, on the real cluster: a chat's next turn
and the other choices of an n > 1 request go to the worker that prefilled their beginning, and
find it there (counted by the API's prefix-cache metrics); the text is still the engine's."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.server import BackgroundServer
from oasiskv.decode_node.config import DecodeConfig
from oasiskv.models.sampling import SamplingParams

from ..conftest import DEFAULT_MODEL, stdlib_source

# A second cluster (two prefill workers load the model): about a minute, run by .ci/run's slow step.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    config = ServeConfig(model=DEFAULT_MODEL, port=0, prefill_workers=2, store_capacity_gb=0.25, threads_per_worker=1,
                         decode=DecodeConfig(kv_pool_gb=0.25, budget_tokens=1024))
    with BackgroundServer(config) as running:
        yield running


def test_turns_and_choices_go_where_their_beginning_was_prefilled(server, smollm2_llm):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    registry = server.service.metrics.registry
    first_worker, second_worker = server.service.router.prefill

    def hits() -> float:
        return registry.get_sample_value("oasiskv_prefix_cache_hits_total") or 0.0

    def expected(prompt, tokens=6):
        return smollm2_llm.generate([prompt], SamplingParams(max_tokens=tokens))[0].text

    def complete(prompt, n=1):
        out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=6, temperature=0, n=n)
        assert [c.text for c in out.choices] == [expected(prompt)] * n
        return out

    # A long prompt keeps the first worker busy while a chat's first turn arrives: that turn goes
    # to the second worker. Once both are idle again, the least loaded is the first, where the
    # next turn would find nothing; the affinity sends it to the second.
    source = smollm2_llm.encode(stdlib_source("heapq.py"))
    long_prompt = smollm2_llm.encode(stdlib_source("argparse.py"))[:3000]
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(complete, long_prompt)
        deadline = time.monotonic() + 60
        while first_worker.load == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first_worker.load > 0 and not busy.done()
        first_turn = source[:300]
        complete(first_turn)
        busy.result(timeout=120)
    assert first_worker.load == second_worker.load == 0
    before = hits()
    complete(source[:520])
    assert hits() - before == 288  # the first turn's 18 whole blocks

    # Four choices of a new prompt at once: one is prefilled whole, others where load allows.
    prompt = source[1000:1500]
    before = hits()
    complete(prompt, n=4)
    found = (hits() - before) / 496
    assert found >= 2, f"only {found:g} of 4 choices found the prompt in a prefix cache"
