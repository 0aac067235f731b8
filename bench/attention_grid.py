"""The grid the attention benchmarks sweep: contexts x dtypes x query rows over one model's
attention shape, its command-line options, the run over it, and its bar plots."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import grouped_bar_positions, label_context_axes, write_results

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_grid_arguments(parser: argparse.ArgumentParser, *, contexts: str, dtypes: str, model: str, layers: int,
                       group: int, head_dim: int, out: Path) -> None:
    parser.add_argument("--contexts", default=contexts)
    parser.add_argument("--rows", default="1,4", help="query rows per sequence per step")
    parser.add_argument("--dtypes", default=dtypes)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (dense fits 4 in the decode bench)")
    parser.add_argument("--layers", type=int, default=layers, help=f"{model} has {layers}")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--group", type=int, default=group, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=head_dim)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(out))


def parse_grid(parser: argparse.ArgumentParser, args) -> tuple[list[int], list[int], list[str]]:
    """Contexts, rows and dtype names from the options; an unknown dtype is a usage error."""
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {unknown}; choose from {sorted(DTYPES)}")
    return contexts, rows, dtypes


def run_grid(args, name: str, grid: tuple[list[int], list[int], list[str]], run_config, describe, plot) -> None:
    """run_config(args, context, rows, dtype) for every point, describe(entry) printed as each
    ends; writes bench/results/<name>.json with the shape and every entry, and the plot."""
    contexts, rows, dtypes = grid
    results = []
    for context, r, d in tqdm([(c, r, d) for c in contexts for d in dtypes for r in rows], desc="attention configs"):
        entry = run_config(args, context, r, DTYPES[d])
        results.append(entry)
        tqdm.write(f"{context:>6} {d:>8} rows {r}: {describe(entry)}")
    write_results(Path(args.out), name, {
        "machine": platform.machine(), "threads": torch.get_num_threads(), "batch": args.batch,
        "layers": args.layers, "kv_heads": args.kv_heads, "group": args.group, "head_dim": args.head_dim,
        "repeats": args.repeats, "contexts": contexts, "rows": rows, "dtypes": dtypes, "configs": results,
    }, plot)


def grid_bars(results: dict, axes, values) -> None:
    """One bar per (dtype, rows) series in each context's group; axes[i] shows values[i](entry).
    The caller labels the y axes, then `finish_grid_axes`."""
    series = [(r, d) for d in results["dtypes"] for r in results["rows"]]
    width, xs = grouped_bar_positions(len(series), len(results["contexts"]))
    by_key = {(e["context"], e["rows"], e["dtype"]): e for e in results["configs"]}
    for (rows, dtype), x in zip(series, xs):
        entries = [by_key[(c, rows, dtype)] for c in results["contexts"]]
        label = f"{dtype}, {rows} row{'s' if rows > 1 else ''}"
        for ax, value in zip(axes, values):
            ax.bar(x, [value(e) for e in entries], width, label=label)


def finish_grid_axes(results: dict, axes) -> None:
    label_context_axes(axes, [{"context": c} for c in results["contexts"]])
