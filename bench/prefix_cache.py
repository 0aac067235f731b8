"""Prefill with and without the prefill worker's prefix cache, side by side in one run.

Two workloads a long-context service sees: a chat whose every turn re-sends the conversation
(a document, then each turn's new tokens), and a request of n choices (the same prompt n
times). Each prompt is prefilled into a real store twice, once from token 0 (the baseline, what
every prefill was before the cache) and once through the cache, one right after the other so
both see the same machine; the cache starts empty in each repeat.

    python bench/prefix_cache.py                      # SmolLM2-135M, fp32, a 4K document
    python bench/prefix_cache.py --model qwen2.5-coder-0.5b --document-tokens 8192

Writes bench/results/prefix_cache_<model>.json and a PNG: median seconds per prompt, and the
median over repeats of baseline / cached (higher is better); the whole chat's and the whole
request's ratios are of summed medians. The first tokens of both must agree.
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

from oasiskv.kvstore import KVStoreServer, connect  # noqa: E402
from oasiskv.models.engine import LLM  # noqa: E402
from oasiskv.models.pull import resolve_model  # noqa: E402
from oasiskv.prefill_node.prefill import Prefiller, kv_layout_for  # noqa: E402
from oasiskv.prefill_node.prefix_cache import PrefixCache  # noqa: E402

from bench.common import at_least, real_text_token_ids, write_results  # noqa: E402


def workload(ids: list[int], document: int, turns: int, turn_tokens: int, choices: int) -> list[tuple[str, list[int]]]:
    """(label, prompt) in the order they are sent: the chat's turns, then the n choices."""
    chat = [(f"turn {t}", ids[:document + t * turn_tokens]) for t in range(turns)]
    # The choices' prompt is another stretch of text, so the chat's blocks do not serve it.
    other = ids[document + turns * turn_tokens:][:document]
    return chat + [(f"choice {c}", other) for c in range(choices)]


def prefill_seconds(prefiller: Prefiller, client, request_id: str, prompt: list[int]) -> tuple[float, int, int]:
    start = time.perf_counter()
    result = prefiller.prefill(request_id, prompt)
    seconds = time.perf_counter() - start
    client.free(request_id)
    return seconds, result.first_token, result.cached_tokens


def run(args) -> dict:
    llm = LLM(str(resolve_model(args.model)), dtype=args.dtype, kv_cache_gb=0.05)
    if args.threads:
        torch.set_num_threads(args.threads)
    need = args.document_tokens * 2 + args.turns * args.turn_tokens
    prompts = workload(real_text_token_ids(llm, need), args.document_tokens, args.turns, args.turn_tokens,
                       args.choices)
    layout = kv_layout_for(llm.model)
    layout_bytes = layout.kv_bytes_per_block // layout.block_size  # KV bytes per token
    store = KVStoreServer(capacity_bytes=int(need * layout_bytes * 1.2) + 2**26, prefault=False, transport="tcp")
    store.start()
    client = connect(store.address, transport="tcp")
    baseline = Prefiller(llm.model, client, chunk_tokens=args.chunk_tokens)
    seconds = {label: {"baseline": [], "cached": []} for label, _ in prompts}
    cached_tokens, agree = {}, 0
    try:
        with tqdm(total=args.repeats * len(prompts) * 2, desc="prefills", unit="prefill") as bar:
            for repeat in range(args.repeats):
                cache = PrefixCache(int(args.cache_gb * 2**30), 16)
                candidate = Prefiller(llm.model, client, chunk_tokens=args.chunk_tokens, prefix_cache=cache)
                for i, (label, prompt) in enumerate(prompts):
                    base_s, base_first, _ = prefill_seconds(baseline, client, f"base-{repeat}-{i}", prompt)
                    bar.update()
                    ours_s, ours_first, hit = prefill_seconds(candidate, client, f"ours-{repeat}-{i}", prompt)
                    bar.update()
                    seconds[label]["baseline"].append(base_s)
                    seconds[label]["cached"].append(ours_s)
                    cached_tokens[label] = hit
                    agree += base_first == ours_first
    finally:
        client.close()
        store.stop()
    rows = []
    for label, prompt in prompts:
        base = statistics.median(seconds[label]["baseline"])
        ours = statistics.median(seconds[label]["cached"])
        # Each repeat's two prefills ran back to back: the median of their ratios leaves out most
        # of what the shared machine did to both.
        paired = statistics.median(b / c for b, c in zip(seconds[label]["baseline"], seconds[label]["cached"]))
        rows.append({"prompt": label, "prompt_tokens": len(prompt), "cached_tokens": cached_tokens[label],
                     "baseline_s": base, "cached_s": ours, "ratio": paired,
                     "baseline_runs_s": seconds[label]["baseline"], "cached_runs_s": seconds[label]["cached"]})
    chat = [r for r in rows if r["prompt"].startswith("turn")]
    choices = [r for r in rows if r["prompt"].startswith("choice")]

    def total_ratio(group):
        return sum(r["baseline_s"] for r in group) / sum(r["cached_s"] for r in group)

    return {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "document_tokens": args.document_tokens, "turns": args.turns, "turn_tokens": args.turn_tokens,
        "choices": args.choices, "chunk_tokens": args.chunk_tokens, "cache_gb": args.cache_gb, "repeats": args.repeats,
        "first_tokens_agree": f"{agree} of {args.repeats * len(prompts)}",
        "chat_ratio": total_ratio(chat), "choices_ratio": total_ratio(choices), "prompts": rows,
    }


def plot(results: dict, axes) -> None:
    rows = results["prompts"]
    x = range(len(rows))
    left, right = axes
    left.bar([i - 0.2 for i in x], [r["baseline_s"] for r in rows], 0.4, label="from token 0")
    left.bar([i + 0.2 for i in x], [r["cached_s"] for r in rows], 0.4, label="prefix cache")
    left.set_ylabel("prefill seconds (median)")
    right.bar(list(x), [r["ratio"] for r in rows], 0.6)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_ylabel("from token 0 / prefix cache (median of repeats)")
    for ax in axes:
        ax.set_xticks(list(x), [f"{r['prompt']}\n{r['prompt_tokens']}" for r in rows], fontsize=7)
    left.legend(fontsize=8)
    right.set_title(f"chat {results['chat_ratio']:.2f}x, {results['choices']} choices {results['choices_ratio']:.2f}x",
                    fontsize=9)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--document-tokens", type=at_least(32), default=4096)
    parser.add_argument("--turns", type=at_least(1), default=4)
    parser.add_argument("--turn-tokens", type=at_least(1), default=256, help="tokens each chat turn adds")
    parser.add_argument("--choices", type=at_least(1), default=4, help="n of the request of several choices")
    parser.add_argument("--chunk-tokens", type=at_least(16), default=1024)
    parser.add_argument("--cache-gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--threads", type=at_least(1), default=None)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    if not args.cache_gb > 0:
        parser.error(f"--cache-gb must be above 0, got {args.cache_gb}")
    results = run(args)
    for r in results["prompts"]:
        print(f"{r['prompt']:>9} {r['prompt_tokens']:6d} tokens, {r['cached_tokens']:6d} cached: "
              f"{r['baseline_s']:.3f} s -> {r['cached_s']:.3f} s ({r['ratio']:.2f}x)")
    print(f"chat {results['chat_ratio']:.2f}x, choices {results['choices_ratio']:.2f}x; "
          f"first tokens agree {results['first_tokens_agree']}")
    name = f"prefix_cache_{args.model}" + (f"_{args.tag}" if args.tag else "")
    write_results(args.out, name, results, plot)


if __name__ == "__main__":
    main()
