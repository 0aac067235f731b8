"""`oasiskv bench serve` when something is wrong: bad arguments and files, servers that do not
speak OpenAI's API, results that cannot be written where asked, a run stopped with Ctrl-C.

The server is http.server in a thread on 127.0.0.1; each test says how it answers. Streamed
answers are HTTP/1.0 bodies that end when the connection closes. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import oasiskv
from oasiskv.cluster.loadtest import add_arguments_bench, cli, run_bench
from oasiskv.cluster.loadtest.datasets import BenchRequest
from oasiskv.cluster.loadtest.runner import RunConfig, RunInterrupted, run_requests
from oasiskv.cluster.loadtest.sse import RequestOptions

from ..conftest import default_sigint


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self.server.owner.answer(self, "GET")

    def do_POST(self):
        self.server.owner.answer(self, "POST")


class Server:
    """Answers GET /v1/models with `models` (raw bytes or JSON), and POST /v1/completions with
    `post(handler, payload)`, by default a short stream."""

    def __init__(self):
        self.models: object = {"object": "list", "data": [{"id": "m", "object": "model"}]}
        self.post = stream_answer
        self.posts: list[dict] = []
        self.release = threading.Event()  # ends the waits of slow answers
        self.lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self._http.owner = self
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def answer(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        if method == "GET" and handler.path == "/v1/models":
            body = self.models if isinstance(self.models, bytes) else json.dumps(self.models).encode()
            reply(handler, 200, body, "application/json")
            return
        if method == "POST" and handler.path.startswith("/v1/"):
            payload = json.loads(handler.rfile.read(int(handler.headers.get("Content-Length", 0))))
            with self.lock:
                self.posts.append(payload)
            try:
                self.post(handler, payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away
            return
        handler.send_error(404)

    def stop(self) -> None:
        self.release.set()
        self._http.shutdown()
        self._http.server_close()


def reply(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def stream_answer(handler: BaseHTTPRequestHandler, payload: dict) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    for text, finish in ((" a", None), (" b", "length")):
        chunk = {"id": "x", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
    handler.wfile.write(b"data: [DONE]\n\n")
    handler.wfile.flush()


@pytest.fixture
def server():
    instance = Server()
    yield instance
    instance.stop()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="oasiskv bench")
    add_arguments_bench(parser)
    return parser.parse_args(["serve", "--disable-tqdm", *argv])


SMALL = ("--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2")


# --- where the results go ----------------------------------------------------------------------------

def test_a_result_filename_that_cannot_be_written_is_refused_before_the_run(server, tmp_path, capsys):
    """Its folder cannot be made, it names no file, or a folder stands where it goes."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for name in ("/proc/nope/x.json",  # absolute: --result-dir plays no part; once found after the run
                 f"{blocker.name}/x.json",  # a folder of its own under --result-dir
                 "sub/"):  # names no file
        args = parse("--base-url", server.url, "--model", "m", *SMALL, "--save-result",
                     "--result-dir", str(tmp_path), "--result-filename", name)
        assert run_bench(args) == 2, name
        assert "--result-filename" in capsys.readouterr().err, name
    folder = tmp_path / "made"
    (folder / "x.json").mkdir(parents=True)  # an existing folder where the file would go
    args = parse("--base-url", server.url, "--model", "m", *SMALL, "--save-result",
                 "--result-dir", str(folder), "--result-filename", "x.json")
    assert run_bench(args) == 2
    assert "--result-filename" in capsys.readouterr().err
    assert server.posts == []


def test_a_result_filename_with_its_own_folder_is_made_and_written(server, tmp_path):
    target = tmp_path / "elsewhere" / "deep" / "run.json"
    args = parse("--base-url", server.url, "--model", "m", *SMALL, "--skip-initial-test", "--save-result",
                 "--no-plot", "--result-dir", str(tmp_path / "unused"), "--result-filename", str(target))
    assert run_bench(args) == 0
    assert json.loads(target.read_text())["summary"]["completed"] == 2


def test_results_that_cannot_be_written_after_the_run_are_not_lost(server, tmp_path, capsys, monkeypatch):
    wanted = tmp_path / "run.json"
    real_save = cli.save_json

    def failing_save(record, path):
        if path == wanted:
            raise OSError(28, "No space left on device")
        return real_save(record, path)

    monkeypatch.setattr(cli, "save_json", failing_save)
    monkeypatch.setattr(cli.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    args = parse("--base-url", server.url, "--model", "m", *SMALL, "--skip-initial-test", "--save-result",
                 "--no-plot", "--result-dir", str(tmp_path), "--result-filename", "run.json")
    assert run_bench(args) == 1  # all requests succeeded, but the results are not where asked
    err = capsys.readouterr().err
    assert f"cannot write the results to {wanted}" in err and "No space left on device" in err
    [fallback] = (tmp_path / "tmp").glob("run-*.json")
    assert str(fallback) in err
    assert json.loads(fallback.read_text())["summary"]["completed"] == 2

    # and when the temporary folder fails too, the record is printed
    monkeypatch.setattr(cli.tempfile, "tempdir", str(tmp_path / "missing"))
    assert run_bench(args) == 1
    out, err = capsys.readouterr()
    assert "JSON record follows on stdout" in err
    record = json.loads(out[out.index('{\n  "partial"'):])
    assert record["summary"]["completed"] == 2


# --- servers that are not OpenAI-shaped ----------------------------------------------------------------

@pytest.mark.parametrize("body", [b"[1,2]", b'{"data":"x"}', b'{"data":[{"name":"x"}]}', b'{"data":[{"id":7}]}',
                                  b"<html>\n<body>\nhello\n</body>\n</html>\n"])
def test_a_model_listing_that_is_not_openai_shaped_is_one_clear_line(server, body, capsys):
    # once an AttributeError, a TypeError, or "cannot list models at ...: 'id'"
    server.models = body
    assert run_bench(parse("--base-url", server.url, *SMALL)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "/v1/models answer is not OpenAI-shaped" in err and '"data": [{"id":' in err, err
    assert server.posts == []


def test_a_model_listing_that_fails_or_is_empty_says_so(server, capsys):
    server.models = {"object": "list", "data": []}
    assert run_bench(parse("--base-url", server.url, *SMALL)) == 1
    assert "lists no models; pass --model" in capsys.readouterr().err
    server.answer = lambda handler, method: handler.send_error(404)
    assert run_bench(parse("--base-url", server.url, *SMALL)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GET /v1/models answered HTTP 404" in err, err


# --- JSONL files ---------------------------------------------------------------------------------------

def test_a_jsonl_file_that_is_not_utf8_is_named_with_its_line(server, tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_bytes(b'{"prompt": "fine"}\n\n{"prompt": "caf\xff"}\n')
    args = parse("--base-url", server.url, "--model", "m", "--dataset", "jsonl", "--jsonl-path", str(prompts))
    assert run_bench(args) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:3: not UTF-8" in err and "0xff" in err, err  # once only "'utf-8' codec can't decode"
    assert server.posts == []


def test_a_bad_byte_on_a_first_line_after_a_bom_is_named_at_its_own_offset(server, tmp_path, capsys):
    """The offset was counted after the BOM and read before it: 'byte 0x63, byte 16'."""
    prompts = tmp_path / "bom.jsonl"
    prompts.write_bytes(b'\xef\xbb\xbf{"prompt": "caf\xff"}\n')
    args = parse("--base-url", server.url, "--model", "m", "--dataset", "jsonl", "--jsonl-path", str(prompts))
    assert run_bench(args) == 2
    assert f"{prompts}:1: not UTF-8 text (byte 0xff, byte 16 of the line)" in capsys.readouterr().err


def test_a_result_filename_without_save_result_is_refused(server, tmp_path, capsys):
    """The run went ahead and its results were quietly not written."""
    args = parse("--base-url", server.url, "--model", "m", *SMALL, "--result-filename", str(tmp_path / "r.json"))
    assert run_bench(args) == 2
    assert "--result-filename is written only with --save-result" in capsys.readouterr().err
    assert server.posts == []


def test_jsonl_lines_end_at_newlines_only_and_may_open_with_a_bom(server, tmp_path):
    from oasiskv.cluster.loadtest.datasets import TokenCounter, jsonl_requests

    prompts = tmp_path / "p.jsonl"
    # a raw U+2028 and U+0085 inside a JSON string (JSON allows both): str.splitlines split the line there
    prompts.write_bytes('\ufeff{"prompt": "a\u2028b\x85c"}\r\n{"prompt": "d", "max_tokens": 3}\n'.encode())
    requests = jsonl_requests(prompts, 2, 7, TokenCounter())
    assert [(r.prompt, r.max_tokens) for r in requests] == [("a\u2028b\x85c", 7), ("d", 3)]


@pytest.mark.parametrize("value", ["true", "false", "2.0", "null", "0"])
def test_a_jsonl_max_tokens_that_is_not_a_positive_integer_is_refused(server, tmp_path, capsys, value):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b", "max_tokens": %s}\n' % value)
    args = parse("--base-url", server.url, "--model", "m", "--dataset", "jsonl", "--jsonl-path", str(prompts))
    assert run_bench(args) == 2  # true was taken as 1 token
    assert f"{prompts}:2: max_tokens must be a positive integer, not {value}" in capsys.readouterr().err
    assert server.posts == []


# --- the initial test request ------------------------------------------------------------------------

def html_page(handler: BaseHTTPRequestHandler, payload: dict) -> None:
    lines = ["<!DOCTYPE html>", "<html>", "<head><title>Not here</title></head>", "<body>"]
    lines += [f"<p>paragraph {i} of a page that is no API at all</p>" for i in range(20)] + ["</body>", "</html>"]
    reply(handler, 404, "\n".join(lines).encode(), "text/html")


def test_an_initial_test_answered_by_a_web_page_is_trimmed_and_says_what_was_expected(server, capsys):
    server.post = html_page
    assert run_bench(parse("--base-url", server.url, "--model", "m", *SMALL)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # once the page's lines, one after another
    line = err.strip()
    assert "POST /v1/completions: HTTP 404: <!DOCTYPE html> <html> <head>" in line
    assert "paragraph 19" not in line and len(line) < 500
    assert "expected an OpenAI-compatible streamed answer" in line and "--base-url" in line
    assert len(server.posts) == 1


def test_an_initial_test_answered_200_with_no_events_says_what_was_expected(server, capsys):
    server.post = lambda handler, payload: reply(handler, 200, b"<html>\n<p>hello</p>\n</html>\n", "text/html")
    assert run_bench(parse("--base-url", server.url, "--model", "m", "--endpoint", "chat", *SMALL)) == 1
    line = capsys.readouterr().err.strip()
    assert "POST /v1/chat/completions: stream ended before [DONE]; expected an OpenAI" in line, line


LONG_REFUSAL = ("This model's maximum context length is 64 tokens. However, you requested 132 tokens (4 in the "
                "messages, 128 in the completion). Please reduce the length of the messages or completion. " * 3)


@pytest.mark.parametrize("status, message, hint, shape", [
    (401, "invalid or missing API key", "; check --api-key", "nested"),
    (404, "The model `mm` does not exist.", "; check --model", "nested"),
    (400, "max_tokens (128) exceeds the model's context of 64 tokens", "", "nested"),
    (400, LONG_REFUSAL, "", "nested"),  # past the 300 characters an error keeps of a body
    (400, "max_tokens is too large", "", "flat"),  # vLLM's older {"object": "error", "message": ...}
])
def test_an_initial_test_refused_by_an_openai_server_gives_its_reason_and_the_flag(server, capsys, status, message,
                                                                                    hint, shape):
    """An OpenAI-compatible server's refusal was followed by advice to check --base-url and
    --endpoint, which were right."""
    error = {"message": message, "type": "invalid_request_error", "code": status}
    body = json.dumps({"error": error} if shape == "nested" else {"object": "error", **error}).encode()
    server.post = lambda handler, payload: reply(handler, status, body, "application/json")
    assert run_bench(parse("--base-url", server.url, "--model", "m", *SMALL)) == 1
    line = capsys.readouterr().err.strip()
    said = " ".join(f"HTTP {status}: {message}".split())
    said = said if len(said) <= 200 else said[:200] + "..."  # one line of 200 characters at most
    assert line.endswith(f"POST /v1/completions: {said}{hint}"), line


def test_a_model_listing_refused_for_its_key_names_the_key(server, capsys):
    """It read '...answered HTTP 401 ...; pass --model, or check --base-url'."""
    body = json.dumps({"error": {"message": "invalid or missing API key", "type": "authentication_error"}}).encode()
    server.answer = lambda handler, method: reply(handler, 401, body, "application/json")
    assert run_bench(parse("--base-url", server.url, *SMALL)) == 1
    err = capsys.readouterr().err
    assert "GET /v1/models answered HTTP 401: invalid or missing API key; check --api-key" in err, err


# --- arguments ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--request-rate", "0"], "--request-rate"),  # once "request rate must be > 0"
    (["--request-rate", "nan"], "--request-rate"),
    (["--burstiness", "0"], "--burstiness"),  # once "burstiness (the gamma shape) ..."
    (["--request-rate", "1e-10", "--burstiness", "1e-300"], "--burstiness"),
    (["--random-range-ratio", "1"], "--random-range-ratio"),  # once "range ratio must be in [0, 1)"
    (["--random-range-ratio", "-0.5"], "--random-range-ratio"),
])
def test_bad_load_values_are_named_by_their_flags(server, capsys, argv, flag):
    assert run_bench(parse("--base-url", server.url, "--model", "m", *SMALL, *argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"oasiskv bench serve: {flag}") or f" {flag} " in err, err
    assert server.posts == []


def test_a_path_for_a_dataset_not_chosen_is_refused(server, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    for argv, flag, dataset in ((["--jsonl-path", str(prompts)], "--jsonl-path", "jsonl"),  # once: random prompts
                                (["--files-dir", str(tmp_path)], "--files-dir", "files"),
                                (["--dataset", "jsonl", "--jsonl-path", str(prompts), "--files-dir", str(tmp_path)],
                                 "--files-dir", "files")):
        assert run_bench(parse("--base-url", server.url, "--model", "m", *SMALL, *argv)) == 2, argv
        err = capsys.readouterr().err
        assert f"{flag} is read only with --dataset {dataset}" in err, err
    assert server.posts == []


# --- Ctrl-C ------------------------------------------------------------------------------------------

def fast_or_slow(server: Server):
    def post(handler: BaseHTTPRequestHandler, payload: dict) -> None:
        if "slow" in payload["prompt"]:
            server.release.wait(30)  # until the test ends
        stream_answer(handler, payload)
    return post


def interrupt_bench(server: Server, tmp_path, prompts: list[str], posts: int, *extra: str) -> tuple[int, str, str]:
    """Runs `oasiskv bench serve` in a process of its own on `prompts`, and sends it SIGINT (what
    Ctrl-C sends) once the server has had `posts` requests and half a second has passed."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    root = Path(oasiskv.__file__).resolve().parents[1]
    command = [sys.executable, "-m", "oasiskv.cluster.cli", "bench", "serve", "--base-url", server.url,
               "--model", "m", "--disable-tqdm", "--dataset", "jsonl", "--jsonl-path", str(path),
               "--num-prompts", str(len(prompts)), "--save-result", "--no-plot", "--result-dir", str(tmp_path),
               "--result-filename", "run.json", *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(root)}, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 60
        while len(server.posts) < posts:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # the fast answers read
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, out, err


def test_ctrl_c_before_the_run_says_so(server, tmp_path):
    server.post = fast_or_slow(server)
    code, out, err = interrupt_bench(server, tmp_path, ["slow", "fast"], 1)  # during the initial test
    assert code == 130 and err.strip() == "oasiskv bench serve: interrupted", err  # once: nothing at all
    assert not (tmp_path / "run.json").exists()


def test_ctrl_c_mid_run_reports_and_saves_the_partial_results(server, tmp_path):
    server.post = fast_or_slow(server)
    code, out, err = interrupt_bench(server, tmp_path, ["fast", "slow", "fast", "slow"], 4, "--skip-initial-test")
    # it exited 130 having printed and saved nothing
    assert code == 130, err
    assert "interrupted after" in err and "2 of 4 requests ended, 2 cancelled in flight, 0 not sent" in err, err
    assert "Traceback" not in err
    assert "PARTIAL: the run was interrupted" in out and f"result: {tmp_path / 'run.json'}" in out
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["partial"] is True
    assert record["summary"]["completed"] == 2 and record["summary"]["errors"] == {"cancelled": 2}
    assert [r["success"] for r in record["requests"]] == [True, False, True, False]
    assert record["requests"][1]["error"] == "cancelled: interrupted"


def test_a_cancelled_run_passes_the_cancellation_on_with_its_results(server):
    server.post = fast_or_slow(server)
    requests = [BenchRequest("fast", 1, 2), BenchRequest("slow", 1, 2), BenchRequest("fast", 1, 2)]
    config = RunConfig(base_url=server.url, api_key=None, options=RequestOptions(model="m"))

    async def main():
        run = asyncio.create_task(run_requests(requests, np.array([0.0, 0.0, 60.0]), config))
        while len(server.posts) < 2:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        run.cancel()
        with pytest.raises(RunInterrupted) as stopped:
            await run
        assert run.cancelled()  # still a cancellation to whoever awaits the task
        return stopped.value

    stop = asyncio.run(main())
    first, slow, unsent = stop.results
    assert first.success and slow.sent and slow.error == "cancelled: interrupted"
    assert not unsent.sent and unsent.error == "not sent: interrupted"
    assert 0.3 <= stop.duration < 30
    assert len(server.posts) == 2


def test_requests_waiting_for_a_concurrency_slot_when_cut_short_were_not_sent(server):
    """They counted as cancelled in flight, so failed, though the server never saw them."""
    server.post = fast_or_slow(server)
    requests = [BenchRequest("slow", 1, 2)] + [BenchRequest("fast", 1, 2)] * 4
    config = RunConfig(base_url=server.url, api_key=None, options=RequestOptions(model="m"), max_concurrency=1)

    async def main():
        run = asyncio.create_task(run_requests(requests, np.zeros(len(requests)), config))
        while not server.posts:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        run.cancel()
        with pytest.raises(RunInterrupted) as stopped:
            await run
        return stopped.value.results

    slow, *queued = asyncio.run(main())
    assert slow.sent and slow.error == "cancelled: interrupted"
    assert [(r.sent, r.error) for r in queued] == [(False, "not sent: interrupted")] * 4
    assert len(server.posts) == 1
