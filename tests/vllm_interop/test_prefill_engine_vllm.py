"""`oasiskv serve --prefill-engine vllm`: the real cluster (Ray, a NIXL store actor, a vLLM
prefill actor writing through OasisKVConnector, an OasisKV decode actor) behind the
OpenAI-compatible API, driven with the official `openai` client; greedy text must equal vLLM
alone and OasisKV's engine."""

from __future__ import annotations

import openai
import pytest

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.server import BackgroundServer
from oasiskv.decode_node.config import DecodeConfig
from oasiskv.models.sampling import SamplingParams

from ..conftest import DEFAULT_MODEL, stdlib_source

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server():
    config = ServeConfig(
        model=DEFAULT_MODEL, port=0, store_capacity_gb=0.25, threads_per_worker=1, prefill_engine="vllm",
        vllm_kv_cache_gb=0.25, vllm_max_model_len=4096, decode=DecodeConfig(kv_pool_gb=0.25, budget_tokens=1024),
    )
    with BackgroundServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_the_prefill_actors_run_vllm(server):
    classes = {slot.handle._ray_actor_creation_function_descriptor.class_name for slot in server.service.handles.prefill}
    assert classes == {"VLLMPrefillWorker"}


def test_completions_through_a_vllm_prefill_match(client, smollm2_llm, vllm_prefill):
    from .test_vllm_connector import vllm_alone

    prompts = ["def fibonacci(n):", stdlib_source("heapq.py")[:2500]]
    for prompt in prompts:
        ids = smollm2_llm.encode(prompt)
        out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=24, temperature=0)
        expected = smollm2_llm.generate([ids], SamplingParams(max_tokens=24))[0]
        assert out.choices[0].text == expected.text
        assert out.usage.prompt_tokens == len(ids)
        assert vllm_alone(vllm_prefill, ids, max_tokens=len(expected.token_ids)) == expected.token_ids


def test_streamed_chat_through_a_vllm_prefill(client, smollm2_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    expected = smollm2_llm.chat([messages], SamplingParams(max_tokens=16))[0].text
    assert text == expected


def test_logprobs_through_a_vllm_prefill_match_the_engine(client, smollm2_llm):
    """The first token's logprobs come from vLLM (its raw logprobs), the others from OasisKV's decode."""
    prompt = "def fibonacci(n):"
    expected = smollm2_llm.generate([smollm2_llm.encode(prompt)], SamplingParams(max_tokens=8, logprobs=2))[0]
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert logprobs.tokens == [smollm2_llm.tokenizer.decode([t]) for t in expected.token_ids]
    assert max(abs(a - e.logprob) for a, e in zip(logprobs.token_logprobs, expected.logprobs, strict=True)) < 1e-3
    assert [sorted(d) for d in logprobs.top_logprobs] == [
        sorted({smollm2_llm.tokenizer.decode([t]) for t, _ in e.top}) for e in expected.logprobs]


def test_penalties_through_a_vllm_prefill_match_the_engine(client, smollm2_llm):
    """vLLM's first token is penalized as OasisKV's decode penalizes the rest (repetition: the prompt's tokens)."""
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    ids = smollm2_llm.encode(prompt)
    for penalties in ({"frequency_penalty": 1.0}, {"repetition_penalty": 1.3}):
        expected = smollm2_llm.generate([ids], SamplingParams(max_tokens=16, **penalties))[0].text
        kwargs = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
        extra = {k: v for k, v in penalties.items() if k == "repetition_penalty"}
        out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body=extra, **kwargs)
        assert out.choices[0].text == expected


def test_sampling_options_through_a_vllm_prefill_match_the_engine(client, smollm2_llm):
    """min_p, min_tokens, logit_bias, allowed_token_ids, bad_words and structured output: vLLM
    samples the first token with them (min_tokens as far as its one token goes), OasisKV's decode
    the rest."""
    messages = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    ids = smollm2_llm.tokenizer.apply_chat_template(messages)
    forced = smollm2_llm.encode(" banana")[0]
    eos = smollm2_llm.tokenizer.eos_token_id
    allowed = sorted({forced, smollm2_llm.encode(" maybe")[0], smollm2_llm.encode(" No")[0]})
    plain = smollm2_llm.generate([ids], SamplingParams(max_tokens=8))[0]
    first_word = smollm2_llm.tokenizer.decode(plain.token_ids[:1]).strip()
    assert first_word and smollm2_llm.generate([ids], SamplingParams(
        max_tokens=8, bad_words=[first_word]))[0].token_ids[0] != plain.token_ids[0]
    for params, kwargs, extra in (
        (SamplingParams(max_tokens=8, logit_bias={forced: 100}), {"logit_bias": {str(forced): 100}}, {}),
        (SamplingParams(max_tokens=40, min_tokens=12), {}, {"min_tokens": 12}),
        # EOS made the first choice: vLLM's one token must not be it, the decode's next one is.
        (SamplingParams(max_tokens=8, min_tokens=1, logit_bias={eos: 100}), {"logit_bias": {str(eos): 100}},
         {"min_tokens": 1}),
        (SamplingParams(max_tokens=16, temperature=1.0, min_p=1.0, seed=3), {"seed": 3}, {"min_p": 1.0}),
        # The first token too is one of them: vLLM is given the same list.
        (SamplingParams(max_tokens=6, allowed_token_ids=allowed), {}, {"allowed_token_ids": allowed}),
        # The model's first word: vLLM tokenizes the words as the API does and bans it too.
        (SamplingParams(max_tokens=8, bad_words=[first_word]), {}, {"bad_words": [first_word]}),
        # The first token keeps to the spec: vLLM compiles the same one with its own xgrammar.
        (SamplingParams(max_tokens=12, structured_outputs={"choice": ["Perhaps so", "maybe"]}), {},
         {"structured_outputs": {"choice": ["Perhaps so", "maybe"]}}),
        (SamplingParams(max_tokens=12, structured_outputs={"regex": "[0-9]{2}-[a-z]+"}), {},
         {"guided_regex": "[0-9]{2}-[a-z]+"}),
    ):
        expected = smollm2_llm.generate([ids], params)[0]
        out = client.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=params.max_tokens,
                                        temperature=params.temperature, extra_body=extra, **kwargs)
        assert out.choices[0].text == expected.text and expected.text
        assert out.usage.completion_tokens == len(expected.token_ids)


def test_what_vllm_cannot_prefill_is_a_400_and_the_server_serves_on(client, smollm2_llm):
    """A seeded, sampled prompt over one vLLM step failed inside vLLM on CPUs and wedged the
    prefill worker; a prompt of --vllm-max-model-len tokens got a 503 'retry it'."""
    ids = smollm2_llm.encode(stdlib_source("argparse.py"))
    with pytest.raises(openai.BadRequestError, match="cannot be prefilled by vLLM on CPUs"):
        client.completions.create(model=DEFAULT_MODEL, prompt=ids[:1100], max_tokens=4, temperature=0.8, seed=7)
    with pytest.raises(openai.BadRequestError, match="--vllm-max-model-len"):
        client.completions.create(model=DEFAULT_MODEL, prompt=ids[:4096], max_tokens=4)
    short = client.completions.create(model=DEFAULT_MODEL, prompt=ids[:1100], max_tokens=4, temperature=0.8)
    assert short.usage.completion_tokens == 4


def test_bad_words_make_the_token_sequences_vllm_makes(smollm2_dir):
    """OasisKV's decode bans what vLLM's prefill bans: the same sequences from the same tokenizer,
    for words alone, with spaces, of several tokens, and one whose spaced form has another length."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.tokenizers import get_tokenizer

    from oasiskv.models.sampling import tokenize_bad_words
    from oasiskv.models.tokenizer import load_tokenizer

    words = ["fox", " fox", "  lazy dog", "vexingly", "Hello", "世界", "def fibonacci(n):", "fox"]
    theirs = VLLMSamplingParams(bad_words=words)
    theirs.update_from_tokenizer(get_tokenizer(str(smollm2_dir)))
    ours = load_tokenizer(smollm2_dir)
    assert tokenize_bad_words(words, lambda text: ours.encode(text, False)) == theirs._bad_words_token_ids


def test_prompt_logprobs_and_echo_through_a_vllm_prefill_are_the_models(client, smollm2_llm, smollm2_dir):
    """vLLM computes the prompt's logprobs (and ranks) in its prefill; they reach the response as
    OasisKV's prefill would give them: transformers' on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = stdlib_source("heapq.py")[:600]
    ids = smollm2_llm.encode(prompt)
    out = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                    logprobs=1, extra_body={"prompt_logprobs": 2})
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    positions = out.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    chosen = logprobs[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    ranks = (logprobs[:-1] >= chosen.unsqueeze(-1)).sum(dim=-1).tolist()
    served = [position[str(token)] for position, token in zip(positions[1:], ids[1:])]
    assert max(abs(item["logprob"] - ref) for item, ref in zip(served, chosen.tolist())) < 1e-3
    assert sum(item["rank"] == rank for item, rank in zip(served, ranks)) > 0.97 * len(served)
    choice = out.choices[0]
    expected = smollm2_llm.generate([ids], SamplingParams(max_tokens=4))[0].text
    assert choice.text == prompt + expected
    assert choice.logprobs.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs[1 : len(ids)], chosen.tolist())) < 1e-3
