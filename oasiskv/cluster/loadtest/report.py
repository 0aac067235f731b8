"""The benchmark report: a text table in the layout of `vllm bench serve`, and the JSON record
`--save-result` writes (configuration, summary, the throughput timeline, per-request detail)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .sse import RequestResult

WIDTH = 50
SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2e", "End-to-end Latency", "E2E"),
)


def _line(label: str, value, fmt: str = "{:<40} {:<10.2f}") -> str:
    if isinstance(value, float) and math.isnan(value):
        return f"{label:<40} {'n/a':<10}"
    return fmt.format(label, value)


def format_report(summary: dict, config: dict, partial: bool = False) -> str:
    """`partial`: the run was interrupted (Ctrl-C) before its end."""
    rate = config["request_rate"]
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="="),
        *(["PARTIAL: the run was interrupted (Ctrl-C) before its end"] if partial else []),
        _line("Endpoint:", f"{config['base_url']} ({config['endpoint']})", "{:<40} {}"),
        _line("Traffic request rate:", "inf" if math.isinf(rate) else f"{rate:g}", "{:<40} {}"),
        _line("Burstiness factor:", config["burstiness"], "{:<40} {:g}"),
        _line("Max request concurrency:", config["max_concurrency"] or "unlimited", "{:<40} {}"),
        _line("Successful requests:", summary["completed"], "{:<40} {:<10}"),
        _line("Failed requests:", summary["failed"], "{:<40} {:<10}"),
    ]
    if summary["not_sent"]:
        label = "Not sent (interrupted):" if partial else "Not sent (--max-duration reached):"
        lines.append(_line(label, summary["not_sent"], "{:<40} {:<10}"))
    lines += [
        _line("Benchmark duration (s):", summary["duration_s"]),
        _line("Total input tokens:", summary["total_input_tokens"], "{:<40} {:<10}"),
        _line("Total generated tokens:", summary["total_output_tokens"], "{:<40} {:<10}"),
        _line("Request throughput (req/s):", summary["request_throughput"]),
        _line("Output token throughput (tok/s):", summary["output_throughput"]),
        _line("Total Token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    if summary["request_goodput"] is not None:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in summary["goodput_slos_ms"].items())
        lines.append(_line("Request goodput (req/s):", summary["request_goodput"]))
        lines.append(_line("  SLOs:", slos, "{:<40} {}"))
    source = summary["output_tokens_source"]
    if source == "tokenizer":
        lines.append("(output tokens re-tokenized with --tokenizer: the server reported no usage)")
    elif source == "chunks":
        lines.append("(output tokens counted one per chunk, a lower bound: the server reported no usage; "
                     "pass --tokenizer to count them)")
    for key, title, short in SECTIONS:
        lines.append("{s:{c}^{n}}".format(s=title, n=WIDTH, c="-"))
        lines.append(_line(f"Mean {short} (ms):", summary[f"mean_{key}_ms"]))
        lines.append(_line(f"Median {short} (ms):", summary[f"median_{key}_ms"]))
        # p50 is the median, already shown
        for name in (k for k in summary if k.startswith("p") and k.endswith(f"_{key}_ms") and k != f"p50_{key}_ms"):
            lines.append(_line(f"P{name.split('_', 1)[0][1:]} {short} (ms):", summary[name]))
    if summary["errors"]:
        lines.append("{s:{c}^{n}}".format(s="Errors", n=WIDTH, c="-"))
        lines += [f"{count:>6}  {kind}" for kind, count in summary["errors"].items()]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _clean(value):
    """JSON has no NaN/inf: write null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def result_record(summary: dict, config: dict, timeline: dict, results: Sequence[RequestResult],
                  partial: bool = False) -> dict:
    """`partial`: the run was interrupted (Ctrl-C); requests it cut short are failed ("cancelled:
    interrupted") or not sent ("not sent: interrupted")."""
    requests = []
    for r in results:
        item = asdict(r)
        del item["generated_text"]  # the record keeps measurements, not the model's answers
        item["tpot"] = r.tpot
        requests.append(item)
    return _clean({"partial": partial, "config": config, "summary": summary, "timeline": timeline,
                   "requests": requests})


def record_json(record: dict) -> str:
    """A result record as saved: indented JSON, one final newline."""
    return json.dumps(record, indent=2) + "\n"


def save_json(record: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record_json(record))
    return path
