"""The real server end to end: uvicorn + Ray + a NIXL store actor + prefill and decode actors,
driven with the official `openai` client. Greedy outputs must equal the single-process engine's."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest
import torch

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.protocol import ChatCompletionRequest, CompletionRequest
from oasiskv.cluster.server import BackgroundServer
from oasiskv.decode_node.config import DecodeConfig
from oasiskv.models.sampling import SamplingParams

from ..conftest import DEFAULT_MODEL, stdlib_source

API_KEY = "test-key"


@pytest.fixture(scope="module")
def server():
    config = ServeConfig(
        model=DEFAULT_MODEL, port=0, api_key=API_KEY, store_capacity_gb=0.25, threads_per_worker=1,
        decode=DecodeConfig(kv_pool_gb=0.25, budget_tokens=1024),
    )
    with BackgroundServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _expected(smollm2_llm, prompt_ids: list[int], max_tokens: int) -> str:
    return smollm2_llm.generate([prompt_ids], SamplingParams(max_tokens=max_tokens))[0].text


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_matches_the_engine(client, smollm2_llm):
    prompt = "def fibonacci(n):"
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == _expected(smollm2_llm, smollm2_llm.encode(prompt), 24)
    assert out.usage.prompt_tokens == len(smollm2_llm.encode(prompt))
    assert out.usage.completion_tokens == 24 and out.choices[0].finish_reason == "length"


def test_tokenize_counts_what_a_completion_or_chat_is_billed(server, client):
    """vLLM's /tokenize and /detokenize (the openai client has neither), behind the API key: the
    count is the prompt_tokens of a completion of the same prompt, or of a chat of the same
    messages, and detokenize gives the prompt back. The rest: test_tokenize_endpoint.py."""
    def post(path: str, body: dict) -> dict:
        reply = httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()

    prompt = "def fibonacci(n):\n    # 世界 🎉"
    counted = post("/tokenize", {"model": DEFAULT_MODEL, "prompt": prompt})
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert counted["count"] == out.usage.prompt_tokens
    assert counted["max_model_len"] == httpx.get(f"{server.url}/v1/models", headers={
        "Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["max_model_len"]
    assert post("/detokenize", {"tokens": counted["tokens"]}) == {"prompt": prompt}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=1, temperature=0)
    assert post("/tokenize", {"messages": messages})["count"] == chat.usage.prompt_tokens
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).status_code == 401


def test_allowed_token_ids_restrict_the_output_greedy_or_sampled(client, smollm2_llm):
    """vLLM's allowed_token_ids (refused before): greedy output is the engine's under the same
    restriction, and sampled choices too are made of the allowed tokens alone."""
    prompt = "Is the sky blue? Answer yes or no:"
    words = (" yes", " no", " maybe", ".")
    allowed = sorted({smollm2_llm.encode(word)[0] for word in words})
    assert [smollm2_llm.tokenizer.decode([t]) for t in allowed] == sorted(words, key=lambda w: smollm2_llm.encode(w)[0])
    greedy = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"allowed_token_ids": allowed})
    expected = smollm2_llm.generate([smollm2_llm.encode(prompt)], SamplingParams(max_tokens=8, allowed_token_ids=allowed))
    assert greedy.choices[0].text == expected[0].text
    sampled = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=1.5, seed=3,
                                        n=3, extra_body={"allowed_token_ids": allowed})
    pattern = "(?:" + "|".join(re.escape(w) for w in words) + ")*"
    assert all(re.fullmatch(pattern, choice.text) for choice in sampled.choices), [c.text for c in sampled.choices]
    assert len({choice.text for choice in sampled.choices}) > 1


def test_bad_words_keep_words_out_of_the_output_greedy_or_sampled(client, smollm2_llm):
    """vLLM's bad_words (refused before): greedy output is the engine's under the same words, and
    sampled choices of a passage the model repeats leave out their tokens too (a ban on tokens, as
    vLLM's: " foxes" would be another token)."""
    passage = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    prompt, words = passage * 3 + "The quick", ["fox", "lazy dog"]
    plain = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert "fox" in plain.choices[0].text and "lazy dog" in plain.choices[0].text
    greedy = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                       extra_body={"bad_words": words})
    (expected,) = smollm2_llm.generate([smollm2_llm.encode(prompt)], SamplingParams(max_tokens=40, bad_words=words))
    assert greedy.choices[0].text == expected.text
    sampled = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=40, temperature=0.7, seed=5,
                                        n=3, logprobs=0, extra_body={"bad_words": words})
    assert len({choice.text for choice in sampled.choices}) > 1
    for choice in sampled.choices:
        tokens = choice.logprobs.tokens
        assert not {"fox", " fox"} & set(tokens), tokens
        assert all(tokens[i - 1 : i + 1] not in (["lazy", " dog"], [" lazy", " dog"]) for i in range(1, len(tokens)))
    assert "fox" not in greedy.choices[0].text, greedy.choices[0].text


@pytest.fixture(scope="module")
def reference_logprobs(smollm2_dir):
    """transformers' log-softmax at each position of a token list, on the server's weights."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def test_prompt_logprobs_are_the_models_and_skip_the_prefix_cache(server, client, smollm2_llm, reference_logprobs):
    """vLLM's prompt_logprobs (refused before): for each prompt token after the first, its logprob,
    rank and the best alternatives, as transformers scores them; the prompt is computed whole even
    when a prefix cache holds it."""
    prompt = stdlib_source("fractions.py")[:1200]  # no other test here sends it: their prefix caches stay as they expect
    ids = smollm2_llm.encode(prompt)
    client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1)
    cached = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1)
    assert cached.usage.prompt_tokens_details.cached_tokens > 0
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    positions = out.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    reference = reference_logprobs(ids)
    for at, position in enumerate(positions[1:], 1):
        token = position[str(ids[at])]
        assert abs(token["logprob"] - reference[at - 1, ids[at]].item()) < 1e-3
        assert token["decoded_token"] == smollm2_llm.tokenizer.decode([ids[at]])
        best = sorted(position.values(), key=lambda item: item["rank"])
        assert [item["rank"] for item in best][:2] == [1, 2] and len(position) in (2, 3)
    ranks = [position[str(ids[at])]["rank"] for at, position in enumerate(positions[1:], 1)]
    assert min(ranks) == 1 and max(ranks) > 2
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=2, n=2, extra_body={"prompt_logprobs": 0})
    chat_positions = chat.model_extra["prompt_logprobs"]
    assert len(chat_positions) == chat.usage.prompt_tokens and chat_positions[0] is None
    assert all(len(position) == 1 for position in chat_positions[1:])
    refused = _post(server, "completions", {"model": DEFAULT_MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    # As vLLM: 0 asks a stream for nothing, and is taken; a response without them says null.
    streamed = client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=2, stream=True,
                                         extra_body={"prompt_logprobs": 0})
    shown = [c.model_extra.get("prompt_logprobs") for chunk in streamed for c in chunk.choices]
    assert shown and all(value is None for value in shown)
    plain = client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=1)
    assert "prompt_logprobs" in plain.choices[0].model_extra and plain.choices[0].model_extra["prompt_logprobs"] is None
    plain_chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=1)
    assert "prompt_logprobs" in plain_chat.model_extra and plain_chat.model_extra["prompt_logprobs"] is None


def test_echo_puts_the_prompt_and_its_logprobs_before_the_output(server, client, smollm2_llm, reference_logprobs):
    """Completions' echo (refused before), as vLLM gives it: the prompt's text, then the output;
    with logprobs, the prompt's tokens first, the first with none. Streamed, the prompt comes
    first."""
    prompt = "def fibonacci(n):\n    # 世界"
    ids = smollm2_llm.encode(prompt)
    expected = _expected(smollm2_llm, ids, 6)
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                    logprobs=1, n=2)
    choice = out.choices[0]
    assert [c.text for c in out.choices] == [prompt + expected] * 2
    # The prompt's, computed once: the same for both (their outputs' may differ in the last bits).
    assert out.choices[1].logprobs.token_logprobs[: len(ids)] == choice.logprobs.token_logprobs[: len(ids)]
    assert out.choices[1].model_extra["prompt_logprobs"] == choice.model_extra["prompt_logprobs"]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == len(ids) + out.usage.completion_tokens // 2
    assert all(choice.text[at:].startswith(token) for at, token in zip(lp.text_offset, lp.tokens))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = reference_logprobs(ids)
    for at in range(1, len(ids)):
        assert abs(lp.token_logprobs[at] - reference[at - 1, ids[at]].item()) < 1e-3
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    plain = client.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert plain.choices[0].text == smollm2_llm.tokenizer.decode(ids) + expected and plain.choices[0].logprobs is None
    # max_tokens 0: the prompt alone and its logprobs, as a client that scores texts asks (vLLM's).
    scored = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    streamed = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=0, echo=True, stream=True)
    chunks = [c for chunk in streamed for c in chunk.choices]
    assert "".join(c.text for c in chunks) == prompt and chunks[-1].finish_reason == "length"
    refused = _post(server, "completions", {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and "max_tokens must be at least 1" in refused.json()["error"]["message"]
    stream = client.completions.create(model=DEFAULT_MODEL, prompt=[prompt, "x = "], max_tokens=6, temperature=0,
                                       echo=True, n=2, stream=True, logprobs=0)
    texts, tokens, offsets, firsts = ["", "", "", ""], [[], [], [], []], [[], [], [], []], {}
    for chunk in stream:
        for c in chunk.choices:
            firsts.setdefault(c.index, (c.text, c.logprobs.token_logprobs[0]))
            texts[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens
            offsets[c.index] += c.logprobs.text_offset
    # Each choice's prompt first, in a chunk of its own, its first token with no logprob.
    assert firsts == {0: (prompt, None), 1: (prompt, None), 2: ("x = ", None), 3: ("x = ", None)}
    assert texts[:2] == [prompt + expected] * 2
    assert texts[2] == texts[3] == "x = " + _expected(smollm2_llm, smollm2_llm.encode("x = "), 6)
    for text, its_tokens, its_offsets in zip(texts, tokens, offsets):
        assert "".join(its_tokens) == text
        assert all(text[at:].startswith(token) for at, token in zip(its_offsets, its_tokens))


def test_truncate_prompt_tokens_serves_the_prompts_end(client, smollm2_llm):
    """vLLM's truncate_prompt_tokens (refused before): a prompt over the context is served from
    its last k tokens as that end alone is, and billed for k; a chat's rendered template is cut
    the same way."""
    ids = smollm2_llm.encode(stdlib_source("argparse.py"))[:9000]  # over SmolLM2's 8,192
    out = client.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=12, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 300})
    assert out.usage.prompt_tokens == 300 and out.choices[0].text == _expected(smollm2_llm, ids[-300:], 12)
    # What is cut off is not served, so not checked (as in vLLM): an id past the vocabulary there.
    cut = client.completions.create(model=DEFAULT_MODEL, prompt=[10**6, *ids[:50]], max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 50})
    assert cut.usage.prompt_tokens == 50 and cut.choices[0].text == _expected(smollm2_llm, ids[:50], 4)
    messages = [{"role": "user", "content": stdlib_source("argparse.py")[:4000]}]
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 200})
    rendered = smollm2_llm.tokenizer.apply_chat_template(messages)
    assert len(rendered) > 200 and chat.usage.prompt_tokens == 200
    assert chat.choices[0].message.content == _expected(smollm2_llm, rendered[-200:], 4)


def test_a_temperature_or_top_p_near_zero_is_served_greedily_beside_other_requests(client, smollm2_llm):
    """temperature 1e-40 (or top_p 1e-320) made the sampler divide into inf and sample from NaN:
    503 'retry it', and a request decoding in the same step failed with it."""
    prompt = "def fibonacci(n):"
    expected = _expected(smollm2_llm, smollm2_llm.encode(prompt), 16)
    for extra in ({"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-320}):
        out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=16, **extra)
        assert out.choices[0].text == expected and out.usage.completion_tokens == 16


def test_the_model_may_be_left_out_as_in_vllm(server, smollm2_llm):
    response = _post(server, "completions", {"prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200 and response.json()["model"] == DEFAULT_MODEL
    assert response.json()["choices"][0]["text"] == _expected(smollm2_llm, smollm2_llm.encode("def fibonacci(n):"), 8)


def test_include_stop_str_in_output_keeps_the_stop_string(client, smollm2_llm):
    """vLLM's option was accepted and ignored: the stop string was cut all the same."""
    prompt = "1, 2, 3, 4,"
    whole = _expected(smollm2_llm, smollm2_llm.encode(prompt), 10)
    assert "7" in whole  # the model counts on
    for include in (False, True):
        out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=10, temperature=0, stop="7",
                                         extra_body={"include_stop_str_in_output": include})
        cut = whole.index("7") + (1 if include else 0)
        assert out.choices[0].text == whole[:cut] and out.choices[0].finish_reason == "stop"


def test_text_in_several_byte_tokens_arrives_whole_streamed_or_not(client, smollm2_llm):
    """A character whose bytes a step left half-decoded (U+FFFD) once stopped every later piece of
    text: 40 tokens came back as one character, streamed or not."""
    prompt = "中文：你好，世界！今天天气很好，我们去"
    expected = _expected(smollm2_llm, smollm2_llm.encode(prompt), 40)
    assert len(expected) > 10  # the model writes on in Chinese
    whole = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=40, temperature=0)
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model=DEFAULT_MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True)]
    assert whole.choices[0].text == "".join(pieces) == expected
    assert all("\ufffd" not in piece for piece in pieces[:-1])


def test_completion_logprobs_match_the_engine_streamed_or_not(client, smollm2_llm):
    prompt = "def fibonacci(n):"
    expected = smollm2_llm.generate([smollm2_llm.encode(prompt)], SamplingParams(max_tokens=12, logprobs=2))[0]
    texts = [smollm2_llm.tokenizer.decode([t]) for t in expected.token_ids]
    whole = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs]
    for logprobs in (whole.choices[0].logprobs, _joined(chunks)):
        assert logprobs.tokens == texts and "".join(texts) == whole.choices[0].text
        assert max(abs(a - e.logprob) for a, e in zip(logprobs.token_logprobs, expected.logprobs, strict=True)) < 1e-3
        assert logprobs.text_offset == [sum(map(len, texts[:i])) for i in range(len(texts))]
        # The two best and the token itself, which greedy decoding makes the best.
        assert [sorted(d) for d in logprobs.top_logprobs] == [
            sorted({smollm2_llm.tokenizer.decode([t]) for t, _ in e.top}) for e in expected.logprobs]
    assert len(chunks) > 1  # streamed a piece at a time
    plain = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def _joined(chunks):
    first = chunks[0]
    for chunk in chunks[1:]:
        first.tokens += chunk.tokens
        first.token_logprobs += chunk.token_logprobs
        first.top_logprobs += chunk.top_logprobs
        first.text_offset += chunk.text_offset
    return first


def test_chat_logprobs_match_the_engine_streamed_or_not(client, smollm2_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smollm2_llm.tokenizer.apply_chat_template(messages)
    expected = smollm2_llm.generate([ids], SamplingParams(max_tokens=10, logprobs=3))[0]
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3)
    streamed = [item for c in client.chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    for content in (whole.choices[0].logprobs.content, streamed):
        assert len(content) == whole.usage.completion_tokens == len(expected.token_ids)
        tok = smollm2_llm.tokenizer
        for k, (item, e) in enumerate(zip(content, expected.logprobs)):
            # Each token's text is what it adds to the output (the request skips special tokens).
            before = tok.decode(expected.token_ids[:k], skip_special_tokens=True)
            added = tok.decode(expected.token_ids[: k + 1], skip_special_tokens=True)[len(before):]
            assert item.token == added and item.bytes == list(item.token.encode())
            assert abs(item.logprob - e.logprob) < 1e-3
            assert [t.token for t in item.top_logprobs] == [
                tok.decode(expected.token_ids[:k] + [t], skip_special_tokens=True)[len(before):] for t, _ in e.top]
        assert "".join(item.token for item in content) == whole.choices[0].message.content
    only_token = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=3, temperature=0,
                                                logprobs=True)
    assert [len(i.top_logprobs) for i in only_token.choices[0].logprobs.content] == [0, 0, 0]


def test_chat_logprobs_must_be_a_boolean(server):
    """A count (completions' form) was taken as true and listed no alternatives; vLLM refuses it."""
    response = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 3})
    assert response.status_code == 400 and "logprobs" in response.text


@pytest.mark.parametrize("path, extra, fragment", [
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
    ("completions", {"logprobs": 21}, "logprobs must be in [0, 20]"),
    ("completions", {"logprobs": -1}, "logprobs must be in [0, 20]"),
])
def test_logprobs_out_of_range_are_400(server, path, extra, fragment):
    body = {"max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"})
    response = _post(server, path, body)
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]


def test_penalties_take_effect_as_in_the_engine_streamed_or_not(client, smollm2_llm):
    """presence_penalty, frequency_penalty (OpenAI's) and repetition_penalty (vLLM's) change
    greedy text exactly as the single-process engine applies them."""
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    ids = smollm2_llm.encode(prompt)
    plain = _expected(smollm2_llm, ids, 24)
    for penalties in ({"presence_penalty": 2.0, "frequency_penalty": 2.0}, {"frequency_penalty": 1.0},
                      {"repetition_penalty": 1.3}):
        expected = smollm2_llm.generate([ids], SamplingParams(max_tokens=24, **penalties))[0].text
        assert expected != plain  # the model repeats the pattern unless penalized
        kwargs = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
        extra = {k: v for k, v in penalties.items() if k == "repetition_penalty"}
        whole = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body=extra, **kwargs)
        pieces = [c.choices[0].text for c in client.completions.create(
            model=DEFAULT_MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True, extra_body=extra, **kwargs)]
        assert whole.choices[0].text == "".join(pieces) == expected
    # null is the default, as OpenAI documents and vLLM takes it (it was a 422)
    nulls = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      presence_penalty=None, frequency_penalty=None,
                                      extra_body={"repetition_penalty": None})
    assert nulls.choices[0].text == plain


def test_logit_bias_forces_a_token_in_completions_and_chat(client, smollm2_llm):
    """+100 on one token id makes greedy decoding output that token (the prefill's first token
    and every decode step's); an id the model does not have is a 400 that names it."""
    prompt = "def fibonacci(n):"
    forced = smollm2_llm.encode(" banana")[0]
    expected = smollm2_llm.generate([smollm2_llm.encode(prompt)], SamplingParams(max_tokens=6, logit_bias={forced: 100}))[0]
    assert expected.token_ids == [forced] * 6
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == expected.text == " banana" * 6
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=4, temperature=0,
                                          logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == " banana" * 4
    with pytest.raises(openai.BadRequestError, match="logit_bias token id 49152 is not in the model's vocabulary"):
        client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=4, logit_bias={"49152": 1})


def test_min_tokens_holds_off_eos_streamed_or_not(client, smollm2_llm):
    """The model answers "Yes." and ends; min_tokens keeps EOS out of the first tokens, as the
    single-process engine does. Without max_tokens, the default grows to min_tokens."""
    messages = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    ids = smollm2_llm.tokenizer.apply_chat_template(messages)
    plain = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=60, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 5
    expected = smollm2_llm.generate([ids], SamplingParams(max_tokens=60, min_tokens=12))[0]
    extra = {"min_tokens": 12}
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=60, temperature=0,
                                          extra_body=extra)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=60, temperature=0, stream=True, extra_body=extra)]
    assert chat.choices[0].message.content == "".join(pieces) == expected.text
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == len(expected.token_ids) > 12
    unbounded = client.completions.create(model=DEFAULT_MODEL, prompt=ids, temperature=0, extra_body={"min_tokens": 20})
    assert unbounded.usage.completion_tokens == 20 and unbounded.choices[0].finish_reason == "length"
    # EOS made the first choice: the prefill's token may not be it, the decode's next one is.
    eos = smollm2_llm.tokenizer.eos_token_id
    eager = client.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=8, temperature=0,
                                      logit_bias={str(eos): 100}, extra_body={"min_tokens": 1})
    assert eager.usage.completion_tokens == 2 and eager.choices[0].finish_reason == "stop" and eager.choices[0].text


def test_min_tokens_holds_off_a_stop_string(client, smollm2_llm):
    """The count reaches "7" at once; with min_tokens the first "7" is output and the one of "17"
    ends it."""
    prompt = "1, 2, 3, 4,"
    params = SamplingParams(max_tokens=60, stop=["7"], min_tokens=8)
    expected = smollm2_llm.generate([smollm2_llm.encode(prompt)], params)[0]
    assert expected.text == " 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 1"
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=60, temperature=0, stop="7",
                                    extra_body={"min_tokens": 8})
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "stop"


def test_min_p_is_applied(client, smollm2_llm):
    """min_p 1 keeps only the most likely token: sampled at temperature 1 the text is greedy's."""
    prompt = "Once upon a time"
    greedy = smollm2_llm.generate([smollm2_llm.encode(prompt)], SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    plain, kept = [client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=3,
                                             extra_body={"ignore_eos": True, **extra}).choices[0].text
                   for extra in ({}, {"min_p": 1.0})]
    assert kept == greedy and plain != greedy


def test_stop_token_ids_end_the_output_at_that_token(client, smollm2_llm):
    prompt = "def fibonacci(n):"
    ids = smollm2_llm.encode(prompt)
    full = smollm2_llm.generate([ids], SamplingParams(max_tokens=12))[0].token_ids
    stop_at = next(i for i, t in enumerate(full) if i >= 3 and t not in full[:i])  # a token's first appearance
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [full[stop_at]]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == stop_at + 1
    # As vLLM: the stop token's own text is left out, unless include_stop_str_in_output.
    assert out.choices[0].text == smollm2_llm.tokenizer.decode(full[:stop_at])
    kept = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [full[stop_at]], "include_stop_str_in_output": True})
    assert kept.choices[0].text == smollm2_llm.tokenizer.decode(full[: stop_at + 1])
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=4,
                                  extra_body={"stop_token_ids": [10**9]})


def test_streamed_chat_matches_the_engine(client, smollm2_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    pieces, reasons = [], []
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    ids = smollm2_llm.tokenizer.apply_chat_template(messages)
    assert "".join(pieces) == _expected(smollm2_llm, ids, 20)
    assert reasons[-1] in ("stop", "length")
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == "".join(pieces)


@pytest.mark.slow  # in CI's slow step: keeps the default suite under 25 minutes
def test_sixteen_concurrent_streams_of_different_lengths(server, smollm2_llm):
    source = smollm2_llm.encode(stdlib_source("typing.py"))
    prompts = [source[i * 97 : i * 97 + 30 + 17 * i] for i in range(16)]
    lengths = [8 + 3 * i for i in range(16)]
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(prompt, max_tokens):
        stream = await aclient.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    texts = asyncio.run(all_of_them())
    expected = smollm2_llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    assert texts == [e.text for e in expected]


def _post(server, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \\udXXX (valid JSON); httpx's own encoder would refuse it.
    return httpx.post(f"{server.url}/v1/{path}", content=json.dumps(body),
                      headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}, timeout=120)


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"model": "nope", "prompt": "hi"}, 404, "does not exist"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "n": 17}, 400, "n must be in [1, 16], got 17"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "n": 0}, 400, "n must be in [1, 16], got 0"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream: true"),
        ({"model": DEFAULT_MODEL, "prompt": "", "max_tokens": 4}, 400, "empty"),
        ({"model": DEFAULT_MODEL, "prompt": [1] * 9000, "max_tokens": 4}, 400, "context"),
        ({"model": DEFAULT_MODEL, "prompt": [True, 2], "max_tokens": 4}, 400,
         "prompt token ids must be JSON integers, got True"),
        ({"model": DEFAULT_MODEL, "prompt": [[5, 6], [7, 49152]], "max_tokens": 4}, 400,
         "prompt token ids must be in [0, 49152)"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "oasiskv_mode": "fast"}, 400, "oasiskv_mode"),
        ({"model": DEFAULT_MODEL}, 400, "prompt"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        # Each of these once reached a worker and came back as a 503 ("retry it") or a bare 500.
        ({"model": DEFAULT_MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "oasiskv_budget_tokens": 24}, 400, "multiple of the block size"),
        ({"model": DEFAULT_MODEL, "prompt": "hi \ud800", "max_tokens": 4}, 400, "lone surrogate"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "stop": ["\udc00"]}, 400, "lone surrogate"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "logit_bias": {"abc": 5}}, 400,
         "logit_bias keys must be integer token ids, got 'abc'"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "logit_bias": {"99999999": 5}}, 400,
         "logit_bias token id 99999999 is not in the model's vocabulary [0, 49152)"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "logit_bias": {"42": 101}}, 400,
         "logit_bias values must be numbers in [-100, 100], got 101 for token id 42"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, 400,
         "logit_bias may bias at most 300 tokens"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 8}, 400,
         "min_tokens (8) must be <= max_tokens (4)"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "min_tokens": -1}, 400, "min_tokens must be >= 0"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "min_tokens": 10**6}, 400,
         "min_tokens (1000000) exceeds the "),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "min_p": 1.5}, 400, "min_p must be in [0, 1], got 1.5"),
        # vLLM options not implemented here: refused, not ignored (the output would differ).
        ({"model": DEFAULT_MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty must be in [-2, 2]"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty must be in (0, 2]"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "guided_regex": "(a"}, 400, "guided_regex regex is not valid"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "structured_outputs": {"choice": ["a"], "regex": "a"}}, 400,
         "structured_outputs must name exactly one of json, json_object, regex, choice, grammar, got ['choice', 'regex']"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "structured_outputs": {"choice": ["a"], "structural_tag": "{}"}},
         400, "structured_outputs structural_tag is not supported"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "structured_outputs": {"json": {"type": "nonsense"}}}, 400,
         'structured_outputs json is not valid: Unsupported type "nonsense"'),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "truncate_prompt_tokens": True}, 400,
         "truncate_prompt_tokens must be an integer >= 1 or -1, got True"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "truncate_prompt_tokens": 0}, 400,
         "truncate_prompt_tokens must be an integer >= 1 or -1, got 0"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "truncate_prompt_tokens": 9000}, 400,
         "truncate_prompt_tokens (9000) is greater than max_model_len (8192)"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "allowed_token_ids": []}, 400,
         "allowed_token_ids must be a non-empty list of token ids"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "allowed_token_ids": [5, 99999999]}, 400,
         "allowed_token_ids must be in [0, 49152), got [99999999]"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "allowed_token_ids": [5, True]}, 400,
         "allowed_token_ids must be JSON integers, got True"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 2,
          "max_tokens": 4}, 400, "allowed_token_ids are all stop tokens"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "bad_words": ["fox", ""]}, 400,
         "bad_words entries must contain text other than spaces"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "bad_words": "fox"}, 400, "bad_words"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "bad_words": [f"word{i}" for i in range(65)]}, 400,
         "bad_words make more than the 128 token sequences allowed"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "bad_words": ["fox", "\ud800"]}, 400, "lone surrogate"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "bad_words": ["fox"], "allowed_token_ids": [29343, 16438]}, 400,
         "allowed_token_ids are all banned by bad_words"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs must be in [0, 20]"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "prompt_logprobs": True}, 400, "prompt_logprobs must be an integer"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400,
         "prompt_logprobs are not available with stream: true"),
        ({"model": DEFAULT_MODEL, "prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs must be in [0, 20]"),
        # -1 keeps max_model_len's worth: no room is left for the output.
        ({"model": DEFAULT_MODEL, "prompt": [1] * 9000, "truncate_prompt_tokens": -1}, 400, "context"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    response = _post(server, "completions", body)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["code"] == status


@pytest.mark.parametrize(
    "extra, status, fragment",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
         "response_format json_schema must be an object with the schema under 'schema'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, 400,
         "response_format json_schema needs a 'name'"),
        ({"response_format": {"type": "structural_tag"}}, 400, "response_format 'structural_tag' is not supported"),
        ({"tools": [{"type": "retrieval"}]}, 400, "tools[0] must be"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": {"name": "g"}}},
         400, "does not match any of the specified tools"),
        ({"tools": []}, 400, "tools must not be an empty array"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": {"name": "f"}},
          "structured_outputs": {"regex": "a+"}}, 400, "cannot both be given"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {}}]}]},
         400, "tool_calls[0] must be"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}, 400, "lone surrogate"),
        # Once a 400 that quoted the chat template's Jinja error.
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": None}]}, 400, "needs content"),
    ],
)
def test_chat_features_it_cannot_honour_are_refused(server, extra, status, fragment):
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = _post(server, "chat/completions", body)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["code"] == status


def test_the_json_free_text_format_and_declined_tools_are_served(client):
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0, response_format={"type": "text"},
                                           tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4


def test_malformed_json_is_400(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                          headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert response.status_code == 400
    assert "malformed JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_413_with_or_without_its_length(server, chunked):
    """A chunked body has no Content-Length: one of 9 MB was read and tokenized for 13 s."""
    from oasiskv.cluster.api import MAX_BODY_BYTES

    data = json.dumps({"model": DEFAULT_MODEL, "prompt": "x " * (MAX_BODY_BYTES // 2 + 10), "max_tokens": 1}).encode()
    content = (data[i : i + 65536] for i in range(0, len(data), 65536)) if chunked else data
    response = httpx.post(f"{server.url}/v1/completions", content=content, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert response.status_code == 413
    assert f"over {MAX_BODY_BYTES} bytes" in response.json()["error"]["message"]


def test_the_server_answers_while_it_tokenizes_a_long_prompt(server):
    """Tokenizing held the event loop (and the GIL): a 6 MB prompt kept /health waiting 8 s."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": DEFAULT_MODEL, "prompt": "hello world, this is a test. " * 280_000, "max_tokens": 1}
    with ThreadPoolExecutor(1) as pool:
        long_one = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=120,
                               headers={"Authorization": f"Bearer {API_KEY}"})
        # The server runs in this process: a tokenizer holding the GIL stops this thread too, so
        # what is timed is the gap between one answered probe and the next.
        answered = [time.monotonic()]
        while not long_one.done():
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            answered.append(time.monotonic())
            time.sleep(0.05)
        response = long_one.result()
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]
    gaps = [later - earlier for earlier, later in zip(answered, answered[1:])]
    assert len(gaps) >= 3 and max(gaps) < 1.0, gaps


def test_missing_or_wrong_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server.url}/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "hi"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_per_request_mode_extension(client, smollm2_llm):
    prompt = smollm2_llm.encode(stdlib_source("argparse.py"))[:300]
    dense = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"oasiskv_mode": "dense"})
    sparse = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"oasiskv_mode": "sparse-current", "oasiskv_budget_tokens": 512})
    assert dense.choices[0].text == sparse.choices[0].text == _expected(smollm2_llm, prompt, 12)


def _wait_until_freed(server, deadline_s: float = 30.0):
    """The decode worker's and the store's stats once neither holds a request nor pool rows (an
    aborted request's rows wait for its transfers to end), or at the deadline."""
    import ray

    decode = server.service.handles.decode[0].handle
    store = server.service.handles.stores[0].handle
    deadline = time.monotonic() + deadline_s
    while True:  # polled at least once, even with no time left
        stats, store_stats = ray.get(decode.stats.remote()), ray.get(store.stats.remote())
        freed = (stats["running"] == stats["waiting"] == stats["pool_rows_used"] == 0
                 and store_stats["num_requests"] == 0)
        if freed or time.monotonic() >= deadline:
            return stats, store_stats
        time.sleep(0.2)


def test_client_disconnect_frees_the_request_everywhere(server):
    """...and the tokens it was sent count as generated (only a success's counted, so a
    bytes-per-generated-token panel overstated when clients hung up)."""
    registry = server.service.metrics.registry
    generated_before = registry.get_sample_value("oasiskv_generation_tokens_total")
    body = {"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0}
    received = 0
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                received += 1
                if received == 3:
                    break  # hang up after the third chunk
    stats, store_stats = _wait_until_freed(server)
    assert stats["running"] == 0 and stats["pool_rows_used"] == 0
    assert store_stats["num_requests"] == 0
    deadline = time.monotonic() + 10  # counted when the service's side of the request ends
    while registry.get_sample_value("oasiskv_generation_tokens_total") == generated_before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert 3 <= registry.get_sample_value("oasiskv_generation_tokens_total") - generated_before < 400


@pytest.mark.parametrize("hang_up_after_s", [0.05, 1.5], ids=["during-prefill", "during-decode"])
def test_a_client_that_hangs_up_on_a_whole_response_aborts_it(server, smollm2_llm, hang_up_after_s):
    """A non-streamed request once decoded to its end after its client had gone (and counted as a
    success): behind the auth middleware, request.is_disconnected() never turned true."""
    registry = server.service.metrics.registry

    def count(status):
        return registry.get_sample_value("oasiskv_requests_total", {"status": status}) or 0.0

    before = count("success"), count("abort")
    prompt = smollm2_llm.encode(stdlib_source("argparse.py"))[:1500]
    body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=hang_up_after_s)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and count("abort") == before[1]:
        time.sleep(0.1)
    assert (count("success"), count("abort")) == (before[0], before[1] + 1)
    stats, store_stats = _wait_until_freed(server, deadline - time.monotonic())
    assert stats["running"] == 0 and stats["pool_rows_used"] == 0
    assert store_stats["num_requests"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_past_its_timeout_ends_and_is_freed_everywhere(server, client, monkeypatch, stream):
    """The timeout was bound to the task that first iterated the request; once a later task
    iterated it (a streamed response, a hang-up watcher) it never fired, and when it did fire
    after decoding had begun only the store was freed while the decode worker went on."""
    registry = server.service.metrics.registry
    errors_before = registry.get_sample_value("oasiskv_requests_total", {"status": "error"}) or 0.0
    monkeypatch.setattr(server.service.config, "request_timeout_s", 2.0)
    body = {"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    started = time.monotonic()
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60)
    if stream:
        assert response.status_code == 200
        *_, error, done = [line for line in response.text.splitlines() if line.startswith("data:")]
        assert "timed out" in json.loads(error.removeprefix("data:"))["error"]["message"]
        assert done == "data: [DONE]"  # as vLLM ends a stream after an error
    else:
        assert response.status_code == 504 and "timed out" in response.json()["error"]["message"]
    assert time.monotonic() - started < 20
    stats, store_stats = _wait_until_freed(server)
    assert stats["running"] == 0 and stats["pool_rows_used"] == 0
    assert store_stats["num_requests"] == 0
    assert registry.get_sample_value("oasiskv_requests_total", {"status": "error"}) == errors_before + 1
    monkeypatch.undo()
    assert client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3


def test_a_prompt_that_begins_as_an_earlier_one_is_prefilled_from_where_they_part(server, client, smollm2_llm):
    """A chat's next turn and the other choices of n > 1: the prefill worker takes the blocks the
    earlier prompt left in its prefix cache; the text is still the engine's."""
    registry = server.service.metrics.registry

    def counted() -> tuple[float, float]:
        return (registry.get_sample_value("oasiskv_prefix_cache_queries_total") or 0.0,
                registry.get_sample_value("oasiskv_prefix_cache_hits_total") or 0.0)

    source = smollm2_llm.encode(stdlib_source("heapq.py"))
    first, second = source[:400], source[:650]
    before = counted()
    out = client.completions.create(model=DEFAULT_MODEL, prompt=first, max_tokens=6, temperature=0)
    assert out.choices[0].text == _expected(smollm2_llm, first, 6)
    assert counted() == (before[0] + 400, before[1])  # nothing of it was seen before
    assert out.usage.prompt_tokens_details.cached_tokens == 0

    before = counted()
    out = client.completions.create(model=DEFAULT_MODEL, prompt=second, max_tokens=6, temperature=0, n=2)
    expected = _expected(smollm2_llm, second, 6)
    assert [choice.text for choice in out.choices] == [expected, expected]
    queries, hits = counted()
    assert queries == before[0] + 2 * 650
    # One choice finds the first prompt's 25 blocks, the other every block but the last.
    assert hits == before[1] + 400 + 640
    # The usage counts the prompt once, with what both choices found: the 400 cached before it.
    assert out.usage.prompt_tokens == 650 and out.usage.prompt_tokens_details.cached_tokens == 400
    # Streamed, the usage chunk says the same: the whole prompt but its last block is cached now.
    stream = client.completions.create(model=DEFAULT_MODEL, prompt=second, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    (usage,) = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage.prompt_tokens_details.cached_tokens == 640


def test_metrics_count_requests_and_tokens(server, client):
    client.completions.create(model=DEFAULT_MODEL, prompt="hello", max_tokens=4, temperature=0)
    asyncio.run(server.service.poll_once())
    text = httpx.get(f"{server.url}/metrics").text
    assert 'oasiskv_requests_total{status="success"}' in text
    assert "oasiskv_request_ttft_seconds_count" in text
    assert 'oasiskv_worker_healthy{role="decode",worker="decode-0"} 1.0' in text
    assert 'oasiskv_store_capacity_bytes{store="store-0"}' in text
    # The store's own series, which serve's stores (no metrics port of theirs) never showed: the
    # completion was allocated in the store.
    registry = server.service.metrics.registry
    assert registry.get_sample_value("oasiskv_kvstore_requests_events_total",
                                     {"store": "store-0", "event": "allocated"}) >= 1
    assert 'oasiskv_kvstore_capacity_bytes{store="store-0"}' in text
    assert "oasiskv_kvstore_requests_events_created" not in text


def test_a_refused_request_is_counted_as_rejected(server):
    """The OasisKVRequestsRejected alert and the outcome panels read status="rejected", which
    nothing counted: the alert could never fire."""
    registry = server.service.metrics.registry
    before = registry.get_sample_value("oasiskv_requests_total", {"status": "rejected"}) or 0.0
    decode = server.service.handles.decode
    for _ in range(5):  # the health poll (every 2 s) may mark the worker healthy again at once
        for slot in decode:
            slot.healthy = False
        try:
            response = _post(server, "completions", {"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2})
        finally:
            for slot in decode:
                slot.healthy = True
        if response.status_code == 503:
            break
    assert response.status_code == 503 and "no healthy worker" in response.json()["error"]["message"]
    assert response.headers["retry-after"]
    assert registry.get_sample_value("oasiskv_requests_total", {"status": "rejected"}) >= before + 1
    assert 'oasiskv_requests_total{status="rejected"}' in httpx.get(f"{server.url}/metrics").text


@pytest.mark.slow  # in CI's slow step: keeps the default suite well under 25 minutes
def test_requests_that_find_the_store_full_wait_for_room(server, client, smollm2_llm):
    """Three requests of which the store holds two at once, sent together: the third waits for one
    of the first two to end and is served, with the tokens it would have had alone. Before, it
    was refused (503 "every KV store is full") while the decode queue had room. Each reserves its
    share of the store by a large max_tokens behind a short prompt and ends early at a stop
    token, so the test costs three short prefills, not three of 4,000 tokens."""
    from concurrent.futures import ThreadPoolExecutor

    service = server.service
    store_tokens = service.router.stores[0].capacity // service.kv_bytes_per_token
    per_request = int(store_tokens / 2.5)  # tokens of KV each request reserves: two fit, three do not
    prompt_tokens, block = 256, service.config.decode.block_size
    max_tokens = per_request - prompt_tokens - block
    assert 2 * per_request < store_tokens < 3 * per_request
    assert prompt_tokens + max_tokens <= service.max_model_len
    source = smollm2_llm.encode(stdlib_source("argparse.py"))
    prompts = [source[i * 100 : i * 100 + prompt_tokens] for i in range(3)]
    # Each ends at its sixth greedy token (or at that token's first appearance).
    stops = [smollm2_llm.generate([p], SamplingParams(max_tokens=6))[0].token_ids[-1] for p in prompts]
    expected = [smollm2_llm.generate([p], SamplingParams(max_tokens=6, stop_token_ids=[t]))[0]
                for p, t in zip(prompts, stops)]
    waiting, done = [0], threading.Event()

    def watch():  # the store's queue, seen from the server's own process
        while not done.is_set():
            waiting[0] = max(waiting[0], len(service._store_waiters))
            time.sleep(0.001)

    def complete(prompt_and_stop):
        prompt, stop = prompt_and_stop
        # dense: the mode whose tokens equal the single-process engine's at any length
        return client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"oasiskv_mode": "dense", "stop_token_ids": [stop]})

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(complete, zip(prompts, stops)))
    finally:
        done.set()
        watcher.join()
    assert waiting[0] >= 1, "no request waited for room in the store"
    for out, engine in zip(outs, expected):
        assert out.usage.prompt_tokens == prompt_tokens and out.usage.completion_tokens == len(engine.token_ids)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (engine.text, "stop")
    # Three choices of one request take turns for room too: they waited for each other's first
    # token, so the third waited for room the first two held, and the request for its timeout.
    one = client.completions.create(model=DEFAULT_MODEL, prompt=prompts[0], max_tokens=max_tokens, temperature=0,
                                    n=3, timeout=60, extra_body={"oasiskv_mode": "dense", "stop_token_ids": [stops[0]]})
    assert [(c.text, c.finish_reason) for c in one.choices] == [(expected[0].text, "stop")] * 3
    # Streamed, the first byte comes while the third still waits for room: it came only once every
    # choice had its first token, so a choice waiting for a sibling's room held back the others.
    # They end at a token first generated 30 or more tokens in, so the first two are still
    # decoding when the first chunk is read.
    greedy = smollm2_llm.generate([prompts[0]], SamplingParams(max_tokens=64))[0].token_ids
    late_stop = next(t for i, t in enumerate(greedy) if i >= 30 and t not in greedy[:i])
    late = smollm2_llm.generate([prompts[0]], SamplingParams(max_tokens=64, stop_token_ids=[late_stop]))[0]
    waiting_at_first_chunk, texts = None, ["", "", ""]
    for chunk in client.completions.create(model=DEFAULT_MODEL, prompt=prompts[0], max_tokens=max_tokens,
                                           temperature=0, n=3, stream=True, timeout=60,
                                           extra_body={"oasiskv_mode": "dense", "stop_token_ids": [late_stop]}):
        if waiting_at_first_chunk is None:
            waiting_at_first_chunk = len(service._store_waiters)
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert waiting_at_first_chunk == 1 and texts == [late.text] * 3
    assert service.queued == 0 and service.router.stores[0].load == 0
    assert _store_requests(server) == 0


# Slow-marked for the default suite's time (50 s: every seat of the worker is taken); .ci/run runs it.
@pytest.mark.slow
def test_a_queued_request_counts_as_queued_only_until_it_decodes(server, client):
    """The decode worker's seats all taken, the next request waits in the decode queue; once its
    engine takes it in and it streams, the queue count (its limit, the gauge) no longer holds
    it. It stayed counted as queued until it ended, so a burst read as a queue long after."""
    from concurrent.futures import ThreadPoolExecutor

    service = server.service
    decode = service.router.decode[0]
    seats = decode.seats
    assert seats and service.queued == 0

    def hold_a_seat(i):
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": DEFAULT_MODEL, "prompt": f"Count to {i}:", "max_tokens": 48,
                                "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                pass

    with ThreadPoolExecutor(seats) as pool:
        holders = [pool.submit(hold_a_seat, i) for i in range(seats)]
        deadline = time.monotonic() + 60
        while decode.active < seats:
            assert time.monotonic() < deadline and not any(h.done() for h in holders)
            time.sleep(0.01)
        stream = client.completions.create(model=DEFAULT_MODEL, prompt="Once upon a time", max_tokens=120,
                                           stream=True, extra_body={"ignore_eos": True})
        assert service.queued == 1  # assigned while every seat was taken
        running = service.metrics.running
        assert running._value.get() == seats  # queued, not also running
        chunks = iter(stream)
        for _ in range(4):  # the prefill's token, then decode steps: its engine runs it
            next(chunks)
        assert service.queued == 0
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "oasiskv_queue_length 0.0" in metrics
        assert f"oasiskv_running_requests {running._value.get()}" in metrics and running._value.get() >= 1
        rest = list(chunks)
        assert rest and rest[-1].choices[0].finish_reason == "length"
        for holder in holders:
            holder.result()
    assert service.queued == 0 and decode.active == 0 and decode.load == 0
    assert service.metrics.running._value.get() == 0


def test_a_prefill_worker_busy_with_queued_prefills_still_answers_its_health_poll(server, smollm2_llm):
    """The health poll runs in its own concurrency group: behind eight prefill threads and a
    queue it used to time out, and the router refused every request (503) while the worker
    worked."""
    import ray

    slot = server.service.handles.prefill[0]
    store = server.service.handles.stores[0]
    prompt = smollm2_llm.encode(stdlib_source("argparse.py"))[:256]  # 10 of them fit the store at once
    ids = [f"busy-prefill-{i}" for i in range(10)]
    refs = [slot.handle.prefill.remote(rid, prompt, {"max_tokens": 4}, store.address, 64, 1, 4) for rid in ids]
    try:
        time.sleep(0.5)  # the prefills have taken every thread of the default group
        asyncio.run(server.service.poll_once())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        # Queued behind them in the default group, the poll could not have run before three
        # prefills (one at a time, each over a second on one thread) had finished.
        assert len(done) < 3, f"{len(done)} prefills finished before the poll answered"
        assert slot.healthy and slot.missed_polls == 0
    finally:
        ray.get(refs, timeout=300)
        ray.get([slot.handle.free.remote(rid, store.address) for rid in ids], timeout=60)
    assert _store_requests(server) == 0


def _store_requests(server) -> int:
    import ray

    return ray.get(server.service.handles.stores[0].handle.stats.remote())["num_requests"]


def _stream_killing(server, actor, n: int = 1) -> list[str]:
    """A long greedy stream's lines (of n choices), with `actor` killed (Ray restarts it) after the third."""
    import ray

    body = {"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 500, "stream": True,
            "ignore_eos": True, "temperature": 0, "n": n}
    lines = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as response:
        for line in response.iter_lines():
            lines.append(line)
            if len(lines) == 3:
                ray.kill(actor, no_restart=False)
    return lines


def _served_again(client, deadline_s: float):
    """A 4-token completion once the server serves again after a worker died; None at the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            return client.completions.create(model=DEFAULT_MODEL, prompt="hello", max_tokens=4, temperature=0)
        except (openai.APIStatusError, openai.APIConnectionError):
            time.sleep(1)
    return None


def test_a_developer_message_is_a_system_message_for_a_template_without_that_role(client):
    """OpenAI's newer clients send `developer` for `system`. SmolLM2's template has no such role:
    it wrote a `developer` turn and its own default system prompt besides (47 prompt tokens against
    vLLM's 25); vLLM renders it as the system message."""
    def ask(role):
        return client.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=8, temperature=0,
            messages=[{"role": role, "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}])

    developer, system = ask("developer"), ask("system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content


def test_tool_choice_without_tools_is_refused(server):
    body = {"max_tokens": 4, "tool_choice": "auto", "messages": [{"role": "user", "content": "hi"}]}
    response = _post(server, "chat/completions", body)
    assert response.status_code == 400 and "when using tool_choice, tools must be set" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "tool_choice"


_TOOLS = [{"type": "function", "function": {
              "name": "get_weather", "description": "The weather in a city now",
              "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                             "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}}}}},
          {"type": "function", "function": {"name": "get_time", "parameters": {
              "type": "object", "additionalProperties": False, "required": ["zone"],
              "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}]
_ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed_calls(client, **kwargs) -> tuple[str, dict[int, dict], list[str | None]]:
    """A streamed reply's content, its calls put together from their deltas by index (as the
    openai client's users do), and its finish reasons."""
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(model=DEFAULT_MODEL, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["name"] = call["name"] or delta.function.name
            call["arguments"] += delta.function.arguments or ""
        reasons.append(choice.finish_reason)
    return content, calls, reasons


def test_a_named_tool_choice_is_a_call_whose_arguments_follow_its_parameters(client):
    """As vLLM: the reply is limited to the function's parameters and given as its call (content
    empty, finish_reason "stop"); streamed, its arguments come as they are made."""
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=_ASKED, tools=_TOOLS, tool_choice=named,
                                           max_tokens=32, temperature=0)
    message, choice = reply.choices[0].message, reply.choices[0]
    assert message.content == "" and choice.finish_reason == "stop" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_time" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    content, calls, reasons = _streamed_calls(client, messages=_ASKED, tools=_TOOLS, tool_choice=named, max_tokens=32,
                                              temperature=0)
    assert content == "" and list(calls) == [0] and reasons[-1] == "stop"
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_time", call.function.arguments)


def test_a_required_tool_choice_calls_at_least_one_of_the_tools(client):
    """The reply is a JSON array of calls (vLLM's schema); parallel_tool_calls false allows one."""
    for parallel in (None, False):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=_ASKED, tools=_TOOLS, tool_choice="required",
                                               max_tokens=64, temperature=0, **extra)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "", choice
        calls = choice.message.tool_calls
        assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
        assert parallel is None or len(calls) == 1
    content, streamed, reasons = _streamed_calls(client, messages=_ASKED, tools=_TOOLS, tool_choice="required",
                                                 max_tokens=64, temperature=0, extra_body={"parallel_tool_calls": False})
    assert content == "" and reasons[-1] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [(c.function.name, c.function.arguments)
                                                                       for c in calls]


def test_with_tools_and_no_call_the_reply_is_text_and_a_past_call_reaches_the_prompt(client, server, smollm2_llm):
    """tool_choice "auto" (the default with tools): SmolLM2 does not call in Qwen's format, so
    the reply is its text, as without tools. A conversation that went through a call (an
    assistant's tool_calls with null content, the tool's answer) is rendered by the template."""
    history = [*_ASKED, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "chatcmpl-tool-1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=history, tools=_TOOLS, max_tokens=12,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    rendered = smollm2_llm.tokenizer.apply_chat_template(
        [*_ASKED, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny, 21 C"}], tools=_TOOLS)
    assert choice.message.content == _expected(smollm2_llm, rendered, 12)
    assert reply.usage.prompt_tokens == len(rendered)
    content, calls, reasons = _streamed_calls(client, messages=history, tools=_TOOLS, max_tokens=12, temperature=0)
    assert (content, calls, reasons[-1]) == (choice.message.content, {}, "length")


_ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
                  "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer"}}}


def test_structured_output_follows_its_spec(server, client, smollm2_llm):
    """vLLM's structured_outputs, its older guided_* names and OpenAI's response_format (refused
    before): the output keeps to the schema, expression or choice, greedy and sampled, streamed or
    not; greedy equals the single-process engine under the same spec."""
    import jsonschema

    ask = [{"role": "user", "content": "Name a large city and its population."}]
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ask, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": _ANSWER_SCHEMA}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), _ANSWER_SCHEMA)
    prompt = smollm2_llm.tokenizer.apply_chat_template(ask, add_generation_prompt=True)
    (expected,) = smollm2_llm.generate([prompt], SamplingParams(max_tokens=80, structured_outputs={"json": _ANSWER_SCHEMA}))
    assert reply.choices[0].message.content == expected.text
    free = client.chat.completions.create(model=DEFAULT_MODEL, messages=ask, max_tokens=80, temperature=0)
    assert free.choices[0].message.content != expected.text
    sampled = client.chat.completions.create(model=DEFAULT_MODEL, messages=ask, max_tokens=80, temperature=1.0,
                                             seed=7, n=3, response_format={"type": "json_object"})
    for choice in sampled.choices:
        if choice.finish_reason == "stop":  # a sampled object may run past max_tokens
            assert isinstance(json.loads(choice.message.content), dict)
    assert any(choice.finish_reason == "stop" for choice in sampled.choices)
    streamed = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=10,
                                         stream=True, extra_body={"structured_outputs": {"choice": ["Rome", "Paris"]}})
    assert "".join(c.text for chunk in streamed for c in chunk.choices) in ("Rome", "Paris")
    phone = client.completions.create(model=DEFAULT_MODEL, prompt="Call me at", max_tokens=16, temperature=0.8, seed=1,
                                      n=2, extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", choice.text) for choice in phone.choices), phone


def test_null_in_an_optional_field_is_its_default(server, client):
    """The openai client sends temperature=None as null; it was a 422 where vLLM serves it."""
    body = {"prompt": "def fibonacci(n):", "max_tokens": 6, "temperature": None, "top_p": None, "top_k": None,
            "n": None, "stream": None, "echo": None, "ignore_eos": None, "skip_special_tokens": None}
    response = _post(server, "completions", body)
    assert response.status_code == 200, response.text
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=None, top_p=None, n=None)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_max_tokens_past_the_context_is_cut_to_the_room_left(server):
    """As vLLM: 100 tokens asked with 5 left give 5 (it was a 400); a max_tokens over the whole
    context, or a prompt that fills it, is still refused."""
    from oasiskv.cluster.api import _sampling

    context = server.service.max_model_len
    # The cut itself (a prompt this long would not fit this server's small store).
    assert _sampling(CompletionRequest(prompt="x", max_tokens=100), context - 5, context).max_tokens == 5
    assert _sampling(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), context - 5,
                     context).max_tokens == 5
    for body, fragment in (({"prompt": "hi", "max_tokens": context + 1}, "max_tokens"),
                           ({"prompt": [504] * context, "max_tokens": 1}, "leaves no room")):
        response = _post(server, "completions", body)
        assert response.status_code == 400 and fragment in response.json()["error"]["message"]


def test_chat_echo_starts_the_reply_with_the_assistant_message_it_continues(client):
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The answer is"}]
    kwargs = dict(model=DEFAULT_MODEL, messages=messages, max_tokens=6, temperature=0,
                  extra_body={"add_generation_prompt": False})
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    echoed = client.chat.completions.create(**{**kwargs, "extra_body": {"add_generation_prompt": False, "echo": True}})
    assert echoed.choices[0].message.content == "The answer is" + plain
    streamed = client.chat.completions.create(**{**kwargs, "extra_body": {"add_generation_prompt": False, "echo": True}},
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "The answer is" + plain
    # A final user message is not echoed (as vLLM).
    user_last = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages[:1], max_tokens=4,
                                               temperature=0, extra_body={"echo": True})
    assert not user_last.choices[0].message.content.startswith("Name a fruit.")


def test_continue_final_message_goes_on_inside_the_assistants_turn(client, smollm2_llm):
    """vLLM's continue_final_message (refused before): the prompt ends with the final message's
    text, its turn left open (transformers' rendering: tests/models/test_convert.py), and the
    reply is the engine's continuation of exactly that prompt."""
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The answer is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=extra)
    ids = smollm2_llm.tokenizer.apply_chat_template(messages, **extra)
    closed = smollm2_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert smollm2_llm.tokenizer.decode(ids).endswith("assistant\nThe answer is") and len(ids) < len(closed)
    assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].message.content == _expected(smollm2_llm, ids, 6)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    chunks = list(client.completions.create(
        model=DEFAULT_MODEL, prompt="def fibonacci(n):", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8 and chunks[-1].choices == []
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_version_and_the_model_card_carry_what_vllm_clients_read(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server.url}/version").json()["version"]
    card = httpx.get(f"{server.url}/v1/models", headers=headers).json()["data"][0]
    assert card["max_model_len"] == server.service.max_model_len and card["root"] == DEFAULT_MODEL


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_output(client, smollm2_llm):
    """vLLM reports which stop ended a choice (`stop_reason`); clients that tell stop strings
    apart read it. It was missing from every choice and chunk."""
    prompt = "def fibonacci(n):"
    expected = smollm2_llm.generate([smollm2_llm.encode(prompt)], SamplingParams(max_tokens=12))[0]
    stop_text = smollm2_llm.tokenizer.decode(expected.token_ids[3:5]).strip()
    stop_token = expected.token_ids[4]
    assert stop_text and stop_text in expected.text
    by_string = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                          stop=[stop_text])
    assert by_string.choices[0].finish_reason == "stop"
    assert by_string.model_extra is not None and by_string.choices[0].model_extra["stop_reason"] == stop_text
    by_token = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=12, temperature=0, extra_body={"stop_token_ids": [stop_token]})
    reply = by_token.choices[0]
    if reply.finish_reason == "stop":  # the chat prompt's output may not reach that token
        assert reply.model_extra["stop_reason"] in (stop_token, None)
    streamed = list(client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                              stop=[stop_text], stream=True))
    last = [c for c in streamed if c.choices][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop_text
    assert client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=3,
                                     temperature=0).choices[0].model_extra["stop_reason"] is None
    tokens = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"stop_token_ids": [stop_token]})
    assert tokens.choices[0].finish_reason == "stop" and tokens.choices[0].model_extra["stop_reason"] == stop_token


def test_n_choices_are_served_each_as_its_own_request(client, smollm2_llm):
    """n > 1 was refused; vLLM serves it (pass@k evaluations of a code model ask for it). Greedy
    choices are all the greedy text; seeded sampled ones differ from each other, come back the
    same on a second request, and stream as the whole response does, each under its index."""
    prompt = "def fibonacci(n):"
    greedy = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=8, temperature=0, n=2)
    expected = _expected(smollm2_llm, smollm2_llm.encode(prompt), 8)
    assert [c.index for c in greedy.choices] == [0, 1] and all(c.text == expected for c in greedy.choices)
    assert greedy.usage.completion_tokens == 16
    sampled = [client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=1.0,
                                         seed=7, n=3) for _ in range(2)]
    texts = [c.text for c in sampled[0].choices]
    assert texts == [c.text for c in sampled[1].choices] and len(set(texts)) == 3
    one = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7)
    assert one.choices[0].text == texts[0]  # choice 0 is the request's own seed
    streamed = ["", "", ""]
    for c in client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=12, temperature=1.0, seed=7, n=3, stream=True):
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=12, temperature=1.0, seed=7, n=3)
    assert streamed == [c.message.content for c in whole.choices]


def test_a_list_of_prompts_gets_n_choices_for_each_in_order(client, server, smollm2_llm):
    """Several prompts in one completions request were a 400; vLLM serves them (lm-eval's batched
    completions send them): n choices a prompt, prompt after prompt, usage summed over prompts."""
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:"]
    expected = [_expected(smollm2_llm, smollm2_llm.encode(p), 6) for p in prompts]
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [e for e in expected for _ in range(2)]
    assert out.usage.prompt_tokens == sum(len(smollm2_llm.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 36
    as_ids = client.completions.create(model=DEFAULT_MODEL, prompt=[smollm2_llm.encode(p) for p in prompts[:2]],
                                       max_tokens=6, temperature=0)
    assert [c.text for c in as_ids.choices] == expected[:2]
    streamed = ["", "", ""]
    for c in client.completions.create(model=DEFAULT_MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for choice in c.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected
    response = _post(server, "completions", {"prompt": ["hi"] * 33, "n": 2, "max_tokens": 1})
    assert response.status_code == 400 and "over 64 choices" in response.json()["error"]["message"]


def test_a_prefill_worker_killed_mid_prefill_leaves_nothing_in_the_store(server, client):
    """The prefill worker dies while it writes a long prompt's KV: the request ends with a clear
    error, and its partly written KV leaves the store at once (not at the store's TTL, ten
    minutes later: the API asked the dead worker, then the restarting one, to free it)."""
    import ray

    prefill = server.service.handles.prefill[0].handle
    outcome = {}

    def send():
        try:
            client.completions.create(model=DEFAULT_MODEL, prompt=stdlib_source()[:12000], max_tokens=8)
            outcome["error"] = None
        except openai.APIStatusError as error:
            outcome["error"] = error

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 60
    while not _store_requests(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _store_requests(server) == 1, "the prefill never started writing the store"
    ray.kill(prefill, no_restart=False)
    sender.join(timeout=120)
    assert outcome["error"] is not None and outcome["error"].status_code == 503
    assert "failed in a worker" in str(outcome["error"])
    assert _wait_until_freed(server, deadline_s=30)[1]["num_requests"] == 0
    out = _served_again(client, deadline_s=180)
    assert out is not None and out.usage.completion_tokens == 4


def test_a_decode_worker_broken_for_good_is_restarted_and_serves_again(server, client):
    """A decode worker that reports its engine broken for good (its error set from outside here,
    as three failed steps in a row or requests it could not give back would set it) refuses
    every request, and nothing restarted it: its actor lives and the head's liveness probe checks
    only the port. The API's health poll now has Ray restart it, and requests are served again."""
    import ray

    slot = server.service.handles.decode[0]
    ray.get(slot.handle.__ray_call__.remote(lambda worker: setattr(worker, "_error", "injected: broken for good")))
    asyncio.run(server.service.poll_once())  # the background poll may have been first
    assert slot.restart_requested
    out = _served_again(client, deadline_s=180)
    assert out is not None and out.usage.completion_tokens == 4
    stats = ray.get(slot.handle.stats.remote())
    assert stats["healthy"] and stats["error"] is None
    asyncio.run(server.service.poll_once())
    assert slot.healthy and not slot.restart_requested
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'oasiskv_worker_restarts_total{role="decode",worker="decode-0"} 1.0' in metrics


def test_killed_decode_worker_fails_its_request_and_the_server_recovers(server, client):
    """Runs next to last: kills the decode actor mid-stream. Ray restarts it; the request in flight
    ends with a clear error, its KV is freed, and later requests are served again. Three choices:
    the two that did not see the worker die were cut short by the one that did, and their store
    memory stayed until the store's TTL (ten minutes; nobody told the store)."""
    lines = _stream_killing(server, server.service.handles.decode[0].handle, n=3)
    errors = [line for line in lines if '"error"' in line]
    assert errors and "failed in a worker" in errors[0]
    data = [line for line in lines if line.startswith("data:")]
    assert data[-2] == errors[0] and data[-1] == "data: [DONE]"  # the error ends the stream, as in vLLM
    deadline = time.monotonic() + 180
    out = _served_again(client, deadline_s=180)
    assert out is not None and out.usage.completion_tokens == 4
    while _store_requests(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _store_requests(server) == 0


def test_a_killed_store_fails_its_request_and_comes_back_empty(server, client):
    """Runs last, after the decode worker's: kills the store actor mid-stream. The request whose
    KV it held ends with a clear error; Ray restarts the store, empty and at a new address, which
    the health poll routes to, so later requests are served again."""
    import ray

    store = server.service.handles.stores[0]
    address_before = store.address
    lines = _stream_killing(server, store.handle)
    errors = [line for line in lines if '"error"' in line]
    assert errors and "failed in a worker" in errors[0]
    out = _served_again(client, deadline_s=120)
    assert out is not None and out.usage.completion_tokens == 4
    assert store.address != address_before
    assert _store_requests(server) == 0
    decode = server.service.handles.decode[0].handle
    assert ray.get(decode.stats.remote())["running"] == 0
    # The decode worker let go of its client of the store's old process (told by the health poll,
    # once the failed request was freed); only the new one's is left. Each restart left one behind.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        decode_stats = ray.get(decode.stats.remote())
        if decode_stats["store_clients"] == 1 and decode_stats["store_clients_retired"] == 0:
            break
        time.sleep(0.5)
    assert (decode_stats["store_clients"], decode_stats["store_clients_retired"]) == (1, 0)


def test_chat_template_options_shape_the_prompt_as_vllm_does(server, smollm2_llm):
    """add_generation_prompt, chat_template_kwargs and declined tools reach the template (they
    were logged as ignored, and the prompt was not the one asked for); what is not served is a
    400."""
    messages = [{"role": "user", "content": "Hi!"}]
    tokenizer = smollm2_llm.tokenizer

    def prompt_tokens(**extra) -> int:
        response = _post(server, "chat/completions", {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 1,
                                                      **extra})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    with_prompt = len(tokenizer.apply_chat_template(messages))
    without = len(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
    assert without < with_prompt
    assert prompt_tokens() == with_prompt
    assert prompt_tokens(add_generation_prompt=False) == without
    assert prompt_tokens(chat_template_kwargs={"unused_by_this_template": True}) == with_prompt
    for extra, fragment in (({"continue_final_message": True}, "continue_final_message needs add_generation_prompt: false"),
                            ({"chat_template": "{{ messages }}"}, "chat_template is not supported"),
                            ({"chat_template_kwargs": {"messages": []}}, "may not set ['messages']")):
        response = _post(server, "chat/completions", {"model": DEFAULT_MODEL, "messages": messages, **extra})
        assert response.status_code == 400 and fragment in response.text, response.text
