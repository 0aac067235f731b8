"""KV store transfer bandwidth: NIXL, TCP and in-process, beside single-thread memcpy.

    python bench/kvstore.py            # full run (~2 min on 2 cores)
    python bench/kvstore.py --quick    # fewer repeats and sizes

The store runs as its own process (`python -m oasiskv.kvstore`) for the NIXL and TCP
transports, and inside this process for in-process. For each unit size (one block of one layer
and KV head: K+V of 16 tokens, 4 KiB ... 1 MiB) it measures:

- batched read: min(1000, 64 MiB / size) units at random places of a large request, landing in
  random slots of a registered destination, as ONE transfer (the decode node's prefetch);
- single read: one unit per transfer (latency-bound);
- batched write: the same pattern written (the store also recomputes the key summaries).

The headline case is 1,000 scattered 64 KiB units. The physical limit is libc memcpy on one
thread between two huge-page buffers, measured in the same run; every figure is also given as a
ratio to it. Medians of --repeats. Writes bench/results/kvstore.json and kvstore.png.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from oasiskv.kvstore import KVLayout, KVStore, alloc_host_buffer, connect  # noqa: E402
from oasiskv.kvstore.nixl_transport import nixl_available  # noqa: E402

from bench.common import write_results  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
UNIT_SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB]
BATCH_BYTES = 64 * MIB
MAX_BATCH = 1000


class Memcpy:
    """Single-thread libc memcpy between two prefaulted huge-page buffers: the limit here.

    This VM's memory bandwidth drifts by up to 2x between runs, so every transport figure is
    divided by a memcpy of the same byte count timed in alternation with it.
    """

    def __init__(self, nbytes: int):
        self.src = alloc_host_buffer(nbytes)
        self.dst = alloc_host_buffer(nbytes)
        self.src.tensor.fill_(1)

    def contiguous(self, nbytes: int) -> None:
        ctypes.memmove(self.dst.ptr, self.src.ptr, nbytes)

    def scattered(self, src_offsets: list[int], dst_offsets: list[int], unit: int) -> None:
        for s, d in zip(src_offsets, dst_offsets):
            ctypes.memmove(self.dst.ptr + d, self.src.ptr + s, unit)


def alternating_medians(fns: list, repeats: int) -> list[float]:
    """Median seconds of each fn, timed in turn within every repeat (after one warm-up each)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def layout_for(unit_bytes: int) -> KVLayout:
    # unit = 2 (K,V) x 16 tokens x head_dim x 2 bytes (bf16)
    return KVLayout(num_layers=4, num_kv_heads=2, head_dim=unit_bytes // 64, block_size=16, dtype=torch.bfloat16)


def start_store(capacity_gb: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "oasiskv.kvstore", "--port", "0", "--capacity-gb", str(capacity_gb)],
        stdout=subprocess.PIPE, text=True, cwd=str(ROOT.parent), env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    for line in proc.stdout:
        if line.startswith("READY "):
            return proc, line.split()[1]
    raise RuntimeError(f"store did not start (rc={proc.wait()})")


def bench_transport(client, unit_bytes: int, request_bytes: int, repeats: int, dst, memcpy: Memcpy, tag: str) -> dict:
    layout = layout_for(unit_bytes)
    tokens = max(16, request_bytes // layout.chunk_bytes * 16)
    request_id = f"bench-{tag}-{unit_bytes}"
    info = client.allocate(request_id, layout, tokens)
    n = min(MAX_BATCH, BATCH_BYTES // unit_bytes)
    nbytes = n * unit_bytes
    rng = np.random.default_rng(unit_bytes)
    units = rng.choice(layout.units_per_block * info.num_blocks, size=n, replace=False)
    block, within = np.divmod(units, layout.units_per_block)
    layer, head = np.divmod(within, layout.num_kv_heads)
    slots = rng.permutation(dst.numel() // unit_bytes)[:n]
    # The same scatter, done locally with one memmove per unit (what in-process does).
    local_src = (rng.permutation(BATCH_BYTES // unit_bytes)[:n] * unit_bytes).tolist()
    local_dst = (rng.permutation(BATCH_BYTES // unit_bytes)[:n] * unit_bytes).tolist()

    def write() -> None:
        client.write_blocks(request_id, layer, head, block, dst, slots).wait()

    def read() -> None:
        client.read_blocks(request_id, layer, head, block, dst, slots).wait()

    singles = min(n, 50)

    def read_one_by_one() -> None:
        for i in range(singles):
            client.read_blocks(request_id, layer[i], head[i], block[i], dst, slots[i:i + 1]).wait()

    t_copy, t_scatter, t_read, t_write = alternating_medians(
        [lambda: memcpy.contiguous(nbytes), lambda: memcpy.scattered(local_src, local_dst, unit_bytes), read, write],
        repeats,
    )
    t_single = alternating_medians([read_one_by_one], repeats)[0] / singles
    # Bit-exactness of what was timed: read everything back into a fresh buffer and compare.
    check = torch.zeros(nbytes, dtype=torch.uint8)
    client.read_blocks(request_id, layer, head, block, check).wait()
    expected = dst.view(-1, unit_bytes)[torch.from_numpy(slots)].reshape(-1)
    assert torch.equal(check, expected), f"{tag} {unit_bytes}: data mismatch"
    client.free(request_id)
    memcpy_gbps = nbytes / t_copy / 1e9
    return {
        "unit_bytes": unit_bytes, "batch_units": n, "batch_bytes": nbytes,
        "memcpy_gbps": memcpy_gbps,
        "memcpy_scattered_gbps": nbytes / t_scatter / 1e9,
        "read_batched_gbps": nbytes / t_read / 1e9,
        "read_batched_ms": t_read * 1e3,
        "read_batched_vs_memcpy": t_copy / t_read,
        "read_single_us": t_single * 1e6,
        "read_single_gbps": unit_bytes / t_single / 1e9,
        "write_batched_gbps": nbytes / t_write / 1e9,
        "write_batched_vs_memcpy": t_copy / t_write,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repeats, 3 sizes")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--capacity-gb", type=float, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    sizes = [4 * KIB, 64 * KIB, 1 * MIB] if args.quick else UNIT_SIZES
    capacity_gb = args.capacity_gb or (0.75 if args.quick else 1.5)
    request_bytes = int(capacity_gb * (1 << 30) * 0.8)
    torch.set_num_threads(1)

    memcpy = Memcpy(BATCH_BYTES)
    copy_s = alternating_medians([lambda: memcpy.contiguous(BATCH_BYTES)], repeats)[0]
    print(f"memcpy (1 thread, huge pages, {BATCH_BYTES // MIB} MiB): {BATCH_BYTES / copy_s / 1e9:.2f} GB/s "
          "(re-measured beside every row below)")

    dst_buffer = alloc_host_buffer(BATCH_BYTES * 2)
    dst = dst_buffer.tensor
    dst.copy_(torch.randint(0, 256, (dst.numel(),), dtype=torch.uint8))

    transports = ["nixl", "tcp", "inproc"] if nixl_available() else ["tcp", "inproc"]
    results: dict[str, list[dict]] = {}
    proc, address = start_store(capacity_gb)
    local_store = KVStore(int(capacity_gb * (1 << 30)))
    try:
        for transport in transports:
            client = connect(local_store if transport == "inproc" else address, transport=transport, timeout=120)
            client.register(dst)
            rows = []
            for unit in sizes:
                row = bench_transport(client, unit, request_bytes, repeats, dst, memcpy, transport)
                rows.append(row)
                print(f"  {transport:6s} {unit // KIB:5d} KiB: read {row['read_batched_gbps']:6.2f} GB/s batched "
                      f"({row['read_batched_vs_memcpy']:.0%} of memcpy {row['memcpy_gbps']:.1f}), "
                      f"single {row['read_single_us']:7.1f} us, write {row['write_batched_gbps']:6.2f} GB/s", flush=True)
            results[transport] = rows
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()

    headline = {t: next((r for r in rows if r["unit_bytes"] == 64 * KIB), None) for t, rows in results.items()}
    print_table(results)
    goal = headline.get("nixl")
    summary = {
        "goal": "batched scattered 64 KiB NIXL reads >= 50% of single-thread memcpy",
        "nixl_64k_batched_vs_memcpy": goal["read_batched_vs_memcpy"] if goal else None,
        "goal_met": bool(goal and goal["read_batched_vs_memcpy"] >= 0.5),
    }
    print("\nheadline: 1,000 scattered 64 KiB units, NIXL: "
          + (f"{goal['read_batched_gbps']:.2f} GB/s = {goal['read_batched_vs_memcpy']:.0%} of memcpy "
             f"-> goal {'met' if summary['goal_met'] else 'NOT met'}" if goal else "n/a"))
    write_results(args.out, "kvstore", {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "config": {"repeats": repeats, "quick": args.quick, "capacity_gb": capacity_gb, "unit_sizes": sizes,
                   "batch": f"min({MAX_BATCH}, {BATCH_BYTES // MIB} MiB / unit) scattered units per transfer"},
        "memcpy_gbps_at_start": BATCH_BYTES / copy_s / 1e9,
        "results": results,
        "summary": summary,
    }, plot=lambda r, axes: plot(r, axes))
    return 0


def print_table(results: dict) -> None:
    print(f"\n{'transport':9s} {'unit':>8s} {'units':>6s} {'read GB/s':>10s} {'memcpy':>7s} {'ratio':>6s} "
          f"{'scatter-cpy':>11s} {'1-unit us':>10s} {'write GB/s':>10s}")
    for transport, rows in results.items():
        for r in rows:
            print(f"{transport:9s} {r['unit_bytes'] // KIB:>6d}Ki {r['batch_units']:>6d} {r['read_batched_gbps']:>10.2f} "
                  f"{r['memcpy_gbps']:>7.2f} {r['read_batched_vs_memcpy']:>6.0%} {r['memcpy_scattered_gbps']:>11.2f} "
                  f"{r['read_single_us']:>10.1f} {r['write_batched_gbps']:>10.2f}")
    print("ratio = batched read / single-thread memcpy of the same bytes, timed alternately; scatter-cpy = one "
          "memmove per unit at random places (the in-process path's limit)")


def plot(results: dict, axes) -> None:
    for transport, rows in results["results"].items():
        sizes = [r["unit_bytes"] // KIB for r in rows]
        line = axes[0].plot(sizes, [r["read_batched_gbps"] for r in rows], marker="o", label=f"{transport} read")
        axes[0].plot(sizes, [r["write_batched_gbps"] for r in rows], marker="x", linestyle=":", color=line[0].get_color(),
                     label=f"{transport} write (+summaries)")
        axes[1].plot(sizes, [r["read_single_us"] for r in rows], marker="o", label=transport)
    any_rows = next(iter(results["results"].values()))
    axes[0].plot([r["unit_bytes"] // KIB for r in any_rows], [r["memcpy_gbps"] for r in any_rows], "k--", label="memcpy (1 thread)")
    axes[0].plot([r["unit_bytes"] // KIB for r in any_rows], [r["memcpy_gbps"] / 2 for r in any_rows], color="grey",
                 linestyle=":", label="50% of memcpy")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("unit size (KiB)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s, one batched scattered transfer")
    axes[1].set_ylabel("us per single-unit read")
    axes[1].set_yscale("log")


if __name__ == "__main__":
    sys.exit(main())
