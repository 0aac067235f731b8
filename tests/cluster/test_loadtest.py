"""Unit tests of the load-test tool (`oasiskv bench serve`) alone, not of OasisKV's API.

The tool is pointed at a small OpenAI-compatible SSE server written here with FastAPI and run by
uvicorn on 127.0.0.1, whose timing (delay to the first token, gap between chunks) and failures
the tests set, so the measured numbers can be checked against known ones. Arrival statistics use
a fixed seed. Nothing leaves the loopback interface.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from oasiskv.cluster.loadtest import add_arguments_bench, run_bench  # noqa: E402
from oasiskv.cluster.loadtest.arrivals import arrival_offsets  # noqa: E402
from oasiskv.cluster.loadtest.datasets import (  # noqa: E402
    TokenCounter, file_requests, jsonl_requests, random_requests, sample_lengths)
from oasiskv.cluster.loadtest.sse import RequestResult  # noqa: E402
from oasiskv.cluster.loadtest.stats import (  # noqa: E402
    describe_ms, parse_goodput, percentile, summarize, timeline)

MODEL = "fake-model"


# --- a fake OpenAI-compatible streaming server ------------------------------------------------

DEFAULT_BEHAVIOUR = {
    "ttft": 0.05,          # seconds before the first chunk
    "itl": 0.01,           # seconds between chunks
    "tokens_per_chunk": 1,
    "fail_every": 0,       # every n-th request fails with `fail_status`
    "fail_status": 500,
    "usage": True,         # honour stream_options.include_usage
    "api_key": None,       # required bearer token
}


class FakeServer:
    def __init__(self):
        self.behaviour = dict(DEFAULT_BEHAVIOUR)
        self.payloads: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.count = 0
        self.lock = threading.Lock()
        self.app = self._build()

    def reset(self):
        self.behaviour = dict(DEFAULT_BEHAVIOUR)
        self.payloads.clear()
        self.headers.clear()
        self.max_in_flight = self.count = 0

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._handle(request, chat=True)

        return app

    async def _handle(self, request: Request, chat: bool):
        body = await request.json()
        b = self.behaviour
        with self.lock:
            self.count += 1
            number = self.count
            self.payloads.append(body)
            self.headers.append(dict(request.headers))
        if b["api_key"] and request.headers.get("authorization") != f"Bearer {b['api_key']}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        if b["fail_every"] and number % b["fail_every"] == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=b["fail_status"])
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        max_tokens = body["max_tokens"]
        usage = b["usage"] and (body.get("stream_options") or {}).get("include_usage")

        async def events():
            with self.lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(b["ttft"])
                sent = 0
                while sent < max_tokens:
                    n = min(b["tokens_per_chunk"], max_tokens - sent)
                    sent += n
                    text = "tok " * n
                    finish = "length" if sent == max_tokens else None
                    choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                              else {"index": 0, "text": text, "finish_reason": finish})
                    yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
                    if sent < max_tokens:
                        await asyncio.sleep(b["itl"])
                if usage:
                    stats = {"prompt_tokens": len(prompt.split()), "completion_tokens": sent,
                             "total_tokens": len(prompt.split()) + sent}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': stats})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                with self.lock:
                    self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    config = uvicorn.Config(fake.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not instance.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    port = instance.servers[0].sockets[0].getsockname()[1]
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    instance.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def fake(server):
    server.reset()
    yield server
    server.reset()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="oasiskv bench")
    add_arguments_bench(parser)
    return parser.parse_args(list(argv))


def bench(fake: FakeServer, tmp_path, *extra: str, name: str = "run.json") -> tuple[int, dict]:
    args = parse("serve", "--base-url", fake.url, "--disable-tqdm", "--save-result",
                 "--result-dir", str(tmp_path), "--result-filename", name, *extra)
    code = run_bench(args)
    return code, json.loads((tmp_path / name).read_text())


# --- arrivals ----------------------------------------------------------------------------------

def _gaps(offsets):
    return np.diff(offsets)


def test_poisson_arrivals_have_the_requested_rate_and_exponential_gaps():
    offsets = arrival_offsets(20001, request_rate=10.0, burstiness=1.0, rng=np.random.default_rng(0))
    gaps = _gaps(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)  # exponential: CV 1
    # memorylessness, roughly: P(gap > 2 mean) = e^-2
    assert np.mean(gaps > 0.2) == pytest.approx(math.exp(-2), abs=0.01)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_change_the_burstiness(burstiness):
    gaps = _gaps(arrival_offsets(20001, 5.0, burstiness, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(0.2, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_are_reproducible_and_infinite_rate_is_all_at_once():
    a = arrival_offsets(50, 3.0, 1.0, np.random.default_rng(7))
    b = arrival_offsets(50, 3.0, 1.0, np.random.default_rng(7))
    assert np.array_equal(a, b)
    assert np.array_equal(arrival_offsets(5, math.inf), np.zeros(5))
    assert len(arrival_offsets(0, 1.0)) == 0
    for rate, shape in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, shape)


# --- statistics --------------------------------------------------------------------------------

def test_percentiles_and_descriptions():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values + [math.nan], 90) == pytest.approx(90.1)
    assert math.isnan(percentile([], 50))
    stats = describe_ms([0.001 * v for v in values], [90, 99])
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)
    assert math.isnan(describe_ms([], [99])["p99"])


def test_goodput_slo_parsing():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:9000"]) == {"ttft": 500.0, "tpot": 50.0, "e2e": 9000.0}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["latency:5"], ["ttft:abc"], ["ttft:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def _result(i, ttft, e2e, tokens, success=True, start=0.0):
    r = RequestResult(index=i, prompt_len=100, max_tokens=tokens, success=success,
                      start=start, ttft=ttft, e2e=e2e, output_tokens=tokens if success else 0)
    r.chunk_times = [start + ttft + k * (e2e - ttft) / max(1, tokens - 1) for k in range(tokens)] if success else []
    r.itl = list(np.diff(r.chunk_times))
    return r


def test_summary_throughput_goodput_and_tpot():
    results = [_result(0, 0.1, 1.1, 11), _result(1, 0.5, 2.5, 11), _result(2, 0, 0, 0, success=False)]
    results[2].error = "HTTP 503: busy"
    summary = summarize(results, duration=4.0, slos={"ttft": 200, "tpot": 150}, percentiles=[90, 99])
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["total_input_tokens"] == 200 and summary["total_output_tokens"] == 22
    assert summary["request_throughput"] == pytest.approx(0.5)
    assert summary["output_throughput"] == pytest.approx(5.5)
    assert summary["total_token_throughput"] == pytest.approx(55.5)
    assert summary["request_goodput"] == pytest.approx(0.25)  # only request 0 meets both SLOs
    assert results[0].tpot == pytest.approx(0.1) and results[1].tpot == pytest.approx(0.2)
    assert summary["mean_tpot_ms"] == pytest.approx(150.0)
    assert summary["errors"] == {"HTTP 503": 1}
    # A one-token answer has no TPOT: left out of TPOT's statistics, and within any TPOT SLO.
    short = _result(3, 0.1, 0.1, 1)
    assert math.isnan(short.tpot)
    with_short = summarize(results + [short], duration=4.0, slos={"ttft": 200, "tpot": 150}, percentiles=[90])
    assert with_short["mean_tpot_ms"] == pytest.approx(150.0) and with_short["request_goodput"] == pytest.approx(0.5)
    series = timeline(results, duration=4.0)
    assert sum(series["output_tokens"]) == pytest.approx(22)
    assert sum(series["completed_requests"]) == pytest.approx(2)
    assert series["output_tokens_per_s"] == series["output_tokens"]  # whole one-second bins
    partial = timeline(results, duration=2.5)
    assert partial["output_tokens"][-1] > 0
    assert partial["output_tokens_per_s"][-1] == pytest.approx(partial["output_tokens"][-1] / 0.5)


# --- datasets ----------------------------------------------------------------------------------

def test_random_prompts_follow_lengths_and_range_ratio():
    rng = np.random.default_rng(0)
    lengths = sample_lengths(100, 0.5, 1000, rng)
    assert lengths.min() >= 50 and lengths.max() <= 150 and abs(lengths.mean() - 100) < 3
    requests = random_requests(20, 64, 16, 0.0, np.random.default_rng(0), TokenCounter())
    assert all(r.prompt_len == 64 and len(r.prompt.split()) == 64 and r.max_tokens == 16 for r in requests)
    again = random_requests(20, 64, 16, 0.0, np.random.default_rng(0), TokenCounter())
    assert [r.prompt for r in requests] == [r.prompt for r in again]


def test_file_prompts_are_long_real_source():
    requests = file_requests(3, 2048, 64, np.random.default_rng(0), TokenCounter())
    for r in requests:
        assert r.prompt.startswith("```python\n# file: ") and r.max_tokens == 64
        assert 1500 <= r.prompt_len <= 2100  # ~4 characters a token
        assert "def " in r.prompt or "class " in r.prompt


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two three", "max_tokens": 5}\n\n{"prompt": "four"}\n')
    requests = jsonl_requests(path, 3, 7, TokenCounter())
    assert [(r.prompt, r.max_tokens) for r in requests] == [("one two three", 5), ("four", 7), ("one two three", 5)]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=":1:"):
        jsonl_requests(path, 1, 7, TokenCounter())


# --- against the fake server --------------------------------------------------------------------

def test_streaming_run_measures_known_latencies(fake, tmp_path, capsys):
    code, record = bench(fake, tmp_path, "--num-prompts", "12", "--max-concurrency", "4",
                         "--random-input-len", "16", "--random-output-len", "8", "--percentiles", "50,90,99")
    assert code == 0
    s = record["summary"]
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["total_output_tokens"] == 96 and s["total_input_tokens"] == 12 * 16
    assert s["usage_reported"]
    assert 50 <= s["mean_ttft_ms"] < 500          # the server waits 50 ms before the first token
    assert 9 <= s["median_itl_ms"] < 100          # and 10 ms between tokens
    assert 9 <= s["mean_tpot_ms"] < 100
    assert s["mean_e2e_ms"] >= 50 + 7 * 10
    assert s["p99_ttft_ms"] >= s["p90_ttft_ms"] >= s["median_ttft_ms"]
    assert s["request_throughput"] == pytest.approx(12 / s["duration_s"])
    assert fake.max_in_flight <= 4
    # the initial test request plus the benchmark's, all streamed with usage requested
    assert len(fake.payloads) == 13
    assert all(p["stream"] and p["stream_options"] == {"include_usage": True} for p in fake.payloads)
    assert all(p["model"] == MODEL for p in fake.payloads)  # discovered from /v1/models
    assert all(len(r["itl"]) == 7 for r in record["requests"])
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = capsys.readouterr().out
    for line in ("Successful requests:", "Request throughput (req/s):", "Output token throughput",
                 "Total Token throughput", "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):",
                 "P90 E2E (ms):"):
        assert line in report


def test_chat_endpoint_jsonl_dataset_and_api_key(fake, tmp_path):
    fake.behaviour["api_key"] = "secret"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there", "max_tokens": 3}\n{"prompt": "bye", "max_tokens": 5}\n')
    code, record = bench(fake, tmp_path, "--endpoint", "chat", "--dataset", "jsonl", "--jsonl-path", str(prompts),
                         "--num-prompts", "4", "--api-key", "secret", "--model", MODEL, "--ignore-eos", "--no-plot")
    assert code == 0
    assert [r["output_tokens"] for r in record["requests"]] == [3, 5, 3, 5]
    assert [r["prompt_len"] for r in record["requests"]] == [2, 1, 2, 1]  # from the server's usage
    assert all(p["messages"][0]["role"] == "user" and p["ignore_eos"] for p in fake.payloads)
    assert not (tmp_path / "run.png").exists()
    fake.behaviour["api_key"] = "other"
    code, record = bench(fake, tmp_path, "--endpoint", "chat", "--num-prompts", "2", "--api-key", "secret",
                         "--model", MODEL, "--skip-initial-test", "--no-plot", name="denied.json")
    assert code == 1 and record["summary"]["errors"] == {"HTTP 401": 2}


def test_failed_requests_are_counted_and_reported(fake, tmp_path, capsys):
    fake.behaviour.update(fail_every=3, fail_status=429)
    code, record = bench(fake, tmp_path, "--num-prompts", "12", "--random-input-len", "8", "--random-output-len", "4",
                         "--skip-initial-test", "--no-plot", "--goodput", "ttft:10000", "e2e:10000", name="f.json")
    s = record["summary"]
    assert code == 1
    assert s["completed"] == 8 and s["failed"] == 4 and s["errors"] == {"HTTP 429": 4}
    assert s["request_goodput"] == pytest.approx(8 / s["duration_s"])
    assert "HTTP 429" in capsys.readouterr().out


def test_initial_test_failure_stops_before_the_benchmark(fake, tmp_path):
    fake.behaviour.update(fail_every=1, fail_status=500)
    args = parse("serve", "--base-url", fake.url, "--disable-tqdm", "--num-prompts", "5",
                 "--random-input-len", "4", "--random-output-len", "2")
    assert run_bench(args) == 1
    assert len(fake.payloads) == 1


def test_arrival_schedule_is_followed(fake, tmp_path):
    code, record = bench(fake, tmp_path, "--num-prompts", "10", "--request-rate", "20", "--seed", "3",
                         "--random-input-len", "4", "--random-output-len", "2", "--skip-initial-test", "--no-plot")
    assert code == 0
    offsets = arrival_offsets(10, 20.0, 1.0, _rng_after_dataset(seed=3, n=10, input_len=4, output_len=2))
    starts = [r["start"] for r in record["requests"]]
    assert all(start >= offset - 0.005 for start, offset in zip(starts, offsets))
    assert all(start - offset < 0.25 for start, offset in zip(starts, offsets))
    assert record["summary"]["duration_s"] >= offsets[-1]


def _rng_after_dataset(seed, n, input_len, output_len):
    """The generator in the state the tool uses it for arrivals (after drawing the dataset)."""
    rng = np.random.default_rng(seed)
    random_requests(n, input_len, output_len, 0.0, rng, TokenCounter())
    return rng


def test_max_duration_bounds_the_run(fake, tmp_path):
    fake.behaviour["ttft"] = 3.0
    started = time.monotonic()
    code, record = bench(fake, tmp_path, "--num-prompts", "6", "--request-rate", "4", "--max-duration", "0.6",
                         "--random-input-len", "4", "--random-output-len", "2", "--skip-initial-test", "--no-plot")
    assert time.monotonic() - started < 3.0
    assert code == 1
    errors = record["summary"]["errors"]
    assert record["summary"]["completed"] == 0
    # in flight at the end: cancelled, a failure; not yet sent: reported apart
    assert errors.get("cancelled", 0) >= 1 and sum(errors.values()) + record["summary"]["not_sent"] == 6


def test_multi_token_chunks_and_missing_usage(fake, tmp_path):
    fake.behaviour["tokens_per_chunk"] = 3
    code, record = bench(fake, tmp_path, "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "9",
                         "--skip-initial-test", "--no-plot")
    assert code == 0
    assert [r["output_tokens"] for r in record["requests"]] == [9, 9, 9]  # from usage, not 3 chunks
    assert all(len(r["chunk_times"]) == 3 for r in record["requests"])
    assert sum(record["timeline"]["output_tokens"]) == pytest.approx(27)
    fake.behaviour["usage"] = False
    code, record = bench(fake, tmp_path, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "9",
                         "--skip-initial-test", "--no-plot", name="nousage.json")
    assert code == 0 and not record["summary"]["usage_reported"]
    assert [r["output_tokens"] for r in record["requests"]] == [3, 3]  # one per chunk: an estimate


def test_bad_arguments_are_refused_without_sending(fake, capsys):
    for argv in (["--base-url", "ftp://127.0.0.1:1"], ["--num-prompts", "0"], ["--max-concurrency", "0"],
                 ["--dataset", "jsonl"], ["--goodput", "speed:3"], ["--percentiles", "0,120"],
                 ["--percentiles", "50,abc"],  # once a bare "could not convert string to float"
                 ["--save-result", "--result-dir", "/proc/nope"],  # once found only after the whole run
                 ["--metadata", "foo"], ["--metadata", "a=1", "=2"],  # once accepted, or dropped silently
                 ["--tokenizer", "/nonexistent"], ["--tokenizer", "/proc"]):  # once a raw traceback
        args = parse("serve", "--disable-tqdm", *argv) if "--base-url" in argv else parse(
            "serve", "--base-url", fake.url, "--disable-tqdm", *argv)
        assert run_bench(args) == 2, argv
    assert not fake.payloads
    assert "oasiskv bench serve:" in capsys.readouterr().err


def test_parser_defaults():
    args = parse("serve")
    assert math.isinf(args.request_rate) and args.burstiness == 1.0 and args.endpoint == "completions"
    assert args.base_url == "http://127.0.0.1:8000" and args.dataset == "random"
    with pytest.raises(SystemExit):
        parse()


def test_exact_lengths_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from oasiskv.cluster.loadtest.datasets import WORDS

    # a word-level tokenizer made here: one token per word, so lengths are checkable by eye
    vocab = {word: i for i, word in enumerate(["[UNK]", *dict.fromkeys(WORDS)])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    counter = TokenCounter(str(tmp_path))
    assert counter.exact
    requests = random_requests(5, 37, 4, 0.0, np.random.default_rng(0), counter)
    assert all(r.prompt_len == 37 == counter.count(r.prompt) for r in requests)
    assert counter.truncate("the of and to in", 3) == "the of and"


def test_a_result_dir_that_does_not_exist_is_made_and_metadata_keeps_its_values(fake, tmp_path):
    folder = tmp_path / "runs" / "today"
    code, record = bench(fake, folder, "--num-prompts", "1", "--random-input-len", "4", "--random-output-len", "3",
                         "--skip-initial-test", "--no-plot", "--metadata", "gpu=none", "note=a=b")
    assert code == 0 and folder.is_dir()
    assert record["config"]["metadata"] == {"gpu": "none", "note": "a=b"}
