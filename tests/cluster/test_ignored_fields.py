"""Request fields this server does not know are served around, as OpenAI clients send fields of
newer API versions, but logged by name: a misspelt `max_token` used to vanish without a trace."""

from __future__ import annotations

import logging

from oasiskv.cluster.api import _check
from oasiskv.cluster.protocol import ChatCompletionRequest, CompletionRequest


def test_unknown_fields_are_named_and_logged(caplog):
    body = CompletionRequest.model_validate({"prompt": "x", "max_token": 3, "oasiskv_budget": 512, "max_tokens": 2})
    assert body.ignored_fields == ["max_token", "oasiskv_budget"] and body.max_tokens == 2
    with caplog.at_level(logging.WARNING, logger="oasiskv.api"):
        _check(body, "m")
    assert "request fields ignored (unknown to this server): max_token, oasiskv_budget" in caplog.text
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "temprature": 0})
    assert chat.ignored_fields == ["temprature"] and chat.temperature == 1.0


def test_known_fields_log_nothing(caplog):
    body = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 2, "user": "u", "seed": 1})
    with caplog.at_level(logging.WARNING, logger="oasiskv.api"):
        _check(body, "m")
    assert body.ignored_fields == [] and caplog.text == ""
