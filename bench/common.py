"""Helpers shared by the benchmarks: real input text, result files, mode variants and a slow link."""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

# Real code nobody here wrote, present on every machine: the Python standard library.
STDLIB_SOURCES = ("_pydecimal.py", "typing.py", "argparse.py", "inspect.py", "subprocess.py")


def stdlib_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((stdlib / name).read_text() for name in STDLIB_SOURCES)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls of fn()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def percentile(values, q: int) -> float | None:
    """The q-th percentile (inclusive method) of the values that are not None; None if none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    if q == 50:
        return statistics.median(values)
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def latency_summary(requests: list[dict]) -> dict:
    """Throughput and TTFT / TPOT / E2E percentiles of one load (bench/pd_throughput.py's
    per-request records: sent_s, done_s, completion_tokens, ttft_s, tpot_s, e2e_s)."""
    wall = max(r["done_s"] for r in requests) - min(r["sent_s"] for r in requests)
    tokens = sum(r["completion_tokens"] or 0 for r in requests)
    ttfts = [r["ttft_s"] for r in requests if r["ttft_s"] is not None]
    tpots = [r["tpot_s"] for r in requests if r["tpot_s"] is not None]
    return {
        "wall_s": wall, "completion_tokens": tokens, "throughput_tok_s": tokens / wall,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttft_max_s": max(ttfts) if ttfts else None,
        "tpot_p50_s": percentile(tpots, 50), "tpot_p90_s": percentile(tpots, 90),
        "e2e_p50_s": percentile([r["e2e_s"] for r in requests], 50),
    }


def real_text_token_ids(llm, num_tokens: int, offset: int = 0) -> list[int]:
    """`num_tokens` token ids of standard-library source, starting `offset` lines in."""
    lines = stdlib_text().splitlines(keepends=True)
    if offset * 37 >= len(lines):
        raise ValueError(f"the stdlib text has {len(lines)} lines, so offsets end at {(len(lines) - 1) // 37}")
    ids = llm.encode("".join(lines[offset * 37 :]))
    if len(ids) < num_tokens:
        raise ValueError(f"only {len(ids)} tokens of stdlib text available, {num_tokens} asked")
    return ids[:num_tokens]


def at_least(minimum: int):
    """An argparse type: an int of at least `minimum` (a 0 that an `x or default` turned into the
    default, or a count that failed minutes later with an IndexError, is refused at once)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = f"int >= {minimum}"  # what argparse names in its error
    return parse


def token_counts(text: str, *, multiple_of: int = 1, minimum: int = 1) -> list[int]:
    """A comma-separated list of token counts, each at least `minimum` and a multiple of
    `multiple_of` (budgets are whole blocks)."""
    counts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a whole number") from None
        if value < minimum or value % multiple_of:
            rule = f"at least {minimum}" + (f" and a multiple of {multiple_of}" if multiple_of > 1 else "")
            raise argparse.ArgumentTypeError(f"{value} must be {rule}")
        counts.append(value)
    if not counts:
        raise argparse.ArgumentTypeError("no token counts given")
    return counts


# Decode-config variants a benchmark mode label may carry: 'lookahead+topup4+rate0.01+depth0.5'.
MODE_VARIANTS = {"topup": ("lookahead_topup_blocks", int), "rate": ("max_replace_fraction", float),
                 "depth": ("prefetch_rank_fraction", float), "group": ("lookahead_layer_group", int)}
# Variants that take no number: 'lookahead+skip', 'lookahead+uint8' (key summaries read as 8-bit
# codes), 'lookahead+bf16' (as bfloat16).
FLAG_VARIANTS = {"skip": ("miss_policy", "skip"), "uint8": ("summary_read_dtype", "uint8"),
                 "bf16": ("summary_read_dtype", "bfloat16")}


def parse_mode(label: str, modes: tuple[str, ...]) -> tuple[str, dict]:
    """'lookahead+topup4+rate0.01' -> ('lookahead', {lookahead_topup_blocks: 4, max_replace_fraction: 0.01}),
    'lookahead+skip' -> ('lookahead', {miss_policy: 'skip'}): variants of a mode run side by side
    with it, in the same run."""
    mode, *variants = label.split("+")
    if mode not in modes:
        raise ValueError(f"unknown mode {mode!r} in {label!r}: one of {', '.join(modes)}")
    overrides = {}
    for variant in variants:
        if variant in FLAG_VARIANTS:
            field, value = FLAG_VARIANTS[variant]
            overrides[field] = value
            continue
        name = next((n for n in MODE_VARIANTS if variant.startswith(n)), None)
        if name is None:
            known = [n + "N" for n in MODE_VARIANTS] + list(FLAG_VARIANTS)
            raise ValueError(f"unknown variant {variant!r} in {label!r}: {', '.join(known)}")
        field, kind = MODE_VARIANTS[name]
        try:
            overrides[field] = kind(variant[len(name):])
        except ValueError:
            raise ValueError(f"variant {variant!r} in {label!r}: {name} takes a number") from None
    return mode, overrides


def decode_overrides(args, fields: tuple[str, ...], variant: dict) -> dict:
    """The DecodeConfig fields of `fields` given on the command line (not None), with a mode
    label's variant on top: 'lookahead+rate0.01' beside --max-replace-fraction 0.02 runs that
    variant at 0.01 (as two keyword sources the same field would be a TypeError)."""
    given = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    return given | variant


def grouped_bar_positions(num_series: int, num_groups: int) -> tuple[float, list[list[float]]]:
    """Bar width, and for each series the x of its bar in every group (groups at 0, 1, ...)."""
    width = 0.8 / num_series
    return width, [[group + (series - (num_series - 1) / 2) * width for group in range(num_groups)]
                   for series in range(num_series)]


def label_context_axes(axes, contexts: list[dict]) -> None:
    """One group of bars per context length: tick labels, axis label, legend. Each legend entry
    adds headroom above the tallest bar, so the legend sits over empty space, not over a bar."""
    for ax in axes:
        ax.set_xticks(range(len(contexts)), [str(c["context"]) for c in contexts])
        ax.set_xlabel("context tokens")
        entries = len(ax.get_legend_handles_labels()[0])
        ax.set_ylim(top=ax.get_ylim()[1] * (1 + 0.09 * entries))
        ax.legend(fontsize=7, loc="upper left")


def write_results(out_dir: Path, name: str, results: dict, plot=None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"benchmark": name, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **results}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        plot(results, axes)
        fig.suptitle(name)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=110)
        plt.close(fig)
        print(f"wrote {out_dir / (name + '.png')}")
    return path


class DelayedReads:
    """A store client whose every block read starts `seconds` late: a slow or congested link. The
    decode engine calls it on its I/O thread, so the reads queued behind a late one are late too,
    as on a link that moves one transfer at a time; everything else passes straight through."""

    def __init__(self, client, seconds: float):
        if seconds < 0:
            raise ValueError(f"a read delay must be >= 0 seconds, got {seconds}")
        self.client = client
        self.seconds = seconds

    def read_blocks(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.client.read_blocks(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)
