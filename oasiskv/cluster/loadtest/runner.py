"""Runs the benchmark: requests go out on the arrival schedule, at most `max_concurrency` at
a time, and everything stops at `max_duration` (requests not yet sent are not sent, those in
flight are cancelled). Only `base_url` is contacted, and redirects are not followed."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from .datasets import BenchRequest
from .sse import RequestOptions, RequestResult, send_request


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    api_key: str | None
    options: RequestOptions
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    max_duration_s: float = 3600.0


def make_client(config: RunConfig, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(
        base_url=config.base_url,
        headers=headers,
        follow_redirects=False,
        timeout=httpx.Timeout(config.request_timeout_s, connect=min(10.0, config.request_timeout_s)),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


async def run_requests(requests: Sequence[BenchRequest], offsets: np.ndarray, config: RunConfig,
                       on_done: Callable[[RequestResult], None] = lambda r: None,
                       ) -> tuple[list[RequestResult], float]:
    """Returns one result per request, in request order, and the benchmark's duration."""
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    connections = min(len(requests), config.max_concurrency or len(requests), 1024) or 1
    results: dict[int, RequestResult] = {}

    async with make_client(config, connections) as client:
        clock_zero = time.perf_counter()
        deadline = clock_zero + config.max_duration_s

        async def one(index: int, request: BenchRequest) -> None:
            if slots is not None:
                async with slots:
                    result = await send_request(client, index, request, config.options, clock_zero)
            else:
                result = await send_request(client, index, request, config.options, clock_zero)
            results[index] = result
            on_done(result)

        tasks = []
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
        duration = time.perf_counter() - clock_zero

    ordered = []
    for index, request in enumerate(requests):
        if index not in results:
            sent = index < len(tasks)
            results[index] = RequestResult(
                index=index, prompt_len=request.prompt_len, max_tokens=request.max_tokens,
                error="cancelled: --max-duration reached" if sent else "not sent: --max-duration reached")
            on_done(results[index])
        ordered.append(results[index])
    return ordered, duration
