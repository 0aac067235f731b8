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
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from oasiskv.models.attention import AttentionBatch, AttentionBuffers, attend_slots  # noqa: E402

from bench.common import grouped_bar_positions, label_context_axes, write_results  # noqa: E402

BLOCK = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    series = [(r, d) for d in results["dtypes"] for r in results["rows"]]
    contexts = [{"context": c} for c in results["contexts"]]
    width, xs = grouped_bar_positions(len(series), len(contexts))
    by_key = {(e["context"], e["rows"], e["dtype"]): e for e in results["configs"]}
    for (rows, dtype), x in zip(series, xs):
        entries = [by_key[(c["context"], rows, dtype)] for c in contexts]
        label = f"{dtype}, {rows} row{'s' if rows > 1 else ''}"
        axes[0].bar(x, [e["ratio"] for e in entries], width, label=label)
        axes[1].bar(x, [e["fresh_minor_faults"] for e in entries], width, label=label)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set_ylabel("step time, fresh / reused (higher: buffers faster)")
    most_reused = max(e["reused_minor_faults"] for e in results["configs"])
    axes[1].set_ylabel(f"minor page faults per step, fresh tensors\n(reused buffers: at most {most_reused:.0f})")
    label_context_axes(axes, contexts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="8192,16384,32768")
    parser.add_argument("--rows", default="1,4", help="query rows per sequence per step")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (dense fits 4 in the decode bench)")
    parser.add_argument("--layers", type=int, default=24, help="Qwen2.5-Coder-0.5B has 24")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--group", type=int, default=7, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {unknown}; choose from {sorted(DTYPES)}")
    configs = [(c, r, d) for c in contexts for d in dtypes for r in rows]
    results = []
    for context, r, d in tqdm(configs, desc="attention configs"):
        entry = run_config(args, context, r, DTYPES[d])
        results.append(entry)
        tqdm.write(f"{context:>6} {d:>8} rows {r}: fresh {entry['fresh_s'] * 1e3:7.1f} ms, reused "
                   f"{entry['reused_s'] * 1e3:7.1f} ms, {entry['ratio']:.2f}x; faults "
                   f"{entry['fresh_minor_faults']:.0f} vs {entry['reused_minor_faults']:.0f}")
    write_results(Path(args.out), "attention_buffers", {
        "machine": platform.machine(), "threads": torch.get_num_threads(), "batch": args.batch,
        "layers": args.layers, "kv_heads": args.kv_heads, "group": args.group, "head_dim": args.head_dim,
        "repeats": args.repeats, "contexts": contexts, "rows": rows, "dtypes": dtypes, "configs": results,
    }, plot)


if __name__ == "__main__":
    main()
