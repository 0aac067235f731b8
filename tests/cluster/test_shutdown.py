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
import pytest

from ..conftest import DEFAULT_MODEL, default_sigint

GRACE_S = 3
# After the requests end, the cluster's shutdown may wait 30 s for each decode worker and 10 s
# for each store that does not answer (`launcher.shutdown`): ample on a slow, shared machine.
EXIT_S = 150


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


class _Requests:
    """A streamed and a non-streamed request of about 8,000 tokens (minutes of decoding, far past
    any grace here), running until the server ends them."""

    def __init__(self, url: str):
        self.chunks: list[str] = []
        self.whole: list[httpx.Response] = []
        self.first_chunk = threading.Event()
        self.ended = threading.Event()
        body = {"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": True,
                "temperature": 0}

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as response:
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            self.chunks.append(line)
                            self.first_chunk.set()
            except httpx.HTTPError:
                pass  # the server closing the connection mid-stream
            finally:
                self.ended.set()

        def not_streamed() -> None:
            with contextlib.suppress(httpx.HTTPError):
                self.whole.append(httpx.post(f"{url}/v1/completions", json=body, timeout=300))

        threading.Thread(target=stream, daemon=True).start()
        self._other = threading.Thread(target=not_streamed, daemon=True)
        self._other.start()
        assert self.first_chunk.wait(120), "no token streamed"

    def assert_ended_as_shutting_down(self) -> None:
        assert self.ended.wait(10), "the client's stream did not end when the server did"
        self._other.join(10)
        # The stream ends as any failed stream does: an error event, then [DONE].
        assert self.chunks[-1] == "data: [DONE]" and "the server is shutting down" in self.chunks[-2], self.chunks[-3:]
        assert self.whole and self.whole[0].status_code == 503, self.whole and self.whole[0].text
        assert "the server is shutting down" in self.whole[0].json()["error"]["message"]


class _Log:
    """The server's stderr, read as it is written: a pipe read only at exit can fill (64 KiB)
    and block the server at its next log line; and a test can wait for a line."""

    def __init__(self, stream):
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: any(text in line for line in self._lines), timeout_s)

    def text(self, to_the_end: bool = False) -> str:
        if to_the_end:  # the server has exited: the pipe closes
            self._reader.join(10)
        with self._changed:
            return "".join(self._lines)


@contextlib.contextmanager
def _serve(grace_s: float, **popen):
    """`oasiskv serve` in a process of its own, healthy; killed if the test left it running."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "oasiskv.cluster.cli", "serve", "--port", str(port), "--threads-per-worker", "1",
         "--shutdown-grace-s", str(grace_s)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen,
    )
    log = _Log(proc.stderr)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_exit(proc: subprocess.Popen, log: _Log, timeout_s: float, what: str) -> str:
    """The server's whole stderr once it has exited; on a timeout, what it had logged by then."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"serve still running {timeout_s:.0f} s after {what}; its log:\n"
                             + log.text(to_the_end=True)[-4000:])
    return log.text(to_the_end=True)


def _assert_shut_down_cleanly(stderr: str) -> None:
    assert "timeout graceful shutdown exceeded" not in stderr  # nothing was left for uvicorn to cancel
    assert "cluster shut down" in stderr  # the lifespan ran: the decode worker freed its requests
    assert stderr.count("Started a local Ray instance") <= 1, stderr[-3000:]  # no second Ray at exit
    assert "Traceback" not in stderr, stderr[-3000:]


def test_sigterm_ends_requests_in_flight_with_a_503_after_the_grace_period_and_exits():
    with _serve(GRACE_S) as (proc, url, log):
        requests = _Requests(url)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stderr = _wait_exit(proc, log, GRACE_S + EXIT_S, f"SIGTERM with a {GRACE_S} s grace")
        exited_after = time.monotonic() - signalled
        # Uvicorn raises the SIGTERM again once it has shut down, and Ray's driver turns it into exit(15).
        assert proc.returncode in (0, 15, -signal.SIGTERM), stderr[-3000:]
        requests.assert_ended_as_shutting_down()
        assert exited_after >= GRACE_S - 2.5  # the requests were given most of the grace, not cut at once
        _assert_shut_down_cleanly(stderr)


@pytest.mark.slow  # in CI's slow step: keeps the default suite well under 25 minutes
def test_a_second_ctrl_c_ends_the_requests_at_once_and_shuts_the_cluster_down():
    """uvicorn's force quit on a second Ctrl-C skipped the lifespan: asyncio's exit logged
    tracebacks, and the aborts of the requests it cancelled started a new local Ray."""
    grace_s = 300
    with _serve(grace_s, preexec_fn=default_sigint) as (proc, url, log):
        requests = _Requests(url)
        proc.send_signal(signal.SIGINT)
        # Python runs a signal's handler once for any number of that signal that arrived before
        # it ran: a second Ctrl-C sent before the server took the first would be lost in it.
        assert log.wait_for("Shutting down", 60), log.text()[-3000:]
        time.sleep(1.0)  # the first Ctrl-C would let the requests run on for the whole grace
        assert proc.poll() is None and not requests.ended.is_set()
        proc.send_signal(signal.SIGINT)
        assert requests.ended.wait(30), f"a second Ctrl-C left the stream running; the log:\n{log.text()[-3000:]}"
        stderr = _wait_exit(proc, log, EXIT_S, f"a second Ctrl-C (grace {grace_s} s)")
        assert proc.returncode == 130, stderr[-3000:]
        requests.assert_ended_as_shutting_down()
        assert "ending the requests in flight now" in stderr
        _assert_shut_down_cleanly(stderr)
