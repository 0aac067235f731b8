"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

A chunk that carries text is a token event: the first one gives the time to first token, the
gaps between later ones the inter-token latencies (a chunk may hold several tokens when the
server decodes speculatively, as OasisKV does; like `vllm bench serve`, a chunk is one ITL
sample). Token counts come from the `usage` the server reports when asked
(`stream_options.include_usage`), otherwise from the number of chunks.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import httpx

from .datasets import BenchRequest

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ERROR_BODY_CHARS = 300


@dataclass
class RequestResult:
    index: int
    prompt_len: int                 # from the dataset; replaced by usage.prompt_tokens if reported
    max_tokens: int
    success: bool = False
    error: str = ""
    http_status: int = 0
    start: float = math.nan         # seconds since the benchmark started
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds since the benchmark started
    output_tokens: int = 0
    usage_reported: bool = False
    finish_reason: str | None = None

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; none (NaN) for a one-token answer, which
        has no such token, so TPOT's statistics leave it out, as vLLM's do (it was 0, and a
        run of short answers reported a TPOT of a fraction of a millisecond)."""
        if not self.success or math.isnan(self.ttft) or self.output_tokens <= 1:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class RequestOptions:
    endpoint: str = "completions"
    model: str = ""
    temperature: float = 0.0
    ignore_eos: bool = False
    stream_usage: bool = True


def build_payload(request: BenchRequest, options: RequestOptions) -> dict:
    payload: dict = {"model": options.model, "max_tokens": request.max_tokens,
                     "temperature": options.temperature, "stream": True}
    if options.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    if options.stream_usage:
        payload["stream_options"] = {"include_usage": True}
    if options.ignore_eos:  # vLLM and OasisKV extension: generate exactly max_tokens
        payload["ignore_eos"] = True
    return payload


def _chunk_text(choice: dict, endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, index: int, request: BenchRequest,
                       options: RequestOptions, clock_zero: float) -> RequestResult:
    """Send one streamed request; never raises for server or network errors (they are results)."""
    result = RequestResult(index=index, prompt_len=request.prompt_len, max_tokens=request.max_tokens)
    started = time.perf_counter()
    result.start = started - clock_zero
    chunks, last, done = 0, started, False
    try:
        async with client.stream("POST", ENDPOINT_PATHS[options.endpoint],
                                 json=build_payload(request, options)) as response:
            result.http_status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:_ERROR_BODY_CHARS]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, `:` keep-alive comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    result.error = "stream error: " + (error.get("message", str(error)) if isinstance(error, dict) else str(error))
                    return result
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    if _chunk_text(choice, options.endpoint):
                        if chunks == 0:
                            result.ttft = now - started
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
                        result.chunk_times.append(now - clock_zero)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    result.usage_reported = True
                    result.prompt_len = int(usage.get("prompt_tokens", result.prompt_len))
                    result.output_tokens = int(usage.get("completion_tokens", 0))
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:_ERROR_BODY_CHARS]
        return result
    result.e2e = time.perf_counter() - started
    if not done and result.finish_reason is None:
        result.error = "stream ended before [DONE]"
        return result
    if not result.usage_reported:
        result.output_tokens = chunks
    result.success = True
    return result
