"""What `oasiskv bench serve` measures, against a server whose every byte and delay is known.

The server here speaks just enough HTTP/1.1 and of OpenAI's streaming API: each request's prompt
is a script, the list of server-sent events to send and the delay before each, so a test knows
the true TTFT, gaps, end of the answer and token counts, and can send events no real server
would. The definitions checked are `vllm bench serve`'s: a chunk carrying a choice is a token
event even with empty text, the request ends at the last such chunk, and output tokens come from
the server's usage, else from re-tokenizing the text. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import threading

import numpy as np
import pytest

from oasiskv.cluster.loadtest import add_arguments_bench, cli, run_bench, runner
from oasiskv.cluster.loadtest.arrivals import arrival_offsets
from oasiskv.cluster.loadtest.datasets import TokenCounter, file_requests, jsonl_requests
from oasiskv.cluster.loadtest.sse import RequestResult
from oasiskv.cluster.loadtest.stats import summarize

DONE = "[DONE]"


# --- the scripted server ------------------------------------------------------------------------

class ScriptedServer:
    """Runs on its own event loop in a thread, since the tool under test runs `asyncio.run`.

    A script: {"events": [[delay_s, data], ...], "status": 200, "crowd": n, "crowd_wait_s": s}.
    Each `data` is written as `data: <data>` after its delay (from the previous event); with
    `crowd`, nothing is sent until n requests are in flight at once (or crowd_wait_s passed).
    """

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.in_flight = 0
        self.peak_in_flight = 0
        self.arrivals = 0
        self._crowds: dict[int, asyncio.Event] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> str:
        self._thread.start()
        # a crowd test opens >1000 connections at once: the default backlog of 100 would
        # make the kernel drop the excess and the client retry a second later
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=4096), self.loop).result()
        self._server = server
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        async def close():
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def reset(self) -> None:
        # waits for the clearing to run (a test that counts arrivals must not see the last
        # test's), and lets a request of the last test that is still being answered finish first
        async def clear():
            for _ in range(500):
                if self.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            self.peak_in_flight = self.arrivals = 0
            self._crowds.clear()

        asyncio.run_coroutine_threadsafe(clear(), self.loop).result(timeout=10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            request_line, *header_lines = head.split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = {name.strip().lower(): value.strip()
                       for name, _, value in (line.partition(":") for line in header_lines if line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path == "/v1/models":
                self._reply_json(writer, 200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
                return
            payload = json.loads(body)
            prompt = payload["messages"][-1]["content"] if "messages" in payload else payload["prompt"]
            try:
                script = json.loads(prompt)
            except json.JSONDecodeError:
                self._reply_json(writer, 400, {"error": {"message": "the prompt is not a script"}})
                return
            await self._play(script, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up (a timeout under test): nothing to answer
        finally:
            writer.close()

    async def _play(self, script: dict, writer: asyncio.StreamWriter) -> None:
        self.arrivals += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        for size, crowd_reached in self._crowds.items():
            if self.in_flight >= size:
                crowd_reached.set()
        try:
            if script.get("crowd"):
                crowd_reached = self._crowds.setdefault(script["crowd"], asyncio.Event())
                if self.in_flight >= script["crowd"]:
                    crowd_reached.set()
                try:
                    await asyncio.wait_for(crowd_reached.wait(), script.get("crowd_wait_s", 5.0))
                except TimeoutError:
                    pass  # answer anyway: the test reads the peak
            status = script.get("status", 200)
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: text/event-stream\r\n"
                         "Connection: close\r\n\r\n".encode())
            for delay, data in script["events"]:
                await asyncio.sleep(delay)
                writer.write(f"data: {data}\n\n".encode())
                await writer.drain()
        finally:
            self.in_flight -= 1

    @staticmethod
    def _reply_json(writer: asyncio.StreamWriter, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     "Connection: close\r\n\r\n".encode() + data)


@pytest.fixture(scope="module")
def scripted():
    server = ScriptedServer()
    server.url = server.start()
    yield server
    server.stop()


@pytest.fixture
def server(scripted):
    scripted.reset()
    return scripted


def completion(text: str, finish: str | None = None) -> str:
    return json.dumps({"id": "x", "object": "text_completion",
                       "choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def chat(delta: dict, finish: str | None = None) -> str:
    return json.dumps({"id": "x", "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def usage(completion_tokens: int, prompt_tokens: int = 3, choices=()) -> str:
    return json.dumps({"id": "x", "choices": list(choices) if choices is not None else None,
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}})


def script(*events: tuple[float, str], **options) -> str:
    return json.dumps({"events": [list(event) for event in events], **options})


def bench(server: ScriptedServer, tmp_path, scripts: list[str], *extra: str, num_prompts: int | None = None,
          name: str = "run.json") -> tuple[int, dict]:
    prompts = tmp_path / f"{name}.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": s, "max_tokens": 16}) + "\n" for s in scripts))
    parser = argparse.ArgumentParser(prog="oasiskv bench")
    add_arguments_bench(parser)
    args = parser.parse_args([
        "serve", "--base-url", server.url, "--model", "scripted", "--skip-initial-test", "--disable-tqdm",
        "--dataset", "jsonl", "--jsonl-path", str(prompts), "--num-prompts", str(num_prompts or len(scripts)),
        "--save-result", "--no-plot", "--result-dir", str(tmp_path), "--result-filename", name, *extra])
    code = run_bench(args)
    return code, json.loads((tmp_path / name).read_text())


def word_tokenizer(folder, words) -> str:
    """A tokenizer.json of one token per whitespace-separated word, so counts are known."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {word: i for i, word in enumerate(["[UNK]", *dict.fromkeys(words)])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json")


# --- output tokens ---------------------------------------------------------------------------------

def test_without_usage_output_tokens_are_the_generated_text_re_tokenized(server, tmp_path, capsys):
    # Speculative decoding puts several tokens in a chunk: 8 words in 3 chunks.
    multi_token = script((0.02, completion(" alpha beta gamma")), (0.02, completion(" delta")),
                         (0.02, completion(" eps zeta eta theta", "length")), (0, DONE))
    # The server's usage wins when there is one, even over the tokenizer.
    with_usage = script((0.02, completion(" alpha beta")), (0.02, completion(" gamma", "length")),
                        (0, usage(11)), (0, DONE))
    tokenizer = word_tokenizer(tmp_path, "alpha beta gamma delta eps zeta eta theta".split())
    code, record = bench(server, tmp_path, [multi_token, with_usage], "--tokenizer", tokenizer, "--no-stream-usage")
    assert code == 0
    requests = record["requests"]
    assert [r["output_tokens"] for r in requests] == [8, 11]
    assert [r["output_tokens_source"] for r in requests] == ["tokenizer", "usage"]
    assert record["summary"]["total_output_tokens"] == 19
    assert record["summary"]["output_tokens_source"] == "tokenizer"
    first = requests[0]
    assert len(first["itl"]) == 2  # still one ITL sample per chunk, as vLLM
    assert first["tpot"] == pytest.approx((first["e2e"] - first["ttft"]) / 7)
    assert "generated_text" not in first  # measurements only, not the model's answers
    assert "re-tokenized with --tokenizer" in capsys.readouterr().out


# --- connections -----------------------------------------------------------------------------------

def test_unlimited_concurrency_puts_every_request_in_flight_at_once(server, tmp_path):
    """More requests than httpx's default pool holds (1024) are all sent at once: none waits on
    the client for a connection, which its TTFT would count."""
    crowd = 1100
    held = script((0, completion(" x", "length")), (0, DONE), crowd=crowd, crowd_wait_s=6.0)
    code, record = bench(server, tmp_path, [held], num_prompts=crowd)
    assert record["summary"]["completed"] == crowd and code == 0
    assert server.peak_in_flight == crowd


# --- timeouts --------------------------------------------------------------------------------------

def test_request_timeout_bounds_the_whole_request_not_each_read(server, tmp_path):
    # 15 chunks 0.2 s apart: never 1 s without a byte, but 3 s in all
    steady = script(*[(0.2, completion(" t", "length" if i == 14 else None)) for i in range(15)], (0, DONE))
    quick = script((0.05, completion(" t", "length")), (0, DONE))
    code, record = bench(server, tmp_path, [steady, quick], "--request-timeout", "1")
    assert code == 1
    slow, fast = record["requests"]
    assert not slow["success"] and slow["error"].startswith("request timeout:")
    assert "--request-timeout" in slow["error"]
    assert fast["success"]
    assert record["summary"]["errors"] == {"request timeout": 1}
    assert record["summary"]["duration_s"] < 2.5  # stopped at 1 s, not at the end of the stream


# --- malformed streams -----------------------------------------------------------------------------

def test_malformed_events_fail_their_request_with_the_reason(server, tmp_path, capsys, caplog):
    bad_events = ["null", "[1, 2]", json.dumps({"choices": [], "usage": 5}), json.dumps({"choices": "x"}),
                  json.dumps({"choices": [{"index": 0, "text": 5}]}),
                  json.dumps({"choices": [], "usage": {"completion_tokens": "3"}})]
    scripts = [script((0.02, completion(" a")), (0.02, bad), (0, completion(" b", "length")), (0, DONE))
               for bad in bad_events]
    # `choices: null` beside usage is read as no choices, as vLLM reads it
    scripts.append(script((0.02, completion(" a", "length")), (0, usage(1, choices=None)), (0, DONE)))
    code, record = bench(server, tmp_path, scripts)
    assert code == 1
    summary = record["summary"]
    assert summary["completed"] == 1 and summary["failed"] == len(bad_events)
    assert summary["errors"] == {"bad SSE event": len(bad_events)}  # not "cancelled: --max-duration"
    errors = [r["error"] for r in record["requests"][:len(bad_events)]]
    assert "expected a JSON object, got null" in errors[0]
    assert '"usage" must be an object, got 5' in errors[2]
    assert '"text" must be a string' in errors[4]
    assert '"usage.completion_tokens" must be a count' in errors[5]
    assert record["requests"][-1]["output_tokens"] == 1
    assert "Task exception was never retrieved" not in capsys.readouterr().err + caplog.text


def test_a_client_bug_is_a_failed_request_not_a_cancelled_one(server, tmp_path, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug in the client")

    monkeypatch.setattr(runner, "send_request", broken)
    code, record = bench(server, tmp_path, [script((0, completion(" a", "length")), (0, DONE))])
    assert code == 1
    assert record["requests"][0]["error"] == "client error: RuntimeError: a bug in the client"


# --- when a request starts and ends ---------------------------------------------------------------

def test_a_first_chunk_without_text_still_gives_the_ttft(server, tmp_path):
    """OasisKV answers an end-of-sequence first token with one chunk of empty text; the request
    succeeded, so it has a TTFT and can meet the SLOs (vLLM times the first chunk with a choice)."""
    eos_first = script((0.15, completion("", "stop")), (0, usage(1)), (0, DONE))
    code, record = bench(server, tmp_path, [eos_first, eos_first], "--goodput", "ttft:5000", "tpot:1")
    assert code == 0
    summary = record["summary"]
    assert all(0.15 <= r["ttft"] < 0.6 for r in record["requests"])
    assert summary["request_goodput"] == pytest.approx(2 / summary["duration_s"])
    # chat: the role announcement comes at once and is not the first token; the empty finish is
    role_then_eos = script((0, chat({"role": "assistant", "content": ""})), (0.15, chat({}, "stop")), (0, DONE))
    code, record = bench(server, tmp_path, [role_then_eos], "--endpoint", "chat", name="chat.json")
    assert code == 0
    assert 0.15 <= record["requests"][0]["ttft"] < 0.6


def test_a_reply_of_no_counted_tokens_meets_the_tpot_slo():
    # e.g. an end-of-sequence first token re-tokenized without special tokens: 0 tokens
    empty = RequestResult(index=0, prompt_len=4, max_tokens=8, success=True, ttft=0.1, e2e=0.1, output_tokens=0)
    summary = summarize([empty], duration=1.0, slos={"tpot": 10}, percentiles=[99])
    assert summary["request_goodput"] == pytest.approx(1.0)


def test_a_stream_with_no_choice_at_all_is_a_failure(server, tmp_path):
    code, record = bench(server, tmp_path, [script((0.02, usage(0)), (0, DONE))])
    assert code == 1
    assert record["requests"][0]["error"].startswith("no token")


def test_the_request_ends_at_its_last_chunk_with_a_choice(server, tmp_path):
    # tokens at 0.10, 0.15, 0.20 s; the usage 0.5 s later and [DONE] 0.3 s after that
    late_trailer = script((0.1, completion(" a")), (0.05, completion(" b")), (0.05, completion(" c", "length")),
                          (0.5, usage(3)), (0.3, DONE))
    # an empty finishing chunk 0.2 s after the last text is a chunk with a choice: it ends it
    empty_finish = script((0.1, completion(" a")), (0.05, completion(" b")), (0.2, completion("", "stop")),
                          (0, usage(2)), (0, DONE))
    code, record = bench(server, tmp_path, [late_trailer, empty_finish], "--max-concurrency", "1")
    assert code == 0
    trailer, finish = record["requests"]
    assert 0.2 <= trailer["e2e"] < 0.45, trailer["e2e"]  # not 1.0 s, when the stream closed
    assert trailer["tpot"] == pytest.approx((trailer["e2e"] - trailer["ttft"]) / 2)
    assert 0.35 <= finish["e2e"] < 0.6
    assert len(finish["itl"]) == 2 and finish["itl"][-1] >= 0.2


# --- arguments --------------------------------------------------------------------------------------

def test_infinite_or_overflowing_burstiness_is_refused(server, tmp_path):
    for rate, shape in ((5.0, math.inf), (1e-10, 1e-300)):
        with pytest.raises(ValueError, match="burstiness"):
            arrival_offsets(4, rate, shape, np.random.default_rng(0))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": script((0, completion(" a", "length")), (0, DONE))}) + "\n")
    parser = argparse.ArgumentParser(prog="oasiskv bench")
    add_arguments_bench(parser)
    for rate, shape in (("5", "inf"), ("1e-10", "1e-300")):
        args = parser.parse_args(["serve", "--base-url", server.url, "--model", "scripted", "--skip-initial-test",
                                  "--disable-tqdm", "--dataset", "jsonl", "--jsonl-path", str(prompts),
                                  "--num-prompts", "3", "--request-rate", rate, "--burstiness", shape])
        assert run_bench(args) == 2
    assert server.arrivals == 0


def test_an_absolute_files_glob_picks_its_own_folder(tmp_path):
    (tmp_path / "alpha.py").write_text("def alpha():\n    return 1\n")
    (tmp_path / "notes.txt").write_text("not python")
    requests = file_requests(2, 64, 8, np.random.default_rng(0), TokenCounter(), None, f"{tmp_path}/*.py")
    assert all("# file: alpha.py" in r.prompt and "notes.txt" not in r.prompt for r in requests)
    for pattern in ("/", f"{tmp_path}/*.rs"):
        with pytest.raises(ValueError):
            file_requests(1, 64, 8, np.random.default_rng(0), TokenCounter(), None, pattern)


def test_prompt_lengths_have_a_limit_checked_before_building_them(server, tmp_path, capsys):
    limit = 1 << 20  # tokens a prompt, the limit the tool states
    parser = argparse.ArgumentParser(prog="oasiskv bench")
    add_arguments_bench(parser)
    common = ["serve", "--base-url", server.url, "--model", "scripted", "--skip-initial-test", "--disable-tqdm"]
    for extra in (["--random-input-len", str(limit + 1), "--num-prompts", "1"],
                  ["--random-input-len", str(limit * 4 // 5), "--random-range-ratio", "0.5",
                   "--num-prompts", "1"],
                  ["--dataset", "files", "--files-input-len", str(limit * 2), "--num-prompts", "1"],
                  # each prompt within the limit, all of them together not
                  ["--random-input-len", str(limit), "--num-prompts", "300"]):
        assert run_bench(parser.parse_args(common + extra)) == 2, extra
        assert "oasiskv bench serve:" in capsys.readouterr().err
    assert server.arrivals == 0
    assert cli.MAX_PROMPT_TOKENS == limit


def test_percentiles_0_and_100_are_the_extremes(server, tmp_path, capsys):
    scripts = [script((delay, completion(" a", "length")), (0, DONE)) for delay in (0.05, 0.1, 0.2)]
    code, record = bench(server, tmp_path, scripts, "--percentiles", "0,50,100")
    assert code == 0
    ttfts_ms = [r["ttft"] * 1000 for r in record["requests"]]
    assert record["summary"]["p100_ttft_ms"] == pytest.approx(max(ttfts_ms))
    assert record["summary"]["p0_ttft_ms"] == pytest.approx(min(ttfts_ms))
    report = capsys.readouterr().out
    assert "P100 TTFT (ms):" in report and "P0 TTFT (ms):" in report


def test_requests_left_unsent_by_max_duration_are_not_failures(server, tmp_path, capsys):
    # seed 1: of 6 requests at 4/s, 3 are due before 0.6 s (the last at 0.35 s, answered by then)
    seed, max_duration = 1, 0.6
    quick = script((0.02, completion(" a", "length")), (0, DONE))
    lines = tmp_path / "offsets.jsonl"
    lines.write_text(json.dumps({"prompt": quick, "max_tokens": 16}) + "\n")
    rng = np.random.default_rng(seed)
    jsonl_requests(lines, 6, 16, TokenCounter())  # draws nothing: the tool's generator is unchanged
    offsets = arrival_offsets(6, 4.0, 1.0, rng)
    unsent = int(np.sum(offsets >= max_duration))
    assert 0 < unsent < 6 and not np.any((offsets > max_duration - 0.2) & (offsets < max_duration))
    code, record = bench(server, tmp_path, [quick], "--request-rate", "4", "--seed", str(seed),
                         "--max-duration", str(max_duration), num_prompts=6)
    summary = record["summary"]
    assert summary["not_sent"] == unsent and summary["failed"] == 0 and summary["errors"] == {}
    assert summary["completed"] + summary["failed"] + summary["not_sent"] == 6
    assert [r["sent"] for r in record["requests"]] == [bool(o < max_duration) for o in offsets]
    assert code == 0  # every request sent succeeded
    report = capsys.readouterr().out
    assert re.search(r"Failed requests:\s+0\s", report)
    assert re.search(rf"Not sent \(--max-duration reached\):\s+{unsent}\s", report)
