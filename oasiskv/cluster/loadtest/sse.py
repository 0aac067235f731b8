"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

As in `vllm bench serve`, every chunk that carries a choice is a token event, even when its
text is empty (a special token, or an end-of-sequence first token): the first one gives the time
to first token, the gaps between later ones the inter-token latencies, and the last one the end
of the request (a usage-only chunk and `[DONE]` after it carry no token). A chunk may hold
several tokens when the server decodes speculatively, as OasisKV does; like vLLM, a chunk is one
ITL sample. The one chunk that is not a token event is chat's opening role announcement.

Output token counts come from the `usage` the server reports when asked
(`stream_options.include_usage`). Without it the generated text is kept, and the caller
re-tokenizes it when it has a tokenizer (`count_unreported_output_tokens`); otherwise the count
is the number of token chunks, a lower bound.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx

from .datasets import BenchRequest

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ERROR_BODY_CHARS = 300
_EVENT_QUOTE_CHARS = 80


def openai_error_message(body: str | dict) -> str | None:
    """The message of an OpenAI-style error answer, or None if `body` is not one: OpenAI's and
    vLLM's {"error": {"message": ...}} (or {"error": "..."}), and vLLM's older flat
    {"object": "error", "message": ...}."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error
    if body.get("object") == "error" and isinstance(body.get("message"), str):
        return body["message"]
    return None


@dataclass
class RequestResult:
    index: int
    prompt_len: int                 # from the dataset; replaced by usage.prompt_tokens if reported
    max_tokens: int
    success: bool = False
    error: str = ""
    http_status: int = 0
    server_message: str | None = None  # an OpenAI-compatible server's own reason for an error
    sent: bool = True               # False: the run ended (--max-duration, Ctrl-C) before it went out
    start: float = math.nan         # seconds since the benchmark started
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds since the benchmark started
    output_tokens: int = 0
    usage_reported: bool = False
    output_tokens_source: str = ""  # "usage", "tokenizer" or "chunks" (a lower bound)
    finish_reason: str | None = None
    generated_text: str = ""

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


class MalformedEvent(ValueError):
    """A server-sent event that is JSON but not shaped like an OpenAI stream chunk."""


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


def _quote(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= _EVENT_QUOTE_CHARS else text[:_EVENT_QUOTE_CHARS] + "..."


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_chunk(chunk, endpoint: str) -> None:
    """Raises MalformedEvent unless `chunk` has the shape the timing below relies on."""
    if not isinstance(chunk, dict):
        raise MalformedEvent(f"expected a JSON object, got {_quote(chunk)}")
    choices = chunk.get("choices")
    # null is read as no choices, as vLLM reads it; any other non-list is not a chunk
    if choices is not None and not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
        raise MalformedEvent(f'"choices" must be a list of objects, got {_quote(choices)}')
    for choice in choices or []:
        if endpoint == "chat":
            delta = choice.get("delta")
            if delta is not None and not isinstance(delta, dict):
                raise MalformedEvent(f'"delta" must be an object, got {_quote(delta)}')
            texts = {key: (delta or {}).get(key) for key in ("content", "reasoning_content")}
        else:
            texts = {"text": choice.get("text")}
        for key, text in texts.items():
            if text is not None and not isinstance(text, str):
                raise MalformedEvent(f'"{key}" must be a string, got {_quote(text)}')
    usage = chunk.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise MalformedEvent(f'"usage" must be an object, got {_quote(usage)}')
        for key in ("prompt_tokens", "completion_tokens"):
            if usage.get(key) is not None and not _is_count(usage[key]):
                raise MalformedEvent(f'"usage.{key}" must be a count, got {_quote(usage[key])}')


def _choice_tokens(choice: dict, endpoint: str) -> tuple[bool, str]:
    """(whether the choice is a token event, its text)."""
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        # Chat streams open with a chunk that only names the assistant's role, sent before any
        # token exists; timing it would make TTFT the server's acknowledgement.
        role_only = "role" in delta and not text and not choice.get("finish_reason")
        return not role_only, text
    return True, choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, index: int, request: BenchRequest,
                       options: RequestOptions, clock_zero: float,
                       timeout_s: float | None = None) -> RequestResult:
    """Send one streamed request; never raises for server or network errors, malformed events
    or running past `timeout_s` (seconds for the whole request, from sending it to its last
    byte): they are failed results."""
    result = RequestResult(index=index, prompt_len=request.prompt_len, max_tokens=request.max_tokens)
    started = time.perf_counter()
    result.start = started - clock_zero
    chunks, last, done = 0, started, False
    text_parts: list[str] = []
    total_limit = timeout_s if timeout_s is not None and math.isfinite(timeout_s) else None
    try:
        async with asyncio.timeout(total_limit):
            async with client.stream("POST", ENDPOINT_PATHS[options.endpoint],
                                     json=build_payload(request, options)) as response:
                result.http_status = response.status_code
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {body[:_ERROR_BODY_CHARS]}"
                    result.server_message = openai_error_message(body)
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, `:` keep-alive comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if isinstance(chunk, dict) and chunk.get("error") is not None:
                        result.server_message = openai_error_message(chunk) or str(chunk["error"])
                        result.error = "stream error: " + result.server_message
                        return result
                    _check_chunk(chunk, options.endpoint)
                    now = time.perf_counter()
                    token_event = False
                    for choice in chunk.get("choices") or []:
                        is_token, text = _choice_tokens(choice, options.endpoint)
                        token_event = token_event or is_token
                        text_parts.append(text)
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
                    if token_event:
                        if chunks == 0:
                            result.ttft = now - started
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
                        result.chunk_times.append(now - clock_zero)
                    usage = chunk.get("usage") or {}
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_len = usage["prompt_tokens"]
                    if usage.get("completion_tokens") is not None:
                        result.usage_reported = True
                        result.output_tokens = usage["completion_tokens"]
    except TimeoutError:
        result.error = f"request timeout: not complete after {timeout_s:g} s (--request-timeout)"
        return result
    except MalformedEvent as exc:
        result.error = f"bad SSE event: {exc}"
        return result
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:_ERROR_BODY_CHARS]
        return result
    result.generated_text = "".join(text_parts)
    if not done and result.finish_reason is None:
        result.error = "stream ended before [DONE]"
        return result
    if chunks == 0:
        result.error = "no token: the stream ended without a chunk carrying a choice"
        return result
    result.e2e = last - started
    if result.usage_reported:
        result.output_tokens_source = "usage"
    else:
        result.output_tokens, result.output_tokens_source = chunks, "chunks"
    result.success = True
    return result


def count_unreported_output_tokens(results: Iterable[RequestResult], count: Callable[[str], int]) -> None:
    """Re-tokenize the text of successful requests whose server reported no usage, as vLLM
    does (`count` should leave special tokens out); a chunk can hold several tokens, so the
    chunk count undercounts speculative decoding's output."""
    for result in results:
        if result.success and not result.usage_reported:
            result.output_tokens = count(result.generated_text)
            result.output_tokens_source = "tokenizer"
