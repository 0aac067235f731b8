"""The host cost structured output adds to a decode step, per request: filling the matcher's
bitmask for the 1 + k verification rows (the drafts accepted in turn, then rolled back) and
applying it to the logits. Applying is timed as it was (baseline: xgrammar's CPU kernel, then an
isfinite scan for rows left without a token) and as the engine now does it (candidate: the
bits unpacked by numpy, a masked fill, then an amax), side by side in one run on the same rows; each step's
limited logits must be equal. A free-text request's `process_logits` is timed beside them.

    python bench/structured_output.py            # Qwen2.5-Coder's vocabulary, k = 4
    python bench/structured_output.py --quick

The output followed is real JSON under a schema (a standard-library module's functions and their
line counts). Writes bench/results/structured_output.json and a PNG.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from oasiskv.models.pull import resolve_model  # noqa: E402
from oasiskv.models.sampling import SamplingParams, process_logits  # noqa: E402
from oasiskv.models.structured_output import GrammarState, apply_bitmask  # noqa: E402
from oasiskv.models.tokenizer import load_tokenizer  # noqa: E402

from bench.common import STDLIB_SOURCES, write_results  # noqa: E402

SCHEMA = {"type": "object", "required": ["module", "functions"], "additionalProperties": False,
          "properties": {"module": {"type": "string"},
                         "functions": {"type": "array", "items": {
                             "type": "object", "required": ["name", "lines"], "additionalProperties": False,
                             "properties": {"name": {"type": "string"}, "lines": {"type": "integer"}}}}}}


def real_json() -> str:
    """Real data in SCHEMA's shape: the functions of a standard-library module."""
    tree = ast.parse((Path(sysconfig.get_paths()["stdlib"]) / STDLIB_SOURCES[0]).read_text())
    functions = [{"name": node.name, "lines": node.end_lineno - node.lineno + 1}
                 for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
    return json.dumps({"module": STDLIB_SOURCES[0], "functions": functions}, indent=1)


def time_steps(tokenizer, vocab: int, k: int, steps: int) -> dict:
    ids = tokenizer.encode(real_json(), add_special_tokens=False)
    stride = max(1, (len(ids) - k) // steps)
    positions = list(range(0, len(ids) - k, stride))[:steps]
    state = GrammarState({"json": SCHEMA}, tokenizer, vocab)
    free = SamplingParams(temperature=1.0, top_p=0.9)
    structured = SamplingParams(temperature=1.0, top_p=0.9, structured_outputs={"json": SCHEMA})
    generator = torch.Generator().manual_seed(0)
    fill, baseline, candidate, free_step, structured_step = [], [], [], [], []
    import xgrammar as xgr

    for at in tqdm(positions, desc="steps"):
        output, drafts = ids[:at], ids[at : at + k]
        logits = torch.randn(k + 1, vocab, generator=generator)
        started = time.perf_counter()
        bitmask = state.next_token_bitmask(output, drafts, k + 1)
        fill.append(time.perf_counter() - started)
        old = logits.clone()
        started = time.perf_counter()
        xgr.apply_token_bitmask_inplace(old, bitmask)
        old_empty = (~torch.isfinite(old).any(dim=-1)).tolist()
        baseline.append(time.perf_counter() - started)
        new = logits.clone()
        started = time.perf_counter()
        apply_bitmask(new, bitmask)
        new_empty = (new.amax(dim=-1) == float("-inf")).tolist()
        candidate.append(time.perf_counter() - started)
        if not torch.equal(old, new) or old_empty != new_empty:
            raise AssertionError(f"the limited logits differ at output position {at}")
        started = time.perf_counter()
        process_logits(logits, free, [], output, drafts)
        free_step.append(time.perf_counter() - started)
        started = time.perf_counter()
        process_logits(logits, structured, [], output, drafts, grammar=state)
        structured_step.append(time.perf_counter() - started)

    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    return {"output_tokens": len(ids), "steps": len(positions), "rows_per_step": k + 1,
            "fill_ms": ms(fill), "apply_baseline_ms": ms(baseline), "apply_candidate_ms": ms(candidate),
            "apply_speedup": ms(baseline) / ms(candidate), "free_process_logits_ms": ms(free_step),
            "structured_process_logits_ms": ms(structured_step)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="whose tokenizer and vocabulary")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a decode worker's sampling runs on one)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 50
    if args.steps < 1 or args.num_draft_tokens < 0:
        parser.error("--steps must be >= 1 and --num-draft-tokens >= 0")
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    row = time_steps(tokenizer, vocab, args.num_draft_tokens, args.steps)
    for key, value in row.items():
        print(f"{key:<32}{value:>10.3f}" if isinstance(value, float) else f"{key:<32}{value:>10}")
    results = {"model": args.model, "vocab_size": vocab, "threads": args.threads, **row}
    write_results(Path(args.out), "structured_output", results, plot=_plot)
    return 0


def _plot(results: dict, axes) -> None:
    per_step = f"median ms per step ({results['rows_per_step']} rows, vocabulary {results['vocab_size']})"
    axes[0].barh(["xgrammar's CPU kernel + isfinite", "numpy unpack + amax"],
                 [results["apply_baseline_ms"], results["apply_candidate_ms"]], color=["tab:red", "tab:green"])
    axes[0].set_xlabel(per_step)
    axes[0].set_title(f"applying the bitmask: {results['apply_speedup']:.1f}x")
    axes[1].barh(["free text", "structured: bitmask fill", "structured: all"],
                 [results["free_process_logits_ms"], results["fill_ms"], results["structured_process_logits_ms"]],
                 color=["tab:blue", "grey", "tab:orange"])
    axes[1].set_xlabel(per_step)
    axes[1].set_title("process_logits, per request")

if __name__ == "__main__":
    raise SystemExit(main())
