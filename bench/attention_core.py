"""The few-rows attention core (decode and verification) before and after it went to SDPA, side
by side in one run: explicit fp32 matmuls over widened K/V copies (the core until this bench was
written, kept here as the baseline) against `attend_gathered`'s stacked-GQA SDPA call.

    python bench/attention_core.py                                  # Qwen 1.5B shapes, 2K/8K/16K
    python bench/attention_core.py --contexts 2144 --repeats 3      # quick

One "step" is every layer's attention for a batch of sequences with `rows` query rows each (1:
plain decode; 4: verification of 3 drafts) over gathered K/V of `context` keys (2,144: a
look-ahead working set of 2,048 budget tokens, the sink and the window ring; 8K and 16K: dense).
Both cores get the same inputs, alternately, with their buffers reused as in the engine. Per
configuration: median seconds per step, the ratio baseline / SDPA (higher: SDPA faster), and
each core's largest error, in the model's dtype, against a float64 reference of the same inputs.
Writes bench/results/attention_core.json and a PNG.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from oasiskv.models.attention import AttentionBuffers, as_fp32, attend_gathered, reused_or_fresh  # noqa: E402

from bench.attention_grid import add_grid_arguments, finish_grid_axes, grid_bars, parse_grid, run_grid  # noqa: E402


def explicit_fp32_core(queries, keys, values, mask, scale, buffers):
    """The baseline: a KV group's query heads stacked as rows, K and V widened to fp32 copies,
    scores, mask, softmax and the weighted sum as separate fp32 ops into reused buffers."""
    num_seqs, heads, rows, head_dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = queries.float().reshape(num_seqs, kv_heads, group * rows, head_dim)
    keys, values = as_fp32(keys, "keys fp32", buffers), as_fp32(values, "values fp32", buffers)
    shape = (num_seqs, kv_heads, group * rows, length)
    scores = torch.matmul(q, keys.transpose(-1, -2), out=reused_or_fresh(buffers, "scores", shape, torch.float32, q.device))
    scores.mul_(scale)
    scores.view(num_seqs, kv_heads, group, rows, length).masked_fill_(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, out=reused_or_fresh(buffers, "probs", shape, torch.float32, q.device))
    return torch.matmul(probs, values).view(num_seqs, heads, rows, head_dim)


def float64_reference(queries, keys, values, mask, scale):
    group = queries.shape[1] // keys.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    scores = (queries.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask.repeat_interleave(group, dim=1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def make_inputs(args, context: int, rows: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(context * 10 + rows)
    heads = args.kv_heads * args.group
    # Strided [B, heads, rows, d] queries, as batch_queries hands them over.
    queries = torch.randn(args.batch, rows, heads, args.head_dim, generator=g).to(dtype).transpose(1, 2)
    keys, values = (torch.randn(args.batch, args.kv_heads, context, args.head_dim, generator=g).to(dtype) for _ in range(2))
    # Causal over the context's last rows; each KV head misses a few keys (per-head working sets).
    positions = torch.arange(context)
    query_positions = context - rows + torch.arange(rows)
    mask = (positions[None, None, None, :] <= query_positions[None, None, :, None]).expand(
        args.batch, args.kv_heads, rows, context).clone()
    mask &= torch.rand(args.batch, args.kv_heads, 1, context, generator=g) > 0.02
    return queries, keys, values, mask, args.head_dim ** -0.5


def run_config(args, context: int, rows: int, dtype: torch.dtype) -> dict:
    inputs = make_inputs(args, context, rows, dtype)
    buffers = {"baseline": AttentionBuffers(), "sdpa": AttentionBuffers()}
    cores = {"baseline": explicit_fp32_core, "sdpa": attend_gathered}
    reference = float64_reference(*inputs)
    # As the model gets it: in its own dtype (the engine casts the core's output back).
    error = {name: float((core(*inputs, buffers=buffers[name]).to(dtype).double() - reference).abs().max())
             for name, core in cores.items()}

    def step(name: str) -> None:
        for _ in range(args.layers):
            cores[name](*inputs, buffers=buffers[name])

    times = {name: [] for name in cores}
    for _ in range(args.repeats):
        for name in cores:  # alternate, so drifts in machine load hit both alike
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    baseline, sdpa = statistics.median(times["baseline"]), statistics.median(times["sdpa"])
    return {
        "context": context, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
        "baseline_s": baseline, "sdpa_s": sdpa, "ratio": baseline / sdpa,
        "baseline_s_runs": times["baseline"], "sdpa_s_runs": times["sdpa"],
        "baseline_max_error": error["baseline"], "sdpa_max_error": error["sdpa"],
    }


def plot(results: dict, axes) -> None:
    grid_bars(results, axes, (lambda e: e["ratio"], lambda e: e["sdpa_s"] * 1e3))
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set_ylabel("step time, explicit fp32 / SDPA (higher: SDPA faster)")
    axes[1].set_ylabel(f"SDPA step time, ms ({results['layers']} layers, {results['batch']} sequences)")
    finish_grid_axes(results, axes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid_arguments(parser, contexts="2144,8192,16384", dtypes="bfloat16,float32", model="Qwen2.5-Coder-1.5B",
                       layers=28, group=6, head_dim=128, out=ROOT / "results")
    args = parser.parse_args()
    grid = parse_grid(parser, args)
    if any(r < 1 or r > 16 for r in grid[1]):
        parser.error("--rows: the few-rows core serves 1 to 16 rows per sequence")

    def describe(entry: dict) -> str:
        return (f"explicit fp32 {entry['baseline_s'] * 1e3:7.1f} ms, SDPA {entry['sdpa_s'] * 1e3:7.1f} ms, "
                f"{entry['ratio']:.2f}x; max error {entry['baseline_max_error']:.1e} vs {entry['sdpa_max_error']:.1e}")

    run_grid(args, "attention_core", grid, run_config, describe, plot)


if __name__ == "__main__":
    main()
