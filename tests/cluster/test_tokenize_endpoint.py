"""vLLM's /tokenize and /detokenize on the API, with SmolLM2's real tokenizer and a service whose
workers are stand-ins (nothing here generates). Oracles: the tokenizer's own encoding and chat
template, its vocabulary's entries, and the decoded text against the text sent. The counts equal
what the real server bills for a completion: tests/cluster/test_api.py."""

from __future__ import annotations

import copy
import json

import pytest
from fastapi.testclient import TestClient

from oasiskv.cluster.api import create_app
from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.launcher import ClusterHandles
from oasiskv.cluster.router import WorkerSlot
from oasiskv.cluster.service import ClusterService
from oasiskv.models.pull import resolve_model
from oasiskv.models.tokenizer import ChatTokenizer, load_tokenizer

from ..conftest import DEFAULT_MODEL
from .test_health_poll import StandInActor

MAX_MODEL_LEN = 2048
CHAT = [{"role": "user", "content": "Write a haiku about a cache."}]


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return load_tokenizer(resolve_model(DEFAULT_MODEL, progress=False))


def _client(tokenizer, api_key: str | None = None) -> TestClient:
    slots = [WorkerSlot(name, StandInActor({"healthy": True})) for name in ("prefill-0", "decode-0", "store-0")]
    service = ClusterService(ServeConfig(api_key=api_key), ClusterHandles([slots[0]], [slots[1]], [slots[2]]),
                             tokenizer=tokenizer, kv_bytes_per_token=1, max_model_len=MAX_MODEL_LEN)
    return TestClient(create_app(service))


def test_a_prompt_round_trips_through_tokenize_and_detokenize(tokenizer):
    client = _client(tokenizer)
    text = 'def hello():\n    return "wörld, 世界 🎉"'
    reply = client.post("/tokenize", json={"model": DEFAULT_MODEL, "prompt": text})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"]) > 5
    assert body["max_model_len"] == MAX_MODEL_LEN and body["token_strs"] is None
    back = client.post("/detokenize", json={"model": DEFAULT_MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_token_strs_are_the_vocabularys_entries(tokenizer):
    body = _client(tokenizer).post("/tokenize", json={"prompt": "def hello(): return", "return_token_strs": True}).json()
    assert body["token_strs"] == ["def", "Ġhello", "():", "Ġreturn"]  # byte-level BPE: Ġ is the space


def test_messages_are_counted_as_the_chat_template_renders_them(tokenizer):
    client = _client(tokenizer)
    asked = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert asked == tokenizer.apply_chat_template(CHAT)
    # Without the assistant's header, the same tokens less the header's.
    bare = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert asked == bare + header


def test_continue_final_message_leaves_the_final_turn_open(tokenizer):
    chat = CHAT + [{"role": "assistant", "content": "Keys"}]
    body = {"messages": chat, "add_generation_prompt": False, "continue_final_message": True}
    asked = _client(tokenizer).post("/tokenize", json=body).json()["tokens"]
    closed = tokenizer.apply_chat_template(chat, add_generation_prompt=False)
    assert tokenizer.decode(asked).endswith("<|im_start|>assistant\nKeys") and closed[: len(asked)] == asked
    # An empty final message opens the turn: the prompt the generation prompt would have given.
    body["messages"] = CHAT + [{"role": "assistant", "content": ""}]
    assert _client(tokenizer).post("/tokenize", json=body).json()["tokens"] == tokenizer.apply_chat_template(CHAT)
    # Chat fields in a prompt's request have no template to go to: not refused.
    assert _client(tokenizer).post("/tokenize", json={"prompt": "a", "continue_final_message": True}).status_code == 200


def test_special_tokens_are_added_as_vllms_defaults_say(tokenizer):
    """A prompt gets the tokenizer's BOS unless add_special_tokens is false; messages get none
    unless it is true, since a template writes its own. A copy of SmolLM2's tokenizer that adds a
    BOS (as Gemma's does) shows both."""
    from tokenizers.processors import TemplateProcessing

    with_bos = copy.deepcopy(tokenizer.tokenizer)
    with_bos.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    client = _client(ChatTokenizer(with_bos, tokenizer.config))
    plain = tokenizer.encode("hello there")

    def tokens(body: dict) -> list[int]:
        reply = client.post("/tokenize", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["tokens"]

    assert tokens({"prompt": "hello there"}) == [1] + plain
    assert tokens({"prompt": "hello there", "add_special_tokens": False}) == plain
    rendered = tokenizer.apply_chat_template(CHAT)
    assert tokens({"messages": CHAT}) == rendered
    assert tokens({"messages": CHAT, "add_special_tokens": True}) == [1] + rendered


def test_a_prompt_over_max_model_len_is_counted_not_refused(tokenizer):
    text = "word " * 3000
    body = _client(tokenizer).post("/tokenize", json={"prompt": text}).json()
    assert body["count"] == len(tokenizer.encode(text)) > body["max_model_len"]


@pytest.mark.parametrize("path, body, status, message", [
    ("/tokenize", {}, 400, "invalid request: give either prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "give either prompt or messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "not valid Unicode"),
    ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model 'gpt-4' does not exist"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
     "continue_final_message needs add_generation_prompt: false"),
    ("/tokenize", {"messages": CHAT + [{"role": "developer", "content": "Be brief."}], "continue_final_message": True,
                   "add_generation_prompt": False}, 400, "continue_final_message cannot continue a developer message"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template is not supported"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"self": 1}}, 400, "may not set ['self']"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400, "may not set ['messages']"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens must be in [0, 49152)"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens must be in [0, 49152)"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens must be JSON integers, got True"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens must be JSON integers, got 1.5"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model 'gpt-4' does not exist"),
])
def test_bad_requests_are_refused_with_the_reason(tokenizer, path, body, status, message):
    # json.dumps escapes a lone surrogate as JSON may carry it; the client's own encoder refuses it.
    reply = _client(tokenizer).post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    assert "Value error" not in error["message"] and "(None)" not in error["message"]


def test_the_api_key_guards_both(tokenizer):
    client = _client(tokenizer, api_key="k")
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        assert client.post(path, json=body).status_code == 401
        assert client.post(path, json=body, headers={"authorization": "Bearer k"}).status_code == 200
    assert client.get("/health").status_code == 200  # probes stay open
