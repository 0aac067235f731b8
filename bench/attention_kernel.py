"""Sparse attention kernels side by side: the torch path (gather the resident units, then attend)
against the Triton kernel (read each unit in place in the pool), on decode-shaped working sets.

    python bench/attention_kernel.py                 # CUDA: Qwen2.5-Coder-1.5B shapes, budget 2,048
    TRITON_INTERPRET=1 python bench/attention_kernel.py --quick --device cpu   # smoke run, no timing value

Per (batch size, working-set size): median microseconds per call of each path, the ratio
torch / triton, the bytes the call must read (K/V of the resident units once) and the
bandwidth that implies, and the largest difference between the two outputs. The working sets are
those the decode node builds: every (sequence, KV head) holds its own units, scattered across the
pool, with real positions so causality and padding masks are exercised.
Writes bench/results/attention_kernel_<device>.json and a PNG.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from oasiskv.decode_node.attention import gathered_attention  # noqa: E402
from oasiskv.decode_node.triton_attention import sparse_paged_attention, triton_available  # noqa: E402
from oasiskv.models.attention import PAD_POSITION  # noqa: E402

from bench.common import write_results  # noqa: E402

BLOCK = 16


def working_sets(batch: int, kv_heads: int, group: int, rows: int, units: int, head_dim: int,
                 dtype: torch.dtype, device: str, seed: int = 0):
    """A pool with `units` resident blocks per (sequence, KV head), scattered, and the query rows of
    a verification step at the end of a context of `units` blocks."""
    g = torch.Generator().manual_seed(seed)
    num_units = batch * kv_heads * units
    pool = torch.randn(num_units, 2, BLOCK, head_dim, generator=g).to(dtype)
    unit_ids = torch.randperm(num_units, generator=g).view(batch, kv_heads, units)
    context = units * BLOCK * 8  # the working set is an eighth of the context, as at 16K / 2,048
    blocks = torch.stack([torch.randperm(context // BLOCK, generator=g)[:units] for _ in range(batch * kv_heads)])
    blocks[:, -1] = context // BLOCK - 1  # the newest block holds the query rows
    key_positions = (blocks.view(batch, kv_heads, units, 1) * BLOCK + torch.arange(BLOCK)).view(batch, kv_heads, -1)
    key_positions = key_positions.clone()
    key_positions[key_positions >= context] = PAD_POSITION
    query_positions = torch.arange(context - rows, context).repeat(batch, 1)
    queries = torch.randn(batch, rows, kv_heads * group, head_dim, generator=g).to(dtype).transpose(1, 2)
    return tuple(t.to(device) for t in (queries, pool, unit_ids, key_positions, query_positions))


def timed_us(fn, device: str, repeats: int) -> float:
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--units", default="134", help="resident units per (sequence, KV head): budget 128 + sinks + ring")
    parser.add_argument("--kv-heads", type=int, default=2, help="Qwen2.5-Coder-1.5B: 2 KV heads")
    parser.add_argument("--group", type=int, default=6, help="query heads per KV head (1.5B: 12 / 2)")
    parser.add_argument("--rows", type=int, default=4, help="query rows per sequence: 1 + k drafts")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats (a smoke run)")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.units, args.repeats, args.head_dim = "1,2", "6", 3, 64
    if not triton_available(args.device):
        print(f"the Triton kernel cannot run on {args.device!r}: it needs Triton and a CUDA device "
              "(or TRITON_INTERPRET=1 for a smoke run on a CPU)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    scale = args.head_dim**-0.5
    shapes = [(int(b), int(u)) for b in args.batches.split(",") for u in args.units.split(",")]
    runs = []
    for batch, units in tqdm(shapes, desc="shapes"):
        inputs = working_sets(batch, args.kv_heads, args.group, args.rows, units, args.head_dim, dtype, args.device)
        queries, pool, unit_ids, key_positions, query_positions = inputs
        reference = gathered_attention(*inputs, None, scale)
        kernel_out = sparse_paged_attention(queries, pool, unit_ids, key_positions, query_positions, None, scale)
        torch_us = timed_us(lambda: gathered_attention(*inputs, None, scale), args.device, args.repeats)
        triton_us = timed_us(lambda: sparse_paged_attention(queries, pool, unit_ids, key_positions, query_positions,
                                                            None, scale), args.device, args.repeats)
        kv_bytes = unit_ids.numel() * 2 * BLOCK * args.head_dim * pool.element_size()
        runs.append({
            "batch": batch, "units": units, "torch_us": torch_us, "triton_us": triton_us,
            "speedup": torch_us / triton_us, "kv_bytes": kv_bytes,
            "triton_gb_s": kv_bytes / triton_us / 1e3, "torch_gb_s": kv_bytes / torch_us / 1e3,
            "max_abs_diff": float((kernel_out - reference.float()).abs().max()),
        })
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (Triton interpreter)"
    results = {
        "device": device_name, "dtype": args.dtype, "kv_heads": args.kv_heads, "group": args.group,
        "rows": args.rows, "head_dim": args.head_dim, "repeats": args.repeats, "runs": runs,
    }
    print(f"{'batch':>5} {'units':>5} {'torch us':>9} {'triton us':>9} {'x':>6} {'triton GB/s':>11} {'max diff':>9}")
    for r in runs:
        print(f"{r['batch']:>5} {r['units']:>5} {r['torch_us']:>9.1f} {r['triton_us']:>9.1f} {r['speedup']:>6.2f} "
              f"{r['triton_gb_s']:>11.1f} {r['max_abs_diff']:>9.2e}")
    tag = "cpu_interpreter" if not args.device.startswith("cuda") else "cuda"
    write_results(Path(args.out), f"attention_kernel_{tag}{'_quick' if args.quick else ''}", results, plot=_plot)
    return 0


def _plot(results: dict, axes) -> None:
    runs = results["runs"]
    labels = [f"B{r['batch']}/R{r['units']}" for r in runs]
    x = range(len(runs))
    axes[0].bar([i - 0.2 for i in x], [r["torch_us"] for r in runs], 0.4, label="torch (gather + attend)")
    axes[0].bar([i + 0.2 for i in x], [r["triton_us"] for r in runs], 0.4, label="triton (in place)")
    axes[0].set_xticks(list(x), labels)
    axes[0].set_ylabel("us per call (median)")
    axes[0].legend()
    axes[1].bar(list(x), [r["speedup"] for r in runs])
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[1].set_xticks(list(x), labels)
    axes[1].set_ylabel("torch / triton")


if __name__ == "__main__":
    raise SystemExit(main())
