"""`oasiskv serve` on SIGTERM: requests in flight get --shutdown-grace-s, then are ended with a
503 'shutting down' (a stream: an error event and [DONE]) and the process exits. Uvicorn alone
waited for every open stream, so under Kubernetes the head pod was killed before its lifespan
could shut the Ray actors down; with uvicorn's limit alone the streams were cut with no end, a
non-streamed request got a bare-text 500, and their aborts started a new local Ray at exit."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from ..conftest import DEFAULT_MODEL

GRACE_S = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("serve did not become healthy")


def test_sigterm_ends_requests_in_flight_with_a_503_after_the_grace_period_and_exits():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "oasiskv.cluster.cli", "serve", "--port", str(port), "--threads-per-worker", "1",
         "--shutdown-grace-s", str(GRACE_S)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_healthy(url, proc)
        chunks: list[str] = []
        first_chunk = threading.Event()
        ended = threading.Event()
        whole: list[httpx.Response] = []
        # About 8,000 tokens: minutes of decoding, far past the grace period.
        body = {"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": True,
                "temperature": 0}

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as response:
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            chunks.append(line)
                            first_chunk.set()
            except httpx.HTTPError:
                pass  # the server closing the connection mid-stream
            finally:
                ended.set()

        def not_streamed() -> None:
            with contextlib.suppress(httpx.HTTPError):
                whole.append(httpx.post(f"{url}/v1/completions", json=body, timeout=300))

        threading.Thread(target=stream, daemon=True).start()
        other = threading.Thread(target=not_streamed, daemon=True)
        other.start()
        assert first_chunk.wait(120), "no token streamed"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_S + 60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve still running {GRACE_S + 60} s after SIGTERM with a {GRACE_S} s grace")
        exited_after = time.monotonic() - signalled
        stderr = proc.stderr.read()
        # Uvicorn raises the SIGTERM again once it has shut down, and Ray's driver turns it into exit(15).
        assert proc.returncode in (0, 15, -signal.SIGTERM), stderr[-3000:]
        assert ended.wait(10), "the client's stream did not end when the server did"
        other.join(10)
        assert exited_after >= GRACE_S - 2.5  # the requests were given most of the grace, not cut at once
        # The stream ends as any failed stream does: an error event, then [DONE].
        assert chunks[-1] == "data: [DONE]" and "the server is shutting down" in chunks[-2], chunks[-3:]
        assert whole and whole[0].status_code == 503, whole and whole[0].text
        assert "the server is shutting down" in whole[0].json()["error"]["message"]
        assert "timeout graceful shutdown exceeded" not in stderr  # nothing was left for uvicorn to cancel
        assert "cluster shut down" in stderr  # the lifespan ran: the decode worker freed its requests
        assert stderr.count("Started a local Ray instance") <= 1, stderr[-3000:]  # no second Ray at exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
