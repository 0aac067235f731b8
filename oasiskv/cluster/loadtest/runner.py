"""Runs the benchmark: requests go out on the arrival schedule, at most `max_concurrency` at
a time, and everything stops at `max_duration` (requests not yet sent are not sent, those in
flight are cancelled). Only `base_url` is contacted, and redirects are not followed."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from .datasets import BenchRequest
from .sse import RequestOptions, RequestResult, send_request

# Sockets besides the connections: stdio, the event loop's own, a tokenizer's files.
_SPARE_FILE_DESCRIPTORS = 64
_CONNECT_TIMEOUT_S = 10.0  # an address that never answers fails fast, not after --request-timeout


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    api_key: str | None
    options: RequestOptions
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0    # for each whole request; inf: no limit
    max_duration_s: float = 3600.0


class RunInterrupted(asyncio.CancelledError):
    """The run was cancelled (Ctrl-C) before its end; still a cancellation, carrying the results
    so far (requests in flight cancelled, those not yet sent not sent) and the time it ran."""

    def __init__(self, results: list[RequestResult], duration: float):
        super().__init__("the run was interrupted")
        self.results, self.duration = results, duration


def make_client(config: RunConfig, connections: int | None) -> httpx.AsyncClient:
    """`connections` None: no limit, so no request ever waits for a pooled connection."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # send_request bounds each whole request; httpx's limits apply to each read alone, so at the
    # same value they never fire first and only guard the other calls (listing the models).
    limit = config.request_timeout_s if math.isfinite(config.request_timeout_s) else None
    return httpx.AsyncClient(
        base_url=config.base_url,
        headers=headers,
        follow_redirects=False,
        timeout=httpx.Timeout(limit, connect=_CONNECT_TIMEOUT_S if limit is None else min(_CONNECT_TIMEOUT_S, limit)),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def allow_open_files(needed: int) -> None:
    """Raise this process's soft limit on open files towards `needed` (up to the hard limit):
    with the common default of 1024, a run with more requests in flight would fail to
    connect."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        pass  # the run goes on; the requests that cannot connect are counted as failed


async def run_requests(requests: Sequence[BenchRequest], offsets: np.ndarray, config: RunConfig,
                       on_done: Callable[[RequestResult], None] = lambda r: None,
                       ) -> tuple[list[RequestResult], float]:
    """Returns one result per request, in request order, and the benchmark's duration; cancelled,
    raises RunInterrupted with the same."""
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    # The pool is never what limits concurrency: a request waiting there for a connection
    # would count the wait in its TTFT, and the report would name a concurrency it did not have.
    connections = min(len(requests), config.max_concurrency) if config.max_concurrency else None
    allow_open_files((connections or len(requests)) + _SPARE_FILE_DESCRIPTORS)
    results: dict[int, RequestResult] = {}
    # Sent: past its --max-concurrency slot. A request still waiting for one when the run was cut
    # short was never sent, though its task had begun.
    sent_indexes: set[int] = set()

    async with make_client(config, connections) as client:
        clock_zero = time.perf_counter()
        deadline = clock_zero + config.max_duration_s

        async def send(index: int, request: BenchRequest) -> RequestResult:
            try:
                return await send_request(client, index, request, config.options, clock_zero,
                                          config.request_timeout_s)
            except Exception as exc:  # a client bug: reported against its request, not lost with the task
                # (a task that died without a result read as cancelled by --max-duration)
                return RequestResult(index=index, prompt_len=request.prompt_len, max_tokens=request.max_tokens,
                                     error=f"client error: {type(exc).__name__}: {exc}")

        async def one(index: int, request: BenchRequest) -> None:
            async with slots or contextlib.nullcontext():
                sent_indexes.add(index)
                result = await send(index, request)
            results[index] = result
            on_done(result)

        tasks: list[asyncio.Task] = []
        interrupted = False
        try:
            for index, (request, offset) in enumerate(zip(requests, offsets)):
                wait = min(clock_zero + float(offset), deadline) - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                if time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.create_task(one(index, request)))
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        except asyncio.CancelledError:
            # Cancelled from outside (Ctrl-C): end the requests in flight, keep what finished, and
            # pass the cancellation on with the results (RunInterrupted) once the client is shut.
            interrupted = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - clock_zero

    why = "interrupted" if interrupted else "--max-duration reached"
    ordered = []
    for index, request in enumerate(requests):
        if index not in results:
            sent = index in sent_indexes
            results[index] = RequestResult(
                index=index, prompt_len=request.prompt_len, max_tokens=request.max_tokens, sent=sent,
                error=f"cancelled: {why}" if sent else f"not sent: {why}")
            if not interrupted:
                on_done(results[index])
        ordered.append(results[index])
    if interrupted:
        raise RunInterrupted(ordered, duration)
    return ordered, duration
