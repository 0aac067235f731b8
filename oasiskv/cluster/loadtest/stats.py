"""From per-request results to the benchmark's numbers: throughput, goodput and latency
percentiles (definitions as in `vllm bench serve`, so results compare directly)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from .sse import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2e")
GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}  # e2el: vLLM's name


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation); NaN for no values."""
    finite = [v for v in values if not math.isnan(v)]
    return float(np.percentile(finite, q)) if finite else math.nan


def describe_ms(values_s: Iterable[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and the requested percentiles of durations, in milliseconds."""
    ms = [v * 1000.0 for v in values_s if not math.isnan(v)]
    out = {
        "mean": float(np.mean(ms)) if ms else math.nan,
        "median": percentile(ms, 50),
        "std": float(np.std(ms)) if ms else math.nan,
    }
    for q in percentiles:
        out[f"p{q:g}"] = percentile(ms, q)
    return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50 e2e:10000` (milliseconds) -> {"ttft": 500.0, ...}."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        key = GOODPUT_KEYS.get(name.strip().lower())
        if not sep or key is None:
            raise ValueError(f"goodput SLO {item!r}: use ttft:MS, tpot:MS or e2e:MS")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not limit > 0:
            raise ValueError(f"goodput SLO {item!r}: must be > 0 ms")
        slos[key] = limit
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    if not result.success:
        return False
    # An answer of at most one token has no TPOT and meets any TPOT SLO (vLLM counts it as 0
    # there): one whose only chunk is an end-of-sequence with no text has 0 tokens re-tokenized.
    tpot = 0.0 if result.output_tokens <= 1 else result.tpot
    measured = {"ttft": result.ttft, "tpot": tpot, "e2e": result.e2e}
    return all(not math.isnan(measured[k]) and measured[k] * 1000.0 <= limit for k, limit in slos.items())


def timeline(results: Sequence[RequestResult], duration: float, bin_s: float = 1.0) -> dict[str, list[float]]:
    """Output tokens and completed requests per time bin, as counts and per second (the last
    bin is usually partial and is divided by its real width). A chunk's tokens are spread from
    the request's reported total, so multi-token chunks (speculative decoding) count fully."""
    bins = max(1, math.ceil(duration / bin_s)) if duration > 0 else 1
    tokens, completed = np.zeros(bins), np.zeros(bins)
    for r in results:
        if not r.success:
            continue
        per_chunk = r.output_tokens / len(r.chunk_times) if r.chunk_times else 0.0
        for t in r.chunk_times:
            tokens[min(bins - 1, int(t // bin_s))] += per_chunk
        completed[min(bins - 1, int((r.start + r.e2e) // bin_s))] += 1
    widths = np.full(bins, bin_s)
    if duration > 0:
        widths[-1] = max(duration - (bins - 1) * bin_s, 1e-9)
    return {"time_s": [i * bin_s for i in range(bins)],
            "output_tokens": list(tokens), "completed_requests": list(completed),
            "output_tokens_per_s": list(tokens / widths), "requests_per_s": list(completed / widths)}


def summarize(results: Sequence[RequestResult], duration: float, slos: dict[str, float],
              percentiles: Sequence[float]) -> dict:
    ok = [r for r in results if r.success]
    # A request --max-duration left unsent never reached the server: not a failure of it.
    failed = [r for r in results if r.sent and not r.success]
    not_sent = sum(not r.sent for r in results)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    summary = {
        "completed": len(ok),
        "failed": len(failed),
        "not_sent": not_sent,
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "request_goodput": rate(sum(meets_slos(r, slos) for r in ok)) if slos else None,
        "goodput_slos_ms": slos,
        "usage_reported": bool(ok) and all(r.usage_reported for r in ok),
        "output_tokens_source": _output_tokens_source(ok),
        "errors": dict(Counter(_error_kind(r.error) for r in failed).most_common(10)),
    }
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    for metric in METRICS:
        for stat, value in describe_ms(samples[metric], percentiles).items():
            summary[f"{stat}_{metric}_ms"] = value
    return summary


def _output_tokens_source(ok: Sequence[RequestResult]) -> str | None:
    """How the output tokens were counted: "usage", "tokenizer" or "chunks" (a lower bound),
    the least exact one when requests differ; None without successful requests."""
    sources = {r.output_tokens_source for r in ok}
    return next((s for s in ("chunks", "tokenizer", "usage") if s in sources), None)


def _error_kind(error: str) -> str:
    """Group errors for the report: the HTTP status or the exception name, not every message."""
    return error.split(":", 1)[0][:80]
