"""What each miss policy costs on a slow link: `lookahead` (miss policy `wait`, the default) and
`lookahead+skip` beside `dense`, teacher-forced on the same texts, for a sweep of store-read
delays.

    python bench/miss_policy.py                       # qwen2.5-coder-0.5b, 8K, 4 texts, 0-40 ms
    python bench/miss_policy.py --reuse               # combine the per-delay results already written

For every delay D it runs `bench/sparse_quality.py --read-delay-ms D --modes lookahead,lookahead+skip
--budgets 2048 --skip-ideal --skip-free-running` (each block read of the decode engine starts D ms
late, one at a time on its I/O thread: `bench.common.DelayedReads`), which writes
sparse_quality_<model>_miss_policy_delay<D>.json, then pools those into one table and plot:
per policy and delay, top-1 agreement and perplexity against dense, late prefetches (waits or
skips) and the seconds the teacher-forced passes took. `wait` should match its own on-time
quality at every delay and pay in seconds; `skip` keeps closer to the on-time seconds and pays
in quality.

Writes bench/results/miss_policy_<model>.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from bench import sparse_quality  # noqa: E402
from bench.common import write_results  # noqa: E402

POLICIES = {"lookahead": "wait", "lookahead+skip": "skip"}


def per_delay_name(model: str, delay_ms: float) -> str:
    return f"sparse_quality_{model}_miss_policy_delay{delay_ms:g}"


def run_delay(args, delay_ms: float) -> None:
    sparse_quality.main(["--model", args.model, "--dtype", args.dtype, "--context", str(args.context),
                         "--new-tokens", str(args.new_tokens), "--budgets", str(args.budget_tokens),
                         "--offsets", args.offsets, "--modes", ",".join(POLICIES), "--read-delay-ms", f"{delay_ms:g}",
                         "--skip-ideal", "--skip-free-running", "--tag", f"miss_policy_delay{delay_ms:g}",
                         "--out", args.out])


def combine(results_by_delay: dict[float, dict]) -> list[dict]:
    """One row per (delay, run): the pooled figures of each per-delay result."""
    rows = []
    for delay_ms, results in sorted(results_by_delay.items()):
        for run in results["pooled"]:
            rows.append({
                "read_delay_ms": delay_ms, "mode": run["mode"], "miss_policy": POLICIES.get(run["mode"]),
                "top1_agreement": run["top1_agreement"], "perplexity_ratio": run["perplexity_ratio"],
                "prefetch_hits": run["prefetch_hits"], "prefetch_waits": run["prefetch_waits"],
                "prefetch_skips": run["prefetch_skips"], "teacher_forced_seconds": run["teacher_forced_seconds"],
            })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--budget-tokens", type=int, default=2048)
    parser.add_argument("--offsets", default="0,40,80,120", help="texts (sparse_quality --offsets)")
    parser.add_argument("--delays-ms", default="0,10,20,40", help="store-read delays, comma-separated")
    parser.add_argument("--reuse", action="store_true",
                        help="combine the per-delay results already in --out instead of running them")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    try:
        delays = sorted({float(d) for d in args.delays_ms.split(",")})
    except ValueError:
        parser.error(f"--delays-ms takes numbers, got {args.delays_ms!r}")
    if delays[0] < 0:
        parser.error(f"--delays-ms must be >= 0, got {delays[0]:g}")
    results_by_delay = {}
    for delay_ms in delays:
        path = Path(args.out) / f"{per_delay_name(args.model, delay_ms)}.json"
        if not args.reuse:
            run_delay(args, delay_ms)
        if not path.exists():
            parser.error(f"{path} is missing: run without --reuse to produce it")
        results_by_delay[delay_ms] = json.loads(path.read_text())
    first = results_by_delay[delays[0]]
    rows = combine(results_by_delay)
    results = {"model": first["model"], "dtype": first["dtype"], "context": first["context"],
               "new_tokens": first["new_tokens"], "offsets": first["offsets"], "budget_tokens": args.budget_tokens,
               "delays_ms": delays, "per_delay_results": [per_delay_name(args.model, d) for d in delays], "runs": rows}
    print_table(rows)
    write_results(Path(args.out), f"miss_policy_{args.model}", results, plot=_plot)
    return 0


def print_table(rows: list[dict]) -> None:
    first = rows[0]["read_delay_ms"]
    print(f"\n{'delay ms':>8}  {'mode':<16}{'top1 agree':>11}{'ppl/dense':>10}{'waits':>7}{'skips':>7}{'seconds':>9}"
          f"{f'x at {first:g} ms':>12}")
    on_time = {r["mode"]: r["teacher_forced_seconds"] for r in rows if r["read_delay_ms"] == first}
    for r in rows:
        print(f"{r['read_delay_ms']:>8g}  {r['mode']:<16}{r['top1_agreement']:>11.2%}{r['perplexity_ratio']:>10.4f}"
              f"{r['prefetch_waits']:>7}{r['prefetch_skips']:>7}{r['teacher_forced_seconds']:>9.1f}"
              f"{r['teacher_forced_seconds'] / on_time[r['mode']]:>12.2f}")


def _plot(results: dict, axes) -> None:
    """Perplexity against dense, and the seconds the teacher-forced passes took, per delay."""
    ax_ppl, ax_time = axes
    for i, mode in enumerate(("dense", *POLICIES)):
        mine = [r for r in results["runs"] if r["mode"] == mode]
        xs = [r["read_delay_ms"] for r in mine]
        label = mode if mode == "dense" else f"{mode} (miss policy {POLICIES[mode]})"
        if mode != "dense":
            ax_ppl.plot(xs, [r["perplexity_ratio"] for r in mine], marker="o", color=f"C{i}", label=label)
        ax_time.plot(xs, [r["teacher_forced_seconds"] for r in mine], marker="o", color=f"C{i}", label=label)
    ax_ppl.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax_ppl.set_ylabel("perplexity / dense")
    ax_time.set_ylabel("seconds, teacher-forced passes (all texts)")
    for ax in axes:
        ax.set_xlabel("store-read delay, ms per read")
        ax.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
