"""The API's compile check of a structured output's spec, with the default model's tokenizer: a
spec that compiles slower than the limit is a 400 before any worker spends the time on it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest

from oasiskv.cluster import api
from oasiskv.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def service(smollm2_dir):
    return SimpleNamespace(tokenizer=load_tokenizer(smollm2_dir))  # all the check reads of the service


def test_a_spec_that_compiles_too_slowly_is_refused_in_time(service, monkeypatch):
    monkeypatch.setattr(api, "COMPILE_LIMIT_S", 0.3)
    slow = {"json": {"type": "string", "maxLength": 200_000}}  # seconds to compile on this machine

    async def refusal():
        began = time.monotonic()
        with pytest.raises(api.ApiError) as refused:
            await api._require_compilable(service, slow, "response_format")
        return time.monotonic() - began, refused.value

    waited, error = asyncio.run(refusal())  # which then waits for the compile's thread to end
    assert waited < 2.0
    assert error.status == 400 and error.param == "response_format"
    assert "response_format takes over 0.3 s to compile" in error.message
    # Sent again (the compile goes on in its thread, and then caches its grammar), it is refused at once.
    waited, error = asyncio.run(refusal())
    assert waited < 0.1 and "takes over 0.3 s" in error.message

def test_a_spec_within_the_limit_passes_and_one_that_allows_nothing_is_named(service):
    asyncio.run(api._require_compilable(service, {"json": {"type": "object"}}, "structured_outputs"))
    with pytest.raises(api.ApiError, match="guided_regex regex allows no output at all"):
        asyncio.run(api._require_compilable(service, {"regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex"))
    with pytest.raises(api.ApiError, match="guided_regex regex is not valid"):
        asyncio.run(api._require_compilable(service, {"regex": "(ab"}, "guided_regex"))


def test_a_check_queued_too_long_behind_others_is_a_503(service, monkeypatch):
    """Compiles that ran over go on in their threads; a spec queued behind them past the limit is
    told to retry (503), not refused for good."""
    busy = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()
    busy.submit(release.wait, 30)
    monkeypatch.setattr(api, "_GRAMMAR_CHECKS", busy)
    monkeypatch.setattr(api, "COMPILE_LIMIT_S", 0.3)
    try:
        with pytest.raises(api.ApiError) as refused:
            asyncio.run(api._require_compilable(service, {"regex": "[a-z]{1,9}"}, "structured_outputs"))
        assert refused.value.status == 503 and "busy" in refused.value.message
    finally:
        release.set()
        busy.shutdown()
    monkeypatch.setattr(api, "_GRAMMAR_CHECKS", concurrent.futures.ThreadPoolExecutor(1))
    asyncio.run(api._require_compilable(service, {"regex": "[a-z]{1,9}"}, "structured_outputs"))  # not remembered
