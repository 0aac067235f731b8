"""The host work a decode step does per request that grows with the request: prompt-lookup
drafting over the whole history and detokenizing the whole output. Each is timed as it was
(baseline) and as the engine now does it (candidate), side by side in one run, on real text.

    python bench/step_host_work.py            # histories 8K / 16K / 32K, outputs 1K / 4K / 16K
    python bench/step_host_work.py --quick    # 8K history, 1K output

- drafting: `NgramDrafter` (the request's history kept as an array, a numpy scan) against the
  scan over Python slices it replaced, on growing histories of standard-library source; every
  step's drafts must be equal.
- detokenizing: `OutputText` (only the tokens since the last whole character) against a whole
  `tokenizer.decode` of the output at every step; every step's text must be equal.
Steps add 1 to 4 tokens, as verified drafts do. Medians per request and step, and the ratio
baseline / candidate. On a GPU a step of 8 requests at 32K takes tens of milliseconds, so a few
milliseconds per request here would be a large share of it.
Writes bench/results/step_host_work.json and a PNG.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from oasiskv.decode_node.speculative import NgramDrafter  # noqa: E402
from oasiskv.models.engine.stopping import OutputText  # noqa: E402
from oasiskv.models.pull import resolve_model  # noqa: E402
from oasiskv.models.tokenizer import load_tokenizer  # noqa: E402

from bench.common import stdlib_text, write_results  # noqa: E402


def scan_lookup(history: list[int], k: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    """The prompt lookup as it was: the latest earlier match of the last n tokens, by Python slices."""
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = history[length - n :]
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] == tail:
                follow = history[start + n : start + n + k]
                if follow:
                    return follow
    return []


def step_lengths(start: int, steps: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths, length = [], start
    for _ in range(steps):
        length += rng.randint(1, 4)
        lengths.append(length)
    return lengths


def time_drafting(ids: list[int], history: int, steps: int, k: int) -> dict:
    drafter = NgramDrafter()
    baseline, candidate = [], []
    for length in step_lengths(history, steps, seed=history):
        prefix = ids[:length]
        started = time.perf_counter()
        old = scan_lookup(prefix, k)
        baseline.append(time.perf_counter() - started)
        started = time.perf_counter()
        new = drafter.propose(["r"], [prefix], k)[0].tokens
        candidate.append(time.perf_counter() - started)
        if new != old:
            raise AssertionError(f"drafts differ at {length} tokens: {new} vs {old}")
    return _summary("drafting", history, baseline, candidate)


def time_detokenizing(tokenizer, ids: list[int], output: int, steps: int) -> dict:
    text = OutputText(tokenizer)
    lengths = step_lengths(output - 4 * steps, steps, seed=output)
    text.decode(ids[: lengths[0] - 1])  # a request that has already produced its earlier output
    baseline, candidate = [], []
    for length in lengths:
        prefix = ids[:length]
        started = time.perf_counter()
        old = tokenizer.decode(prefix)
        baseline.append(time.perf_counter() - started)
        started = time.perf_counter()
        new = text.decode(prefix)
        candidate.append(time.perf_counter() - started)
        if new != old:
            raise AssertionError(f"texts differ at {length} tokens")
    return _summary("detokenizing", output, baseline, candidate)


def _summary(work: str, tokens: int, baseline: list[float], candidate: list[float]) -> dict:
    b, c = statistics.median(baseline), statistics.median(candidate)
    return {"work": work, "tokens": tokens, "steps": len(baseline), "baseline_ms": b * 1e3, "candidate_ms": c * 1e3,
            "baseline_p90_ms": sorted(baseline)[int(0.9 * len(baseline))] * 1e3, "speedup": b / c}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="whose tokenizer makes the token ids")
    parser.add_argument("--histories", default="8192,16384,32512", help="tokens of history when drafting")
    parser.add_argument("--outputs", default="1024,4096,16384", help="tokens of output when detokenizing")
    parser.add_argument("--steps", type=int, default=200, help="steps timed per size")
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.histories, args.outputs, args.steps = "8192", "1024", 50
    histories = [int(x) for x in args.histories.split(",")]
    outputs = [int(x) for x in args.outputs.split(",")]
    if min(histories + outputs) <= 4 * args.steps or args.steps < 1:
        parser.error("every size must exceed 4 x --steps tokens")
    tokenizer = load_tokenizer(resolve_model(args.model))
    ids = tokenizer.encode(stdlib_text())
    need = max(histories + outputs) + 4 * args.steps
    while len(ids) < need:
        ids = ids + ids
    rows = []
    with tqdm(total=len(histories) + len(outputs), desc="sizes") as bar:
        for history in histories:
            rows.append(time_drafting(ids, history, args.steps, args.num_draft_tokens))
            bar.update(1)
        for output in outputs:
            rows.append(time_detokenizing(tokenizer, ids, output, args.steps))
            bar.update(1)
    print(f"\n{'work':<14}{'tokens':>8}{'baseline ms':>13}{'candidate ms':>14}{'x faster':>10}")
    for r in rows:
        print(f"{r['work']:<14}{r['tokens']:>8}{r['baseline_ms']:>13.3f}{r['candidate_ms']:>14.3f}{r['speedup']:>10.1f}")
    results = {"model": args.model, "steps": args.steps, "num_draft_tokens": args.num_draft_tokens, "rows": rows}
    write_results(Path(args.out), "step_host_work", results, plot=_plot)
    return 0


def _plot(results: dict, axes) -> None:
    for ax, work in zip(axes, ("drafting", "detokenizing")):
        rows = [r for r in results["rows"] if r["work"] == work]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["baseline_ms"] for r in rows], 0.4, label="baseline (whole history / output)")
        ax.bar([x + 0.2 for x in xs], [r["candidate_ms"] for r in rows], 0.4, label="candidate (incremental)")
        ax.set_xticks(list(xs), [f"{r['tokens']:,}" for r in rows])
        ax.set_xlabel("history tokens" if work == "drafting" else "output tokens")
        ax.set_ylabel("ms per request and step (median)")
        ax.set_title(work)
        ax.legend()


if __name__ == "__main__":
    sys.exit(main())
