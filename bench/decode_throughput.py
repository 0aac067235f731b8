"""Decode throughput: `dense`, `sparse-current` and `lookahead` side by side in one run, N
concurrent requests per context length, the KV store in ANOTHER process reached over NIXL.

    python bench/decode_throughput.py           # qwen2.5-coder-0.5b, 8 requests at 8K and at 16K, 128 tokens
    python bench/decode_throughput.py --quick   # smollm2-135m, 8 requests at 2K and 4K, 32 tokens, budget 512
    python bench/decode_throughput.py --device cuda --dtype bfloat16 --model qwen2.5-coder-1.5b --contexts 32512
                                                # on a GPU: model, prefill pass and KV pool in its memory

Setup (not timed as decode):
- The store is started as its own process (`python -m oasiskv.kvstore --transport nixl`) and
  reached with `connect(address, transport="nixl")`.
- Prompts are Python standard-library source. Prefill on this CPU takes minutes for 16K
  tokens, so ONE dense forward runs over the longest context and serves every request: request
  i of context L is the prompt ids[:L - s i] (s = --prompt-step, 64: a different prompt and a
  different next token for each request). Attention is causal, so the KV of positions < L - s i
  from that pass is exactly that prompt's prefill KV; its first token is the greedy token of row L - s i - 1,
  and its first working set is that row's queries against the key summaries (what `Prefiller`
  computes). For every mode run the prompts are written to the store under fresh request ids
  (the decode engine frees a request's store memory when it finishes).
- The device KV pool (`kv_pool_gb`) is the same for every mode of a context length, sized so
  `dense` (which holds every request's whole KV) fits at most --dense-fit requests (4) at once,
  however short its shorter prompts (`dense_fit_pool_rows`); the others wait for a free slot, as
  on a GPU whose HBM is full.

Measured per mode (the decode engine's own counters plus timers around its parts):
- generated tokens/s = decode-generated tokens (the prefill's first token excluded) / wall
  time of `run_to_completion` for all N requests (admissions, transfers, steps);
- bytes moved from the store per token and per request: admission (the whole KV for `dense`,
  the first working set and every block's key summary for the sparse modes) +
  prefetch/on-demand fetches during decode;
- decode-node KV memory: peak of pool rows in use x row_bytes (and the pool size); in the sparse
  modes the rows include each request's key-summary pages (`peak_summary_rows` of them at the
  peak of summary pages in use); a draft model's own ring KV (`drafter_kv_bytes`, allocated
  at start-up for max_num_seqs requests, the same in every mode) is beside the pool, not in it;
- draft acceptance rate (k drafts from --drafter: the n-gram drafter by default, or a draft model
  such as qwen2.5-coder-0.5b for the 1.5B target, the same for every mode), prediction recall
  (sparse modes);
- time breakdown: admission, model forward (and inside it: block selection + fetch issue,
  waits for transfers, the recall counter's own scoring), write-back, drafting, verification
  (`--timing wall` leaves it out: on a GPU its timers synchronize the device several times a
  layer, which costs the overlap of host and kernels that serving has).
Ratios: lookahead / dense and sparse-current / dense tokens/s, and dense / mode KV moved per
request. Median tokens/s over --repeats (interleaved runs of the modes); every other number of a
mode from its median run (`fields_from_run` in the JSON). Goal: lookahead >= 2x dense
tokens/s and >= 6x less KV moved per request.
Writes bench/results/decode_throughput_<model>.json and a PNG.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Shared 2-core machine: OpenMP threads that spin while other processes hold the cores made
# every step 10-50x slower here (measured); passive waiting keeps timings meaningful.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import oasiskv.decode_node.engine as engine_module  # noqa: E402
from oasiskv.decode_node.config import DecodeConfig  # noqa: E402
from oasiskv.decode_node.engine import DecodeEngine  # noqa: E402
from oasiskv.decode_node.draft_model import build_drafter  # noqa: E402
from oasiskv.decode_node.speculative import DrafterMismatch  # noqa: E402
from oasiskv.kvstore import connect, ranking_radius_weight  # noqa: E402
from oasiskv.models.device import require_device  # noqa: E402
from oasiskv.models.errors import ModelError  # noqa: E402
from oasiskv.models.sampling import SamplingParams  # noqa: E402
from oasiskv.prefill_node.prefill import PrefillResult, first_working_set, kv_layout_for  # noqa: E402

from bench.common import (  # noqa: E402
    at_least,
    decode_overrides,
    grouped_bar_positions,
    label_context_axes,
    parse_mode,
    real_text_token_ids,
    token_counts,
    write_results,
)
from bench.lookahead_accuracy import BLOCK, DenseContext, load_llm  # noqa: E402

MODES = ("dense", "sparse-current", "lookahead")
GOAL_SPEEDUP = 2.0
GOAL_LESS_KV = 6.0
# DecodeConfig fields a run may override from the command line.
OVERRIDES = ("max_replace_fraction", "lookahead_topup_blocks", "lookahead_layer_group", "attention_kernel")


# -- the store process ---------------------------------------------------------------------------
class StoreProcess:
    def __init__(self, capacity_gb: float, transport: str):
        cmd = [sys.executable, "-m", "oasiskv.kvstore", "--port", "0", "--capacity-gb", f"{capacity_gb:.3f}",
               "--transport", transport]
        self.stderr = open(os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, text=True, cwd=str(ROOT.parent),
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        self.address = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"store exited with {self.proc.wait(10)}: {' '.join(cmd)}")
            if line.startswith("READY "):
                self.address = line.split()[1]
                self.ready_line = line.strip()
                break
        if self.address is None:
            self.close()
            raise RuntimeError("store did not become ready")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()
        self.stderr.close()


# -- requests from one dense pass ----------------------------------------------------------------
class PromptSet:
    """Prompts ids[:L] (prefixes of one long text) whose prefill comes from one dense pass."""

    def __init__(self, ctx: DenseContext, layout, sinks: int, window: int):
        """sinks, window: the decode node's sink and window blocks (resident anyway, so the first
        working set leaves them out, as the prefill node's excluded head and tail blocks)."""
        self.ctx = ctx
        self.layout = layout
        self.sinks, self.window = sinks, window
        model = ctx.model
        self.num_layers = model.config.num_layers
        self.sliding_windows = model.config.sliding_window  # per layer, None where it attends to all
        # The prefill node scores its own exact float32 summaries, not the store's narrowed ones.
        self.summaries = [ctx.summaries(layer, len(ctx.ids), torch.float32, layout.summary_kind)
                          for layer in range(self.num_layers)]
        self.radius_weight = ranking_radius_weight(layout.summary_kind)
        self.packed = ctx.packed_kv(len(ctx.ids) // BLOCK)  # complete blocks; prompts end on a block
        self._first: dict[int, int] = {}

    def first_token(self, length: int) -> int:
        if length not in self._first:
            with torch.inference_mode():
                logits = self.ctx.model.compute_logits(self.ctx.hidden[length - 1][None])
            self._first[length] = int(logits[0].argmax())
        return self._first[length]

    def selection(self, length: int, budget_blocks: int) -> torch.Tensor:
        """[layers, kv_heads, k] first working set from the last prompt row's queries, by the
        prefill node's own `first_working_set`."""
        query = self.ctx.queries[length - 1]
        scale = self.ctx.model.config.softmax_scale
        return torch.stack([first_working_set(query[layer][None], self.summaries[layer], length, BLOCK, self.sinks,
                                              self.window, budget_blocks, self.sliding_windows[layer], scale,
                                              self.radius_weight)
                            for layer in range(self.num_layers)])

    def write(self, client, request_id: str, length: int, budget_blocks: int) -> PrefillResult:
        """Put the prompt's KV in the store under request_id (what the prefill node does)."""
        client.allocate(request_id, self.layout, length)
        blocks = length // BLOCK
        handles = [client.write_layer(request_id, layer, self.packed[layer, :blocks]) for layer in range(self.num_layers)]
        for handle in handles:
            handle.wait()
        written = blocks * self.num_layers * self.layout.num_kv_heads * self.layout.unit_bytes
        return PrefillResult(request_id, self.ctx.ids[:length], self.first_token(length), self.layout,
                             self.selection(length, budget_blocks), written)


# -- timers around the engine's parts -------------------------------------------------------------
class Timers:
    """Wraps engine / backend methods with wall-clock accumulators (bench-side only).

    With parts=False only the wall is timed: nothing is wrapped, so on a GPU the device is
    synchronized only at the run's two edges and the host runs ahead of the kernels as it would
    when serving."""

    def __init__(self, engine: DecodeEngine, parts: bool = True):
        # On a GPU kernels run after their launch returns: without a sync at each timer's edges the
        # time of one part would land in whichever part next waits for the device.
        device = torch.device(engine.config.device)
        self._sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.t = {}
        self.peak_rows = 0
        self.peak_summary_rows = 0
        self.request_steps = 0  # sum over steps of the requests in the step
        self._selecting = False
        self.engine = engine
        self._wrapped = []  # (object, name): wrappers set on instances, over their class's methods
        self._model = engine.model
        self._original_verify = engine_module.verify
        if parts:
            self._wrap_parts()

    def _wrap_parts(self) -> None:
        engine = self.engine
        backend = engine.backend
        self._wrap(engine, "_admit", "admission")
        self._wrap(engine, "_join_admitted", "admission")  # the first working sets landing (waited for when idle)
        self._wrap(engine, "_propose", "drafting")
        self._wrap(engine, "_write_back", "write_back")
        self._wrap(backend, "_track_recall", "recall_counter")
        self._wrap(backend, "_attend_resident", "attention")
        original_select = backend._select_and_fetch
        original_await = backend.transfers.await_layer

        def select(*a, **kw):
            self._selecting = True
            started = self._now()
            try:
                return original_select(*a, **kw)
            finally:
                self._add("select_and_fetch", self._now() - started)
                self._selecting = False

        def await_layer(*a, **kw):
            started = self._now()
            try:
                return original_await(*a, **kw)
            finally:
                self._add("on_demand_wait" if self._selecting else "prefetch_wait", self._now() - started)

        backend._select_and_fetch = select
        backend.transfers.await_layer = await_layer
        self._wrapped += [(backend, "_select_and_fetch"), (backend.transfers, "await_layer")]
        model = self._model
        timers = self

        class TimedModel:
            config = model.config

            def __call__(self, *a, **kw):
                started = timers._now()
                try:
                    return model(*a, **kw)
                finally:
                    timers._add("forward", timers._now() - started)

            def compute_logits(self, hidden):
                started = timers._now()
                try:
                    return model.compute_logits(hidden)
                finally:
                    timers._add("lm_head", timers._now() - started)

        engine.model = TimedModel()
        original_verify = self._original_verify

        def verify(*a, **kw):
            started = self._now()
            try:
                return original_verify(*a, **kw)
            finally:
                self._add("verify", self._now() - started)

        engine_module.verify = verify

    def restore(self) -> None:
        """Undo every wrapper and let go of the engine. The wrappers close over its bound
        methods, and the timed model's class (a class is always in a reference cycle) over
        these timers, so left in place they kept a finished engine until a full garbage
        collection: at 32K each run's pool (3.5 GiB on Qwen 1.5B) stayed allocated, and the
        second repeat ran out of memory."""
        engine_module.verify = self._original_verify
        for obj, name in self._wrapped:
            delattr(obj, name)
        self._wrapped = []
        self.engine.model = self._model
        self.engine = None

    def _wrap(self, obj, name: str, key: str) -> None:
        original = getattr(obj, name)

        def timed(*a, **kw):
            started = self._now()
            try:
                return original(*a, **kw)
            finally:
                self._add(key, self._now() - started)

        setattr(obj, name, timed)
        self._wrapped.append((obj, name))

    def _now(self) -> float:
        self._sync()
        return time.perf_counter()

    def _add(self, key: str, seconds: float) -> None:
        self.t[key] = self.t.get(key, 0.0) + seconds

    def run(self) -> dict:
        """run_to_completion, tracking the peak of pool rows in use after every step."""
        engine = self.engine
        final = {}
        started = self._now()
        while engine.has_unfinished:
            outputs = engine.step()
            self.request_steps += sum(1 for out in outputs if out.new_token_ids)
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
            self.peak_rows = max(self.peak_rows, engine.pool.rows_used)
            self.peak_summary_rows = max(self.peak_summary_rows, sum(r.plan.summary_pages for r in engine.running))
        self.t["wall"] = self._now() - started
        return final


def breakdown(t: dict) -> dict:
    """Disjoint parts of the wall time (seconds); empty when only the wall was timed."""
    if set(t) == {"wall"}:
        return {}
    inside = ("attention", "select_and_fetch", "prefetch_wait", "recall_counter")
    forward_rest = t.get("forward", 0.0) - sum(t.get(k, 0.0) for k in inside)
    parts = {
        "admission (incl. KV transfer)": t.get("admission", 0.0),
        "forward: weights (MLP, projections)": forward_rest,
        "forward: attention over resident KV": t.get("attention", 0.0),
        "forward: block selection + fetch issue": t.get("select_and_fetch", 0.0) - t.get("on_demand_wait", 0.0),
        "forward: waiting for on-demand fetches": t.get("on_demand_wait", 0.0),
        "forward: waiting for prefetches": t.get("prefetch_wait", 0.0),
        "forward: recall counter (instrumentation)": t.get("recall_counter", 0.0),
        "lm head + verification": t.get("lm_head", 0.0) + t.get("verify", 0.0),
        "write-back to store": t.get("write_back", 0.0),
        "drafting": t.get("drafting", 0.0),
    }
    parts["other (scheduling, bookkeeping)"] = t["wall"] - sum(parts.values())
    return parts


# -- one mode run ---------------------------------------------------------------------------------
def decode_config(args, label: str, pool_gb: float, num_requests: int) -> DecodeConfig:
    """The decode engine's config for one run of mode `label` (main checks every label's before
    the model loads, with a stand-in pool: a bad variant or option then fails in seconds)."""
    mode, variant = parse_mode(label, MODES)
    return DecodeConfig(mode=mode, kv_pool_gb=pool_gb, budget_tokens=args.budget_tokens,
                        num_draft_tokens=args.num_draft_tokens, sink_blocks=args.sink_blocks,
                        window_blocks=args.window_blocks, max_num_seqs=max(32, num_requests), device=args.device,
                        **decode_overrides(args, OVERRIDES, variant))


def run_mode(llm, client, prompts: PromptSet, label: str, lengths: list[int], args, pool_gb: float, tag: str,
             drafter) -> dict:
    mode, variant = parse_mode(label, MODES)
    config = decode_config(args, label, pool_gb, len(lengths))
    engine = DecodeEngine(llm.model, llm.tokenizer, client, config, drafter=drafter)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    ids = [f"{tag}-{label}-{i}" for i in range(len(lengths))]
    write_started = time.perf_counter()
    results = [prompts.write(client, rid, length, config.budget_blocks) for rid, length in zip(ids, lengths)]
    write_s = time.perf_counter() - write_started
    timers = Timers(engine, parts=args.timing == "parts")
    try:
        for result in results:
            engine.add(result, params)
        final = timers.run()
    finally:
        timers.restore()
        engine.close()  # unregisters the pool (the registration keeps it alive) and stops the I/O thread
        for rid in ids:  # one drafter serves every run: a draft model's per-request KV must not outlive its engine
            drafter.release(rid)
    c = engine.counters.snapshot()
    wall = timers.t["wall"]
    # Everything the store sends the decode node counts, the key summaries of the sparse modes too.
    moved = c["bytes_fetched"] + c["admission_bytes_fetched"] + c["summary_bytes_fetched"]
    layout = engine.layout
    return {
        "mode": label, "base_mode": mode, "variant": variant, "requests": len(lengths), "wall_s": wall,
        "store_write_s": write_s,
        "generated_tokens": c["generated_tokens"], "tokens_per_s": c["generated_tokens"] / wall,
        "steps": c["steps"], "mean_batch": timers.request_steps / max(1, c["steps"]),
        "kv_bytes_moved": moved, "kv_bytes_per_request": moved / len(lengths),
        "kv_bytes_per_token": moved / c["generated_tokens"],
        "admission_bytes": c["admission_bytes_fetched"], "decode_fetch_bytes": c["bytes_fetched"],
        "summary_bytes": c["summary_bytes_fetched"],
        "write_back_bytes": c["blocks_written_back"] * layout.num_layers * layout.num_kv_heads * layout.unit_bytes,
        "pool_rows": engine.pool.num_rows, "row_bytes": engine.pool.row_bytes,
        "pool_bytes": engine.pool.num_rows * engine.pool.row_bytes,
        "peak_rows_used": timers.peak_rows, "peak_kv_bytes": timers.peak_rows * engine.pool.row_bytes,
        "peak_summary_rows": timers.peak_summary_rows,
        # A draft model's ring KV: fixed at start-up, the same in every mode, outside the pool.
        "drafter_kv_bytes": getattr(drafter, "kv_bytes", 0),
        "acceptance_rate": c["acceptance_rate"], "prediction_recall": c["prediction_recall"],
        "prefetch_hits": c["prefetch_hits"], "prefetch_misses": c["prefetch_misses"],
        "breakdown_s": breakdown(timers.t), "timers_s": timers.t, "counters": c,
        "outputs": {rid[len(tag) + len(label) + 2 :]: final[rid].token_ids for rid in ids},
    }


def dense_rows(length: int, new_tokens: int, k: int) -> int:
    return -(-(length + new_tokens + k + 1) // BLOCK) + 1  # DecodeEngine.row_plan for dense


def dense_fit_pool_rows(request_rows: list[int], dense_fit: int) -> int:
    """Pool rows in which dense (each request holding `request_rows[i]` rows) runs at most
    `dense_fit` of these requests at once, and always the largest alone.

    `dense_fit` x the largest alone let more in when the prompts differ much in length (6 prompts of
    1024..384 tokens: 5 ran at once in a pool sized for 4). Any dense_fit + 1 of them need at least
    the rows of the dense_fit + 1 smallest, so one row fewer keeps every such group out. Only where
    that is below the largest request (dense_fit 1 and two small prompts) can more fit."""
    largest = max(request_rows)
    rows = dense_fit * largest
    if len(request_rows) > dense_fit:
        rows = min(rows, sum(sorted(request_rows)[: dense_fit + 1]) - 1)
    return max(rows, largest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default qwen2.5-coder-0.5b (--quick: smollm2-135m)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N: where the model, the prefill pass and the decode node's KV pool "
                             "live (the store stays in host memory, in its own process)")
    parser.add_argument("--contexts", default=None, type=lambda text: token_counts(text, multiple_of=BLOCK),
                        help="comma-separated multiples of 16 (default 8192,16384; quick 2048,4096)")
    parser.add_argument("--requests", type=at_least(1), default=8, help="concurrent requests per context")
    parser.add_argument("--prompt-step", type=at_least(BLOCK), default=64,
                        help="tokens between the prompt lengths of a context's requests (a multiple of 16)")
    # One token is the prefill's alone: no decode step, nothing to measure.
    parser.add_argument("--new-tokens", type=at_least(2), default=None,
                        help="tokens per request, the prefill's first one included (default 128, quick 32)")
    parser.add_argument("--budget-tokens", type=at_least(BLOCK), default=None,
                        help="a multiple of 16 (default 2048, quick 512)")
    parser.add_argument("--num-draft-tokens", type=at_least(0), default=3, help="below 16 (the block size)")
    parser.add_argument("--drafter", default="ngram",
                        help="'ngram' (prompt lookup) or a draft model sharing the target's tokenizer, e.g. "
                             "qwen2.5-coder-0.5b with --model qwen2.5-coder-1.5b (DecodeConfig.drafter)")
    parser.add_argument("--sink-blocks", type=at_least(0), default=1)
    parser.add_argument("--window-blocks", type=at_least(1), default=4)
    parser.add_argument("--dense-fit", type=at_least(1), default=4, help="requests the pool holds in dense mode")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated; a mode may carry variants run beside it: lookahead+topup4, lookahead+rate0.01, "
                        "lookahead+depth0.5, lookahead+group1 (bench.common.MODE_VARIANTS)")
    parser.add_argument("--repeats", type=at_least(1), default=1, help="interleaved runs of every mode; medians reported")
    parser.add_argument("--offset", type=at_least(0), default=0, help="start of the text, in lines / 37 (bench.common)")
    parser.add_argument("--max-replace-fraction", type=float, default=None,
                        help="budget share one step may replace (default: DecodeConfig's)")
    parser.add_argument("--lookahead-topup-blocks", type=at_least(0), default=None,
                        help="lookahead's on-demand top-up per layer and KV head (default: DecodeConfig's, 0)")
    parser.add_argument("--lookahead-layer-group", type=at_least(1), default=None,
                        help="layers whose look-ahead selection runs together (default: DecodeConfig's)")
    parser.add_argument("--attention-kernel", default=None, choices=["auto", "torch", "triton"],
                        help="how every mode attends over its resident KV (default: DecodeConfig's)")
    parser.add_argument("--timing", default="parts", choices=["parts", "wall"],
                        help="parts: a time breakdown, the GPU synchronized at every part's edges (several times a "
                             "layer); wall: only the whole run timed, the GPU synchronized at its two edges")
    parser.add_argument("--transport", default="nixl", choices=["nixl", "tcp"],
                        help="how the decode engine reaches the store (tcp: where UCX cannot start)")
    parser.add_argument("--tag", default="", help="suffix of the result files' name")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    # `is None`: an explicit value, 0 included, is the user's (argparse has checked its range).
    args.model = args.model or ("smollm2-135m" if args.quick else "qwen2.5-coder-0.5b")
    if args.new_tokens is None:
        args.new_tokens = 32 if args.quick else 128
    if args.budget_tokens is None:
        args.budget_tokens = 512 if args.quick else 2048
    contexts = args.contexts or ([2048, 4096] if args.quick else [8192, 16384])
    if args.prompt_step % BLOCK:
        parser.error(f"--prompt-step must be a multiple of {BLOCK}, got {args.prompt_step}")
    if args.budget_tokens % BLOCK:
        parser.error(f"--budget-tokens must be a multiple of {BLOCK}, got {args.budget_tokens}")
    k = args.num_draft_tokens
    if k >= BLOCK:
        parser.error(f"--num-draft-tokens must be below {BLOCK} (drafts spill into one block at most), got {k}")
    modes = args.modes.split(",")
    if len(set(modes)) < len(modes):
        parser.error(f"--modes names a mode twice: {args.modes}")
    for label in modes:
        try:
            decode_config(args, label, 1.0, args.requests)  # any pool: only the options are checked here
        except ValidationError as error:  # (a ValueError too: caught first)
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in error.errors())
            parser.error(f"--modes {label} with these options: {problems}")
        except ValueError as error:  # an unknown mode or variant
            parser.error(f"--modes: {error}")
    lengths = {c: [c - args.prompt_step * i for i in range(args.requests)] for c in contexts}
    shortest_allowed = 4 * BLOCK * (args.window_blocks + 2)
    if min(min(v) for v in lengths.values()) < shortest_allowed:
        parser.error(f"--contexts {min(contexts)} is too short for --requests {args.requests} at --prompt-step "
                     f"{args.prompt_step}: the shortest prompt would be {min(lengths[min(contexts)])} tokens, "
                     f"below {shortest_allowed} (4 x (--window-blocks + 2) blocks)")
    try:
        require_device(args.device)
    except ValueError as error:
        parser.error(f"--device {args.device}: {error}")

    started = time.perf_counter()
    llm = load_llm(args.model, args.dtype, args.device)
    model = llm.model
    if max(contexts) + args.new_tokens + k + 1 > llm.max_model_len:
        parser.error(f"context + new tokens exceed {args.model}'s {llm.max_model_len} tokens")
    try:  # before the long prefill pass: a draft model that cannot serve this target fails at once
        # The bench sets no draft-model option: every run's config has the defaults.
        drafter = build_drafter(DecodeConfig(drafter=args.drafter, device=args.device), model, llm.tokenizer,
                                next(model.parameters()).dtype)
    except (DrafterMismatch, ModelError) as error:
        parser.error(f"--drafter {args.drafter}: {error}")
    try:
        ids = real_text_token_ids(llm, max(contexts), offset=args.offset)
    except ValueError as error:  # the text from --offset on is shorter than the longest context
        parser.error(f"--offset {args.offset} with --contexts {max(contexts)}: {error}")
    keep = {length - 1 for v in lengths.values() for length in v}
    with tqdm(total=len(ids), desc="prefill: one dense pass", unit="tok") as bar:
        ctx = DenseContext(model, ids, keep, progress=bar)
    prefill_s = time.perf_counter() - started
    layout = kv_layout_for(model, BLOCK)
    prompts = PromptSet(ctx, layout, args.sink_blocks, args.window_blocks)
    per_token = layout.num_layers * layout.num_kv_heads * layout.unit_bytes / BLOCK
    store_gb = 1.15 * args.requests * (max(contexts) + args.new_tokens + 4 * BLOCK) * per_token / 2**30 + 0.05
    store = StoreProcess(store_gb, args.transport)
    machine = platform.processor() or platform.machine()
    gpu = torch.device(args.device).type == "cuda"
    results = {
        "model": args.model, "dtype": args.dtype, "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if gpu else machine, "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "machine": machine,
        "requests": args.requests, "prompt_step": args.prompt_step, "new_tokens": args.new_tokens,
        "budget_tokens": args.budget_tokens, "timing": args.timing,
        "num_draft_tokens": k, "drafter": args.drafter, "dense_fit": args.dense_fit, "repeats": args.repeats, "transport": args.transport,
        "store": store.ready_line, "store_capacity_gb": store_gb, "prefill_one_pass_s": prefill_s,
        "goal": {"speedup": GOAL_SPEEDUP, "less_kv": GOAL_LESS_KV}, "contexts": [],
    }
    try:
        client = connect(store.address, transport=args.transport)
        client.register(prompts.packed)
        total = len(contexts) * len(modes) * args.repeats
        with tqdm(total=total, desc="mode runs") as bar:
            for context in contexts:
                row_bytes = layout.num_layers * layout.num_kv_heads * layout.unit_bytes
                pool_rows = dense_fit_pool_rows([dense_rows(length, args.new_tokens, k) for length in lengths[context]],
                                                args.dense_fit)
                pool_gb = (pool_rows + 0.5) * row_bytes / 2**30
                runs = {m: [] for m in modes}
                for r in range(args.repeats):
                    for mode in modes:
                        bar.set_postfix_str(f"{context} {mode}")
                        runs[mode].append(run_mode(llm, client, prompts, mode, lengths[context], args, pool_gb,
                                                   f"c{context}r{r}", drafter))
                        bar.update(1)
                results["contexts"].append(summarize_context(context, lengths[context], pool_gb, runs))
        client.unregister(prompts.packed)
        client.close()
    finally:
        store.close()
    results["total_s"] = time.perf_counter() - started
    print_tables(results)
    results["decode_config_overrides"] = {name: getattr(args, name) for name in OVERRIDES}
    write_results(Path(args.out), f"decode_throughput_{args.model}{'_' + args.tag if args.tag else ''}", results, plot=_plot)
    return 0


MEDIAN_RUN_NOTE = ("tokens_per_s (and speedup_vs_dense) is the median over the repeats, with an even number of them "
                   "the mean of the two middle runs; every other field comes from the single run fields_from_run "
                   "(its index in tokens_per_s_all): the median run by tokens/s, the upper middle one when even")


def median_run(reps: list[dict]) -> int:
    """Index of the run whose fields stand for a mode: the median by tokens/s, and with an even
    number of runs the upper middle one (no run has the two middle ones' mean)."""
    by_speed = sorted(range(len(reps)), key=lambda i: reps[i]["tokens_per_s"])
    return by_speed[len(reps) // 2]


def summarize_context(context: int, lengths: list[int], pool_gb: float, runs: dict) -> dict:
    modes = {}
    for mode, reps in runs.items():
        index = median_run(reps)
        # Bytes, steps, timings and outputs all from one run, so they agree with each other; only
        # tokens/s is the true median, and the JSON says which run the rest is.
        # Every run's time breakdown too, so an outlier run (a cold first run, a noisy neighbour) can be told apart.
        modes[mode] = {**reps[index], "fields_from_run": index, "fields_from_run_note": MEDIAN_RUN_NOTE,
                       "tokens_per_s_all": [r["tokens_per_s"] for r in reps],
                       "breakdown_s_all": [r["breakdown_s"] for r in reps],
                       "tokens_per_s": statistics.median(r["tokens_per_s"] for r in reps)}
    dense = modes.get("dense")
    if dense is not None:
        for mode, row in modes.items():
            row["speedup_vs_dense"] = row["tokens_per_s"] / dense["tokens_per_s"]
            row["less_kv_vs_dense"] = dense["kv_bytes_per_request"] / row["kv_bytes_per_request"] if row["kv_bytes_per_request"] else None
            row["less_memory_vs_dense"] = dense["peak_kv_bytes"] / row["peak_kv_bytes"] if row["peak_kv_bytes"] else None
            # Greedy outputs of the same prompts: how many requests match dense token for token.
            row["outputs_identical_to_dense"] = sum(row["outputs"][i] == dense["outputs"][i] for i in row["outputs"])
    return {"context": context, "prompt_lengths": lengths, "kv_pool_gb": pool_gb, "modes": modes}


def print_tables(results: dict) -> None:
    mib = 2**20
    print(f"\n{results['model']}, {results['requests']} concurrent requests x {results['new_tokens']} tokens, "
          f"budget {results['budget_tokens']}, k={results['num_draft_tokens']}, store over {results['transport']} "
          f"in another process; pool sized for {results['dense_fit']} dense requests; medians of {results['repeats']}")
    for ctx in results["contexts"]:
        print(f"\ncontext {ctx['context']} (prompts {ctx['prompt_lengths'][-1]}..{ctx['prompt_lengths'][0]}), "
              f"pool {ctx['kv_pool_gb'] * 1024:.0f} MiB")
        print(f"{'mode':<15}{'tok/s':>8}{'x dense':>8}{'moved MiB/req':>14}{'x less':>8}{'admit MiB/req':>14}"
              f"{'summ MiB/req':>13}"
              f"{'decode KiB/tok':>15}{'KiB/tok':>9}{'peak KV MiB':>12}"
              f"{'accept':>8}{'recall':>8}{'steps':>7}{'batch':>7}{'same out':>9}")
        for mode, r in ctx["modes"].items():
            print(f"{mode:<15}{r['tokens_per_s']:>8.2f}{r.get('speedup_vs_dense', float('nan')):>8.2f}"
                  f"{r['kv_bytes_per_request'] / mib:>14.1f}{_num(r.get('less_kv_vs_dense')):>8}"
                  f"{r['admission_bytes'] / r['requests'] / mib:>14.1f}{r.get('summary_bytes', 0) / r['requests'] / mib:>13.1f}"
                  f"{r['decode_fetch_bytes'] / r['generated_tokens'] / 1024:>15.0f}"
                  f"{r['kv_bytes_per_token'] / 1024:>9.0f}{r['peak_kv_bytes'] / mib:>12.0f}{_pct(r['acceptance_rate']):>8}"
                  f"{_pct(r['prediction_recall']):>8}{r['steps']:>7}{r['mean_batch']:>7.1f}"
                  f"{str(r.get('outputs_identical_to_dense', '-')) + '/' + str(r['requests']):>9}")
        names = list(next(iter(ctx["modes"].values()))["breakdown_s"])
        print("  time breakdown (s):" if names else "  time: the wall only (--timing wall)")
        print(f"  {'':<44}" + "".join(f"{m:>16}" for m in ctx["modes"]))
        for name in names + ["wall"]:
            cells = "".join(f"{(r['wall_s'] if name == 'wall' else r['breakdown_s'][name]):>16.2f}" for r in ctx["modes"].values())
            print(f"  {name:<44}{cells}")
        look, dense = ctx["modes"].get("lookahead"), ctx["modes"].get("dense")
        if look and dense:
            ok = look["speedup_vs_dense"] >= GOAL_SPEEDUP and (look["less_kv_vs_dense"] or 0) >= GOAL_LESS_KV
            print(f"  goal (lookahead >= {GOAL_SPEEDUP}x dense tok/s and >= {GOAL_LESS_KV}x less KV per request): "
                  f"{look['speedup_vs_dense']:.2f}x, {look['less_kv_vs_dense']:.1f}x -> {'met' if ok else 'NOT met'}")


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _plot(results: dict, axes) -> None:
    ax_tps, ax_kv = axes
    contexts = results["contexts"]
    modes = list(contexts[0]["modes"])
    width, positions = grouped_bar_positions(len(modes), len(contexts))
    for i, (mode, xs) in enumerate(zip(modes, positions)):
        rows = [c["modes"][mode] for c in contexts]
        ax_tps.bar(xs, [r["tokens_per_s"] for r in rows], width, label=mode, color=f"C{i}")
        admission = [(r["admission_bytes"] + r.get("summary_bytes", 0)) / r["requests"] / 2**20 for r in rows]
        decode = [r["decode_fetch_bytes"] / r["requests"] / 2**20 for r in rows]
        ax_kv.bar(xs, admission, width, color=f"C{i}", label=f"{mode}: admission (KV + summaries)")
        ax_kv.bar(xs, decode, width, bottom=admission, color=f"C{i}", alpha=0.45, hatch="//",
                  label=f"{mode}: decode fetches")
    label_context_axes(axes, contexts)
    ax_tps.set_ylabel("generated tokens/s (all requests)")
    ax_tps.set_title(f"{results['requests']} concurrent requests x {results['new_tokens']} tokens")
    ax_kv.set_ylabel("KV moved per request (MiB)")
    ax_kv.set_title("store -> decode node")


if __name__ == "__main__":
    sys.exit(main())
