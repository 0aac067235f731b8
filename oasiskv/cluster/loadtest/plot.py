"""The benchmark's PNG: latency CDFs (TTFT, E2E; TPOT, ITL) and throughput over time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .sse import RequestResult


def _cdf(axis, values_s: Sequence[float], label: str) -> None:
    ms = np.sort([v * 1000.0 for v in values_s if not math.isnan(v)])
    if len(ms):
        axis.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=f"{label} (n={len(ms)})")


def save_plot(results: Sequence[RequestResult], timeline: dict, title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    figure, (requests_ax, tokens_ax, time_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    _cdf(requests_ax, [r.ttft for r in ok], "TTFT")
    _cdf(requests_ax, [r.e2e for r in ok], "E2E")
    _cdf(tokens_ax, [r.tpot for r in ok], "TPOT")
    _cdf(tokens_ax, [gap for r in ok for gap in r.itl], "ITL")
    for axis, name in ((requests_ax, "Request latency"), (tokens_ax, "Token latency")):
        axis.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(loc="lower right")
    time_ax.plot(timeline["time_s"], timeline["output_tokens_per_s"], label="output tokens/s")
    time_ax.set(title="Throughput over time", xlabel="s since start", ylabel="output tokens/s")
    time_ax.grid(alpha=0.3)
    requests_per_s = time_ax.twinx()
    requests_per_s.plot(timeline["time_s"], timeline["requests_per_s"], color="tab:orange",
                        label="completed requests/s")
    requests_per_s.set_ylabel("completed requests/s")
    handles = time_ax.get_legend_handles_labels()[0] + requests_per_s.get_legend_handles_labels()[0]
    time_ax.legend(handles, [h.get_label() for h in handles], loc="upper right")
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
