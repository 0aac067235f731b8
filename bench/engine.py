"""Prefill and decode throughput: the OasisKV engine beside Hugging Face transformers, same
model, same weights, same machine, in one run.

    python bench/engine.py                      # SmolLM2-135M, fp32
    python bench/engine.py --model qwen2.5-coder-0.5b --prefill-lengths 512,4096,16384

Writes bench/results/engine_<model>.json and a PNG. Medians of --repeats runs; the ratio is
engine / transformers (higher is better for OasisKV).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from oasiskv.models.engine import LLM  # noqa: E402
from oasiskv.models.sampling import SamplingParams  # noqa: E402

from bench.common import median_seconds, real_text_token_ids, write_results  # noqa: E402


def bench_prefill(llm: LLM, hf, ids: list[int], repeats: int) -> dict:
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    ours = median_seconds(lambda: llm.generate([ids], one), repeats)
    tensor = torch.tensor([ids])
    with torch.inference_mode():
        theirs = median_seconds(lambda: hf(tensor, logits_to_keep=1), repeats)
    n = len(ids)
    return {"prompt_tokens": n, "oasiskv_tok_s": n / ours, "transformers_tok_s": n / theirs, "ratio": theirs / ours}


def bench_decode(llm: LLM, hf, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Decode tokens/s: only the decode steps are timed (after every prompt is prefilled), for
    both engines, so prefill noise never leaks into the figure."""
    batch = len(prompts)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    def ours_decode() -> float:
        for p in prompts:
            llm.add_request(p, params)
        while llm.scheduler.waiting:  # prefill steps
            llm.step()
        start = time.perf_counter()
        while llm.has_unfinished:
            llm.step()
        return time.perf_counter() - start

    # transformers: left-padded batch, its own KV cache (DynamicCache), greedy, explicit loop.
    width = max(len(p) for p in prompts)
    pad = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    @torch.inference_mode()
    def hf_decode() -> float:
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = hf(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        past, attn = out.past_key_values, mask
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        last = positions[:, -1:]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            attn = torch.cat([attn, torch.ones((batch, 1), dtype=attn.dtype)], dim=1)
            last = last + 1
            out = hf(input_ids=token, attention_mask=attn, position_ids=last, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - start

    ours = statistics.median(ours_decode() for _ in range(repeats))
    theirs = statistics.median(hf_decode() for _ in range(repeats))
    generated = batch * (new_tokens - 1)
    return {"batch": batch, "new_tokens": new_tokens, "oasiskv_tok_s": generated / ours,
            "transformers_tok_s": generated / theirs, "ratio": theirs / ours}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefill-lengths", default="512,4096,16384")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for the decode runs")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_gb=2.0, max_num_batched_tokens=2048)
    hf = AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=dtype).eval()
    context = llm.max_model_len
    results = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
               "machine": platform.processor() or platform.machine(), "prefill": [], "decode": [], "skipped": []}

    lengths = [int(x) for x in args.prefill_lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    with tqdm(total=len(lengths) + len(batches), desc="bench engine") as bar:
        for n in lengths:
            if n + 1 > context:
                results["skipped"].append(f"prefill {n}: longer than the model's context ({context})")
            else:
                results["prefill"].append(bench_prefill(llm, hf, real_text_token_ids(llm, n), args.repeats))
            bar.update(1)
        for b in batches:
            prompts = [real_text_token_ids(llm, args.prompt_tokens + 7 * i, offset=i) for i in range(b)]
            results["decode"].append(bench_decode(llm, hf, prompts, args.new_tokens, args.repeats))
            bar.update(1)

    for row in results["prefill"]:
        print(f"prefill {row['prompt_tokens']:>6} tok: oasiskv {row['oasiskv_tok_s']:8.1f} tok/s  "
              f"transformers {row['transformers_tok_s']:8.1f} tok/s  ratio {row['ratio']:.2f}x")
    for row in results["decode"]:
        print(f"decode batch {row['batch']:>3}: oasiskv {row['oasiskv_tok_s']:8.1f} tok/s  "
              f"transformers {row['transformers_tok_s']:8.1f} tok/s  ratio {row['ratio']:.2f}x")
    for note in results["skipped"]:
        print("skipped:", note)
    write_results(Path(args.out), f"engine_{args.model}", results, plot=_plot)
    return 0


def _plot(results: dict, ax_pair):
    ax_prefill, ax_decode = ax_pair
    for ax, rows, key, label in ((ax_prefill, results["prefill"], "prompt_tokens", "prompt tokens"),
                                 (ax_decode, results["decode"], "batch", "batch size")):
        xs = [str(r[key]) for r in rows]
        width = 0.4
        pos = range(len(xs))
        ax.bar([p - width / 2 for p in pos], [r["oasiskv_tok_s"] for r in rows], width, label="OasisKV")
        ax.bar([p + width / 2 for p in pos], [r["transformers_tok_s"] for r in rows], width, label="transformers")
        ax.set_xticks(list(pos), xs)
        ax.set_xlabel(label)
        ax.set_ylabel("tokens/s")
        ax.legend()
    ax_prefill.set_title("prefill")
    ax_decode.set_title("decode")


if __name__ == "__main__":
    sys.exit(main())
