"""PD disaggregation end to end: the whole cluster on one machine, `dense` PD (the full KV of a
request pulled into the decode node at admission) vs `lookahead` (OasisKV), same pools, the
same fixed set of long-context requests.

    python bench/pd_throughput.py            # smollm2-135m, 8 requests x 3,000 prompt tokens, 512 output tokens
    python bench/pd_throughput.py --quick    # 3 requests x 1,500 prompt tokens, 192 output tokens, budget 512

The prefills run one after another on the one prefill worker, so the decodes overlap (and the
pool limits dense) only where a decode lasts longer than the prefills between two requests: at
64 output tokens behind 3,000-token prompts, one request decoded at a time in both modes and the
ratio measured the prefill. The table gives the peak of requests decoding at once, and warns
where the pool never limited dense.

What runs: for each mode, one real server (`BackgroundServer`: uvicorn on a thread of this
process, Ray, a NIXL KV store actor, one prefill actor, one decode actor), started, loaded,
measured and stopped before the next one starts. Both servers get the same `kv_pool_gb`
(decode-node device KV pool) and the same store capacity. Unless --kv-pool-gb is given, the pool
holds --dense-fit (2) `dense` requests at once; `lookahead` needs only sink + window + 1 +
budget rows (and its key summaries' pages) per request, so the same pool holds many more. The store
holds every request.

Workload: --num-requests prompts of --prompt-tokens token ids each (consecutive slices of
Python standard-library source, bench/common.py), sent at once with the official `openai`
AsyncOpenAI client (`/v1/completions`, stream=True, temperature 0, ignore_eos, max_tokens
--max-tokens), after one short warm-up request that is not measured. Per request:
- TTFT = first chunk with text - request sent (prefill, queueing for a decode pool, admission
  transfer and the first decode step are all inside it);
- TPOT = (last chunk - first chunk) / (completion tokens - 1), completion tokens from the
  stream's usage chunk;
Per mode:
- throughput = total completion tokens / wall time from the first request sent to the last
  finished;
- KV bytes transferred at admission = the decode worker's `admission_bytes_fetched` (delta over
  the load; the whole KV for `dense`, the first working set for `lookahead`); bytes moved =
  that, the key summaries `lookahead` reads at admission (`summary_bytes_fetched`), and the
  bytes fetched during decoding (`bytes_fetched`, the lookahead prefetches);
- decode-node memory = peak of `pool_rows_used * row_bytes`, sampled from the decode worker's
  stats() every --poll-s seconds while the load runs, and the pool size;
- the store's peak used bytes (host memory, sampled the same way), acceptance rate, recall.
Ratios lookahead / dense of all of these; greedy outputs of both modes compared request by
request (identical when the budget covers the prompt; with --budget-tokens below the prompt
length they may differ: reported, not asserted).

The machine is shared and noisy: per-request figures are reported as medians (p50) and p90;
run it again (or with --repeats) before trusting a small difference. --repeats R starts the
servers R times, alternating dense / lookahead, and reports the median run of each mode.
Writes bench/results/pd_throughput_<model>[_quick][_<tag>].json and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

# Shared 2-core machine: OpenMP threads spinning while other processes hold the cores made
# steps many times slower (measured in bench/decode_throughput.py). Ray workers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import openai  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.common import at_least, latency_summary, stdlib_text, write_results  # noqa: E402
from oasiskv.cluster.config import ServeConfig  # noqa: E402
from oasiskv.cluster.server import BackgroundServer  # noqa: E402
from oasiskv.decode_node.config import DecodeConfig  # noqa: E402
from oasiskv.decode_node.working_set import plan_rows  # noqa: E402
from oasiskv.models.config import ModelConfig  # noqa: E402
from oasiskv.models.pull import resolve_model  # noqa: E402
from oasiskv.models.tokenizer import load_tokenizer  # noqa: E402

MODES = ("dense", "lookahead")
API_KEY = "bench"
MIB = 2**20


# -- geometry (what the decode node and the router compute) ----------------------------------------
class Geometry:
    def __init__(self, model_config: ModelConfig, dtype: str, block_size: int):
        itemsize = 4 if dtype == "float32" else 2
        self.itemsize = itemsize
        self.block_size = block_size
        self.unit_bytes = 2 * block_size * model_config.head_dim * itemsize  # K and V of one block, layer, head
        self.row_bytes = model_config.num_layers * model_config.num_kv_heads * self.unit_bytes  # DevicePool.row_bytes
        kv_per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * itemsize
        summaries = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * 4 // block_size
        self.store_bytes_per_token = kv_per_token + summaries  # cluster.server.build_service
        self.max_model_len = model_config.max_position_embeddings

    def rows(self, decode: DecodeConfig, prompt_tokens: int, max_tokens: int) -> int:
        """ClusterService.rows_needed / DecodeEngine.row_plan for decode.mode."""
        return plan_rows(decode, prompt_tokens, max_tokens, kv_itemsize=self.itemsize).total

    def store_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        return (prompt_tokens + max_tokens + self.block_size) * self.store_bytes_per_token


# -- the decode worker's and the store's stats, sampled while the load runs ------------------------
class Sampler(threading.Thread):
    def __init__(self, decode_handle, store_handle, interval_s: float):
        super().__init__(name="stats-sampler", daemon=True)
        self.decode, self.store, self.interval_s = decode_handle, store_handle, interval_s
        self.stop_event = threading.Event()
        self.peak_rows = 0
        self.peak_store_bytes = 0
        self.peak_running = 0
        self.samples: list[dict] = []
        self.errors = 0

    def sample(self, t0: float) -> None:
        import ray

        try:
            stats, store = ray.get([self.decode.stats.remote(), self.store.stats.remote()], timeout=10)
        except Exception:
            self.errors += 1
            return
        used = int(store.get("used_bytes") or 0)
        self.peak_rows = max(self.peak_rows, int(stats["pool_rows_used"]))
        self.peak_store_bytes = max(self.peak_store_bytes, used)
        self.peak_running = max(self.peak_running, int(stats["running"]))
        self.samples.append({"t": round(time.perf_counter() - t0, 3), "pool_rows_used": stats["pool_rows_used"],
                             "running": stats["running"], "waiting": stats["waiting"], "store_used_bytes": used})

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop_event.is_set():
            self.sample(t0)
            self.stop_event.wait(self.interval_s)
        self.sample(t0)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)


# -- the load ----------------------------------------------------------------------------------------
async def one_request(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int, bar) -> dict:
    sent = time.perf_counter()
    first = last = None
    pieces, usage, reason, chunks = [], None, None, 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.text:
                chunks += 1
                if first is None:
                    first = now
                last = now
                pieces.append(choice.text)
            if choice.finish_reason:
                reason = choice.finish_reason
    done = time.perf_counter()
    bar.update(1)
    tokens = usage.completion_tokens if usage is not None else None
    return {
        "sent_s": sent, "done_s": done, "ttft_s": None if first is None else first - sent, "e2e_s": done - sent,
        "tpot_s": (last - first) / (tokens - 1) if first is not None and tokens and tokens > 1 else None,
        "completion_tokens": tokens, "chunks": chunks, "finish_reason": reason, "text": "".join(pieces),
    }


async def run_load(url: str, model: str, prompts: list[list[int]], max_tokens: int, desc: str) -> tuple[list[dict], float, float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=3600)
    try:
        with tqdm(total=len(prompts), desc=desc, unit="req") as bar:
            started = time.perf_counter()
            results = await asyncio.gather(*(one_request(client, model, p, max_tokens, bar) for p in prompts))
            ended = time.perf_counter()
    finally:
        await client.close()
    for r in results:  # relative to the load's start
        r["sent_s"] -= started
        r["done_s"] -= started
    return results, started, ended


async def warm_up(url: str, model: str, prompt: list[int]) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    try:
        await client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    finally:
        await client.close()


# -- one server, one mode --------------------------------------------------------------------------------
def run_mode(mode: str, args, prompts: list[list[int]], geometry: Geometry, pool_gb: float, store_gb: float,
             run_index: int) -> dict:
    import ray

    decode = DecodeConfig(mode=mode, kv_pool_gb=pool_gb, budget_tokens=args.budget_tokens,
                          num_draft_tokens=args.num_draft_tokens, max_num_seqs=max(32, len(prompts)))
    config = ServeConfig(model=args.model, port=0, api_key=API_KEY, dtype=args.dtype, store_capacity_gb=store_gb,
                         decode=decode, max_queued_requests=max(64, len(prompts)))
    t0 = time.perf_counter()
    with BackgroundServer(config) as server:
        startup_s = time.perf_counter() - t0
        decode_handle = server.service.handles.decode[0].handle
        store_handle = server.service.handles.stores[0].handle
        info = ray.get(decode_handle.ready.remote())
        asyncio.run(warm_up(server.url, args.model, prompts[0][:64]))
        before = ray.get(decode_handle.stats.remote())
        sampler = Sampler(decode_handle, store_handle, args.poll_s)
        sampler.start()
        try:
            requests, _, _ = asyncio.run(run_load(server.url, args.model, prompts, args.max_tokens,
                                                  f"{mode} (run {run_index + 1})"))
        finally:
            sampler.stop()
        # Let the worker finish its bookkeeping (frees) before the final counters.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            after = ray.get(decode_handle.stats.remote())
            if after["running"] == 0 and after["waiting"] == 0:
                break
            time.sleep(0.2)
    delta = {k: after[k] - before[k] for k in ("steps", "generated_tokens", "bytes_fetched", "admission_bytes_fetched",
                                                "summary_bytes_fetched",
                                                "blocks_fetched", "blocks_written_back", "drafts_proposed",
                                                "drafts_accepted", "prefetch_hits", "prefetch_misses", "fetch_wait_s")}
    rows_per_request = geometry.rows(decode, len(prompts[0]), args.max_tokens)
    return {
        "mode": mode, "startup_s": startup_s, **latency_summary(requests),
        "admission_bytes": delta["admission_bytes_fetched"],
        "admission_bytes_per_request": delta["admission_bytes_fetched"] / len(prompts),
        "decode_fetch_bytes": delta["bytes_fetched"],
        "summary_bytes": delta["summary_bytes_fetched"],
        # Everything the stores sent the decode worker, the sparse modes' key summaries too.
        "kv_bytes_moved": delta["admission_bytes_fetched"] + delta["bytes_fetched"] + delta["summary_bytes_fetched"],
        "pool_rows": info["pool_rows"], "row_bytes": info["row_bytes"], "pool_bytes": info["pool_rows"] * info["row_bytes"],
        "rows_per_request": rows_per_request, "requests_the_pool_holds": info["pool_rows"] // rows_per_request,
        "peak_rows_used": sampler.peak_rows, "peak_memory_bytes": sampler.peak_rows * info["row_bytes"],
        "peak_running": sampler.peak_running, "peak_store_bytes": sampler.peak_store_bytes,
        "acceptance_rate": delta["drafts_accepted"] / delta["drafts_proposed"] if delta["drafts_proposed"] else None,
        "prediction_recall_cumulative": after.get("prediction_recall"),
        "decode_counters_delta": delta, "stats_samples": len(sampler.samples), "stats_errors": sampler.errors,
        "pool_timeline": sampler.samples,
        "requests": requests,
    }


# -- summary ---------------------------------------------------------------------------------------------
RATIO_KEYS = {
    "throughput": "throughput_tok_s", "ttft_p50": "ttft_p50_s", "tpot_p50": "tpot_p50_s", "e2e_p50": "e2e_p50_s",
    "admission_bytes": "admission_bytes", "kv_bytes_moved": "kv_bytes_moved", "peak_memory": "peak_memory_bytes",
}


def summarize(runs: dict[str, list[dict]]) -> dict:
    modes = {}
    for mode, reps in runs.items():
        median_run = sorted(reps, key=lambda r: r["throughput_tok_s"])[len(reps) // 2]
        modes[mode] = {**median_run, "throughput_tok_s_all": [r["throughput_tok_s"] for r in reps],
                       "throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in reps),
                       "ttft_p50_s_all": [r["ttft_p50_s"] for r in reps],
                       "tpot_p50_s_all": [r["tpot_p50_s"] for r in reps]}
    dense, look = modes["dense"], modes["lookahead"]
    ratios = {}
    for name, key in RATIO_KEYS.items():
        ratios[name] = look[key] / dense[key] if dense[key] and look[key] is not None else None
    texts_d = [r["text"] for r in dense["requests"]]
    texts_l = [r["text"] for r in look["requests"]]
    identical = sum(a == b for a, b in zip(texts_d, texts_l))
    return {"modes": modes, "ratios_lookahead_over_dense": ratios,
            "outputs_identical": identical, "outputs_compared": len(texts_d),
            "outputs_identical_share": identical / len(texts_d),
            "first_divergence_chars": [_first_diff(a, b) for a, b in zip(texts_d, texts_l)]}


def _first_diff(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_table(results: dict) -> None:
    s = results["summary"]
    modes = s["modes"]
    print(f"\n{results['model']}: {results['num_requests']} requests sent at once x {results['prompt_tokens']} prompt "
          f"tokens -> {results['max_tokens']} tokens; pool {results['kv_pool_gb'] * 1024:.0f} MiB, store "
          f"{results['store_capacity_gb'] * 1024:.0f} MiB, budget {results['budget_tokens']}, k={results['num_draft_tokens']}; "
          f"runs per mode: {results['repeats']}")
    rows = [
        ("throughput (tok/s)", "throughput_tok_s", 1, ".2f"),
        ("TTFT p50 (s)", "ttft_p50_s", 1, ".2f"),
        ("TTFT p90 (s)", "ttft_p90_s", 1, ".2f"),
        ("TPOT p50 (ms)", "tpot_p50_s", 1e3, ".0f"),
        ("TPOT p90 (ms)", "tpot_p90_s", 1e3, ".0f"),
        ("e2e p50 (s)", "e2e_p50_s", 1, ".2f"),
        ("wall (s)", "wall_s", 1, ".1f"),
        ("KV at admission (MiB)", "admission_bytes", 1 / MIB, ".1f"),
        ("  per request (MiB)", "admission_bytes_per_request", 1 / MIB, ".1f"),
        ("KV fetched in decode (MiB)", "decode_fetch_bytes", 1 / MIB, ".1f"),
        ("peak decode KV mem (MiB)", "peak_memory_bytes", 1 / MIB, ".1f"),
        ("decode pool (MiB)", "pool_bytes", 1 / MIB, ".1f"),
        ("rows / request", "rows_per_request", 1, "d"),
        ("requests the pool holds", "requests_the_pool_holds", 1, "d"),
        ("peak running", "peak_running", 1, "d"),
        ("peak store used (MiB)", "peak_store_bytes", 1 / MIB, ".1f"),
        ("draft acceptance", "acceptance_rate", 100, ".0f"),
    ]
    print(f"{'':<28}{'dense':>12}{'lookahead':>12}{'look/dense':>12}")
    for label, key, scale, fmt in rows:
        d, l = modes["dense"].get(key), modes["lookahead"].get(key)
        cells = [("-" if v is None else format(v * scale if scale != 1 else v, fmt)) for v in (d, l)]
        ratio = f"{l / d:.3f}" if d and l is not None else "-"
        print(f"{label:<28}{cells[0]:>12}{cells[1]:>12}{ratio:>12}")
    dense = modes["dense"]
    if dense["peak_running"] < min(dense["requests_the_pool_holds"], results["num_requests"]):
        print(f"warning: at most {dense['peak_running']} dense request(s) decoded at once, so the pool never held "
              "dense back: the decodes ended before the next prefills (one prefill worker) were done, and the "
              "ratios measure the prefill more than the decode; raise --max-tokens")
    print(f"greedy outputs identical: {s['outputs_identical']}/{s['outputs_compared']} "
          f"(budget {results['budget_tokens']} tokens vs {results['prompt_tokens']}-token prompts)")


def _plot(results: dict, axes) -> None:
    fig = axes[0].figure
    fig.clear()
    fig.set_size_inches(17, 4)
    axs = fig.subplots(1, 5)
    modes = results["summary"]["modes"]
    panels = [
        ("throughput (tok/s)", lambda m: m["throughput_tok_s"]),
        ("TTFT p50 (s)", lambda m: m["ttft_p50_s"]),
        ("TPOT p50 (ms)", lambda m: m["tpot_p50_s"] * 1e3),
        ("KV at admission (MiB)", lambda m: m["admission_bytes"] / MIB),
        ("peak decode KV memory (MiB)", lambda m: m["peak_memory_bytes"] / MIB),
    ]
    colors = {"dense": "tab:gray", "lookahead": "tab:blue"}
    for ax, (title, get) in zip(axs, panels):
        values = [get(modes[m]) for m in MODES]
        bars = ax.bar(MODES, values, color=[colors[m] for m in MODES])
        for bar, value in zip(bars, values):
            ax.annotate(f"{value:.0f}" if value >= 100 else f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)
        if values[0]:
            ax.set_xlabel(f"lookahead / dense = {values[1] / values[0]:.2f}")
        ax.set_title(title, fontsize=10)
    axs[4].axhline(modes["dense"]["pool_bytes"] / MIB, color="k", ls="--", lw=1, label="pool size")
    axs[4].legend(fontsize=8)
    fig.text(0.5, 0.005, f"{results['model']}, {results['num_requests']} requests sent at once x {results['prompt_tokens']} "
             f"prompt tokens -> {results['max_tokens']} tokens, budget {results['budget_tokens']}", ha="center", fontsize=8)


# -- main -------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=at_least(1), default=None, help="default 8 (--quick: 3)")
    parser.add_argument("--prompt-tokens", type=at_least(1), default=None, help="default 3000 (--quick: 1500)")
    parser.add_argument("--max-tokens", type=at_least(2), default=None,
                        help="output tokens per request, the prefill's first included (default 512, --quick: 192)")
    parser.add_argument("--kv-pool-gb", type=float, default=None,
                        help="decode pool, both modes (default: holds --dense-fit dense requests)")
    parser.add_argument("--dense-fit", type=at_least(1), default=2, help="dense requests the default pool holds at once")
    parser.add_argument("--budget-tokens", type=at_least(16), default=None,
                        help="a multiple of 16 (default 1024, --quick: 512: a third of the prompt either way)")
    parser.add_argument("--num-draft-tokens", type=at_least(0), default=3)
    parser.add_argument("--repeats", type=at_least(1), default=1, help="server runs per mode (alternating); median run reported")
    parser.add_argument("--poll-s", type=float, default=0.5, help="stats sampling interval")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tag", default="", help="suffix of the result files' name")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    # `is None`: an explicit value is the user's (a 0 silently meant the default).
    defaults = {"num_requests": (3, 8), "prompt_tokens": (1500, 3000), "max_tokens": (192, 512),
                "budget_tokens": (512, 1024)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.kv_pool_gb is not None and not args.kv_pool_gb > 0:
        parser.error(f"--kv-pool-gb must be positive, got {args.kv_pool_gb}")
    if not args.poll_s > 0:
        parser.error(f"--poll-s must be positive, got {args.poll_s}")
    if args.budget_tokens % 16:
        parser.error(f"--budget-tokens must be a multiple of 16, got {args.budget_tokens}")

    started = time.perf_counter()
    model_dir = resolve_model(args.model)
    model_config = ModelConfig.from_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    geometry = Geometry(model_config, args.dtype, DecodeConfig().block_size)
    if args.prompt_tokens + args.max_tokens > geometry.max_model_len:
        parser.error(f"prompt + max tokens exceed {args.model}'s context of {geometry.max_model_len}")
    ids = tokenizer.encode(stdlib_text(), add_special_tokens=False)
    if len(ids) < args.num_requests * args.prompt_tokens:
        parser.error(f"only {len(ids)} tokens of stdlib text for {args.num_requests} x {args.prompt_tokens}")
    prompts = [ids[i * args.prompt_tokens : (i + 1) * args.prompt_tokens] for i in range(args.num_requests)]

    dense_rows = geometry.rows(DecodeConfig(mode="dense", num_draft_tokens=args.num_draft_tokens),
                               args.prompt_tokens, args.max_tokens)
    look_cfg = DecodeConfig(mode="lookahead", budget_tokens=args.budget_tokens, num_draft_tokens=args.num_draft_tokens)
    look_rows = geometry.rows(look_cfg, args.prompt_tokens, args.max_tokens)
    pool_gb = args.kv_pool_gb if args.kv_pool_gb is not None else (args.dense_fit * dense_rows + 0.5) * geometry.row_bytes / 2**30
    pool_rows = int(pool_gb * 2**30) // geometry.row_bytes
    if pool_rows < max(dense_rows, look_rows):
        parser.error(f"a pool of {pool_rows} rows cannot hold one request ({dense_rows} rows dense, {look_rows} lookahead)")
    # The router refuses (503) rather than queues when the store is full: it holds every request.
    store_gb = 1.1 * args.num_requests * geometry.store_bytes(args.prompt_tokens, args.max_tokens + 8) / 2**30 + 0.05
    print(f"{args.num_requests} prompts x {args.prompt_tokens} tokens; row {geometry.row_bytes / MIB:.2f} MiB; "
          f"dense {dense_rows} rows/request, lookahead {look_rows}; pool {pool_rows} rows ({pool_gb * 1024:.0f} MiB): "
          f"dense holds {pool_rows // dense_rows}, lookahead {pool_rows // look_rows}; store {store_gb * 1024:.0f} MiB")

    runs = {m: [] for m in MODES}
    for r in range(args.repeats):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            runs[mode].append(run_mode(mode, args, prompts, geometry, pool_gb, store_gb, r))
            m = runs[mode][-1]
            print(f"  {mode}: {m['throughput_tok_s']:.2f} tok/s, TTFT p50 {m['ttft_p50_s']:.2f} s, "
                  f"TPOT p50 {m['tpot_p50_s'] * 1e3:.0f} ms, admission {m['admission_bytes'] / MIB:.0f} MiB, "
                  f"peak {m['peak_memory_bytes'] / MIB:.0f} MiB (startup {m['startup_s']:.0f} s)")

    results = {
        "model": args.model, "dtype": args.dtype, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "transport": "nixl (store actor)",
        "num_requests": args.num_requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "budget_tokens": args.budget_tokens, "num_draft_tokens": args.num_draft_tokens, "repeats": args.repeats,
        "kv_pool_gb": pool_gb, "pool_rows": pool_rows, "row_bytes": geometry.row_bytes,
        "dense_rows_per_request": dense_rows, "lookahead_rows_per_request": look_rows,
        "store_capacity_gb": store_gb, "prompt_source": "Python stdlib source (bench/common.py), consecutive slices",
        "summary": summarize(runs), "all_runs": {m: [_drop_texts(x) for x in reps] for m, reps in runs.items()},
    }
    results["total_s"] = time.perf_counter() - started
    print_table(results)
    name = f"pd_throughput_{args.model}" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    write_results(Path(args.out), name, results, plot=_plot)
    return 0


def _drop_texts(run: dict) -> dict:
    """Every run's figures without the outputs (the median run, in the summary, keeps them)."""
    return {**run, "requests": [{k: v for k, v in r.items() if k != "text"} for r in run["requests"]],
            "pool_timeline": None}


if __name__ == "__main__":
    sys.exit(main())
