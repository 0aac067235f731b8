"""Dense attention (`attend_slots`, the engine's `PagedAttention`) with fresh tensors against reused
buffers (`AttentionBuffers`), side by side in one run, on the paged caches of long contexts.

    python bench/attention_buffers.py                       # 8K / 16K / 32K, fp32 and bf16
    python bench/attention_buffers.py --contexts 8192 --repeats 3 --layers 4   # quick

One "step" is every layer's attention for a batch of sequences that each add `rows` query rows
(1: plain decode; 4: verification of 3 drafts). Both variants attend the same caches and queries,
alternately, and must give bitwise-equal outputs. Per configuration: median seconds per step, the
ratio fresh / reused (higher is better for the buffers), and minor page faults per step: fresh
tensors above glibc's mmap threshold are new mappings, faulted in on every use.
Writes bench/results/attention_buffers.json and a PNG.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from oasiskv.models.attention import AttentionBatch, AttentionBuffers, attend_slots  # noqa: E402

from bench.attention_grid import add_grid_arguments, finish_grid_axes, grid_bars, parse_grid, run_grid  # noqa: E402

BLOCK = 16


def paged_caches(layers: int, batch: int, context: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Per layer K and V caches [kv_heads, slots, d] holding `batch` sequences of `context`
    tokens in shuffled blocks (as a block allocator hands them out over time), and their tables."""
    blocks_per_seq = -(-context // BLOCK)
    order = torch.randperm(batch * blocks_per_seq, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [order[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    shape = (kv_heads, batch * blocks_per_seq * BLOCK, head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)]
    return caches, tables


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_config(args, context: int, rows: int, dtype: torch.dtype) -> dict:
    caches, tables = paged_caches(args.layers, args.batch, context, args.kv_heads, args.head_dim, dtype)
    heads = args.kv_heads * args.group
    q = torch.randn(args.batch * rows, heads, args.head_dim).to(dtype)
    scale = args.head_dim ** -0.5
    buffers = AttentionBuffers()

    def step(use_buffers: bool) -> torch.Tensor:
        # A fresh batch each step, as the engine builds one per forward (its masks are per batch).
        batch = AttentionBatch.dense(tables, [context - rows] * args.batch, [rows] * args.batch, BLOCK)
        out = None
        for k_cache, v_cache in caches:
            out = attend_slots(q, k_cache, v_cache, batch, None, scale, buffers if use_buffers else None)
        return out

    if not torch.equal(step(False), step(True)):
        raise AssertionError(f"context {context}, rows {rows}, {dtype}: reused buffers changed the output")
    times = {False: [], True: []}
    faults = {False: [], True: []}
    for _ in range(args.repeats):
        for use_buffers in (False, True):  # alternate, so drifts in machine load hit both alike
            before_faults, start = minor_faults(), time.perf_counter()
            step(use_buffers)
            times[use_buffers].append(time.perf_counter() - start)
            faults[use_buffers].append(minor_faults() - before_faults)
    fresh, reused = statistics.median(times[False]), statistics.median(times[True])
    return {
        "context": context, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
        "fresh_s": fresh, "reused_s": reused, "ratio": fresh / reused,
        "fresh_s_runs": times[False], "reused_s_runs": times[True],
        "fresh_minor_faults": statistics.median(faults[False]), "reused_minor_faults": statistics.median(faults[True]),
        "kv_gathered_mib": 2 * args.batch * args.kv_heads * context * args.head_dim * dtype.itemsize / 2**20,
    }


def plot(results: dict, axes) -> None:
    grid_bars(results, axes, (lambda e: e["ratio"], lambda e: e["fresh_minor_faults"]))
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set_ylabel("step time, fresh / reused (higher: buffers faster)")
    most_reused = max(e["reused_minor_faults"] for e in results["configs"])
    axes[1].set_ylabel(f"minor page faults per step, fresh tensors\n(reused buffers: at most {most_reused:.0f})")
    finish_grid_axes(results, axes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid_arguments(parser, contexts="8192,16384,32768", dtypes="float32,bfloat16", model="Qwen2.5-Coder-0.5B",
                       layers=24, group=7, head_dim=64, out=ROOT / "results")
    args = parser.parse_args()
    grid = parse_grid(parser, args)

    def describe(entry: dict) -> str:
        return (f"fresh {entry['fresh_s'] * 1e3:7.1f} ms, reused {entry['reused_s'] * 1e3:7.1f} ms, "
                f"{entry['ratio']:.2f}x; faults {entry['fresh_minor_faults']:.0f} vs {entry['reused_minor_faults']:.0f}")

    run_grid(args, "attention_buffers", grid, run_config, describe, plot)


if __name__ == "__main__":
    main()
