"""Sparse-attention quality: the decode node's sparse modes against `dense`, same prompt, same
weights, in one run: greedy token agreement and perplexity of the file's true continuation,
for budgets 512 / 1,024 / 2,048 / 4,096 tokens and modes `sparse-current` and `lookahead`.

    python bench/sparse_quality.py            # qwen2.5-coder-0.5b, 8K context, 256 tokens
    python bench/sparse_quality.py --quick    # smollm2-135m, 2K context, 64 tokens

The prompt is Python standard-library source (bench.common); it is prefilled ONCE with the real
`Prefiller` into an in-process store, read back, and written under a fresh request id for every
run (the decode engine frees a request's store memory when it finishes). Every run goes through
the real `DecodeEngine` (working set, selection, prefetch, replacement cap, write-back), twice:

1. Free-running greedy decoding of --new-tokens tokens with the n-gram drafter (k drafts per
   step). Over the new_tokens - 1 tokens the decode engine generates (the first is the
   prefill's, the same in every mode), reported: `prefix_agreement` = tokens generated before
   the first one that differs from dense, / those tokens (strict: one flip ends it), and
   `positionwise_agreement` = share of positions with the same token as dense (after a flip the
   texts may realign or not).

2. Teacher-forced through the decode engine: perplexity and top-1 agreement. A bench-only
   drafter proposes the file's true next k tokens, and the engine's `verify` is replaced (in
   this process only, for this pass only) by one that records the target's log-probabilities
   and accepts the file's tokens, so the history follows the file exactly while every step runs
   the real sparse machinery over 1 + k rows (for `lookahead` this is the perfect-drafter case:
   the draft rows' queries are those of the true continuation). The first output token is set
   to the file's next token. Reported over the same new_tokens scored positions for every run
   (the file's tokens context + 1 .. context + new_tokens; the last step's bonus row scores the
   last): `perplexity` (exp of the mean NLL of the true tokens) and its ratio to dense, and
   `top1_agreement` = share of positions where the run's argmax equals dense's argmax on the
   same prefix (the robust form of "greedy token agreement": a flip does not derail the rest).

3. Diagnostic, outside the engine: "ideal selection". The same teacher-forced continuation runs
   as one forward over the prompt's KV (read back from the store) with a backend where EVERY
   query row attends to the sinks + its window + its own top-K blocks, chosen either by the
   exact attention mass of that row (`exact`: the best any top-K block selection can do) or by
   the decode node's ranking of that row's query against the min/max summaries (`ranking`,
   `rank_blocks`: sparse-current with a perfect, unlimited fetch; `moments`: the same over
   mean +- std summaries). `--ideal-rules` adds the
   earlier rankings for comparison: `linear` (logits q.center + 0.4 |q|.radius summed over the
   group, no softmax) and `bound` (the upper bound itself); and what a richer summary would buy:
   `sketch1` / `sketch2`, the row's attention over keys rebuilt from the min/max box plus 1 or 2
   bits per key element (`bench.lookahead_accuracy.sketch_keys`). `dense` (keep every block) through
   the same backend checks it against the engine's dense perplexity. The default rules are
   `exact` and the node's ranking over the runs' first summary kind (`moments` for the default
   mean +- std, `ranking` for min/max). Engine vs that ranking = what the prediction, one set
   shared by a step's rows and the per-step replacement cap cost; the ranking vs `exact` = what
   the summaries cost; `exact` vs dense = what the budget costs.

4. Diagnostic, `--attention-mass`: per layer and KV head, how much of each row's exact
   attention (one dense forward more) the blocks a run held when the row attended cover,
   against the most its own top-K could (`bench.attention_mass`), for every sparse run and
   ideal rule: where a run's agreement goes.

`--summary-kinds minmax,moments` prefills the prompt once per summary kind (`KVLayout.summary_kind`)
and runs every sparse mode and budget with each, side by side against the same dense run.

One text of 256 tokens is a small sample (one token is 0.4 points of agreement) and texts differ
far more than that: `--offsets 0,40,80,120` runs every mode on four stretches of the stdlib
source, prints each, and pools them (agreement averaged, perplexity ratio as a geometric mean:
the per-token log-likelihoods of all texts). The goal is judged on the pooled figures.

5. `--read-delay-ms D`: every block read of the decode engine starts D ms late, one at a time on
   its I/O thread (`bench.common.DelayedReads`, a slow or congested link), so look-ahead
   prefetches can still be in flight when their layer runs. `--modes lookahead,lookahead+skip`
   then compares the two miss policies on the same texts: `wait` keeps the quality of on-time
   prefetches and pays in time (`tf s`), `skip` keeps the time and pays in quality. The tables
   count the late prefetches (`late: waits`, `skips`) of the teacher-forced pass.

Goal at a 2,048-token budget: >= 99% agreement and perplexity within 1% of dense.
Writes bench/results/sparse_quality_<model>.json and a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import platform
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
# Shared 2-core machine: OpenMP threads that spin while other processes hold the cores made
# every step 10-50x slower here (measured); passive waiting keeps timings meaningful.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import oasiskv.decode_node.engine as engine_module  # noqa: E402
from oasiskv.decode_node.config import DecodeConfig  # noqa: E402
from oasiskv.decode_node.engine import DecodeEngine  # noqa: E402
from oasiskv.decode_node.speculative import Draft, NgramDrafter  # noqa: E402
from oasiskv.decode_node.working_set import EMPTY, plan_rows  # noqa: E402
from oasiskv.kvstore import (  # noqa: E402
    DEFAULT_SUMMARY_KIND,
    SUMMARY_KINDS,
    KVStore,
    block_scores,
    connect,
    rank_blocks,
    ranking_radius_weight,
    summarize_layer,
)
from oasiskv.models.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from oasiskv.models.sampling import SamplingParams  # noqa: E402
from oasiskv.prefill_node.prefill import Prefiller  # noqa: E402

from bench.attention_mass import ResidentSets, block_mass, mass_by_head, selectable_blocks, summarize_mass  # noqa: E402
from bench.common import (  # noqa: E402
    DelayedReads,
    at_least,
    decode_overrides,
    parse_mode,
    real_text_token_ids,
    token_counts,
    write_results,
)
from bench.lookahead_accuracy import BLOCK, LINEAR_RADIUS_WEIGHT, load_llm, sketch_keys  # noqa: E402

GOAL_AGREEMENT = 0.99
GOAL_PPL_RATIO = 1.01
IDEAL_RULES = ("ranking", "moments", "linear", "bound", "sketch1", "sketch2", "exact")


class TeacherForcing:
    """Drafter whose drafts are the file's continuation, plus a `verify` that accepts the file's
    tokens and records the target's log-probabilities for them (row i of a step predicts
    token len(history) + i)."""

    def __init__(self, full_ids: list[int]):
        self.full = full_ids
        self.starts: deque[int] = deque()
        self.logprob: dict[int, float] = {}
        self.argmax: dict[int, int] = {}

    def propose(self, request_ids, histories, k, params=None, **_):
        drafts = []
        for history in histories:
            n = len(history)
            if history[-16:] != self.full[max(0, n - 16) : n]:
                raise RuntimeError("teacher forcing lost track of the file")
            self.starts.append(n)
            drafts.append(Draft(self.full[n : n + k]))
        return drafts

    def release(self, request_id: str) -> None:
        pass

    def verify(self, target_logits, draft, params, generator=None) -> list[int]:
        start = self.starts.popleft()
        logprobs = torch.log_softmax(target_logits.float(), dim=-1)
        rows = target_logits.shape[0]
        for i in range(rows):
            token = self.full[start + i]
            self.logprob[start + i] = float(logprobs[i, token])
            self.argmax[start + i] = int(logprobs[i].argmax())
        return self.full[start : start + rows]

    @contextlib.contextmanager
    def patched(self):
        original = engine_module.verify
        engine_module.verify = self.verify
        try:
            yield self
        finally:
            engine_module.verify = original


@dataclasses.dataclass
class StoredPrompt:
    """The prompt's KV, read back from the store once, and the prefill's result."""

    packed: torch.Tensor  # [layers, blocks, kv_heads, 2, block_size, d]
    result: object  # PrefillResult

    def copy_to(self, client, request_id: str, first_token: int | None = None):
        layout = self.result.layout
        client.allocate(request_id, layout, len(self.result.prompt_ids))
        client.write_request(request_id, self.packed).wait()
        changes = {"request_id": request_id}
        if first_token is not None:
            changes["first_token"] = first_token
        return dataclasses.replace(self.result, **changes)


class IdealSelection:
    """Attention backend for a teacher-forced forward of new rows after a cached prompt
    (slot == position): each row, per KV head, attends to the sinks, its window and its own
    top-K blocks by `rule`: "exact" attention mass; its query's "ranking" (the decode node's, over
    min/max summaries; "moments": over mean +- std ones), "linear" or "bound" score against the summaries; its attention over "sketch1" / "sketch2"
    keys (box + 1 or 2 bits per element); or "dense": all."""

    def __init__(self, cache: PagedKVCache, scale: float, rule: str, budget_blocks: int, sinks: int, window: int,
                 sliding_window: list[int | None]):
        self.cache, self.scale, self.rule = cache, scale, rule
        self.budget_blocks, self.sinks, self.window = budget_blocks, sinks, window
        self.sliding_window = sliding_window  # per layer: None, or how far back its rows may see
        self.positions: torch.Tensor | None = None
        self.mass: dict[int, torch.Tensor] | None = None  # when a dict: each layer's attention per block
        self.selected: ResidentSets | None = None  # when given: each row's chosen blocks, as the engine's are recorded

    def attend(self, layer, q, k, v):
        bs = self.cache.block_size
        positions = self.positions
        self.cache.write(layer, positions, k, v)
        end = int(positions[-1]) + 1
        keys = self.cache.k[layer][:, :end].float()  # [kv_heads, L, d]
        values = self.cache.v[layer][:, :end].float()
        rows, heads, d = q.shape
        kv_heads = keys.shape[0]
        group = heads // kv_heads
        qg = q.float().view(rows, kv_heads, group, d).transpose(0, 1)  # [kv_heads, rows, group, d]
        logits = torch.einsum("hrgd,hld->hrgl", qg, keys) * self.scale
        causal = torch.arange(end)[None, :] <= positions[:, None]  # [rows, L]
        sliding = self.sliding_window[layer]
        if sliding is not None:  # as the model's own mask: without it, Gemma 3's "dense" read 539x its perplexity
            causal &= positions[:, None] - torch.arange(end)[None, :] < sliding
        logits = logits.masked_fill(~causal[None, :, None, :], float("-inf"))
        if self.rule != "dense":
            num_blocks = -(-end // bs)
            candidate, _ = selectable_blocks(positions, num_blocks, bs, self.sinks, self.window, sliding)  # [rows, blocks]
            if self.rule == "exact":
                mass = torch.softmax(logits, dim=-1).sum(dim=2)  # [kv_heads, rows, L]
                mass = torch.nn.functional.pad(mass, (0, num_blocks * bs - end))
                score = mass.view(kv_heads, rows, num_blocks, bs).sum(-1)
            else:
                complete = end // bs
                # Every rule but `moments` is defined on the min/max box (the sketches refine it).
                kind = "moments" if self.rule == "moments" else "minmax"
                summaries = summarize_layer(keys[:, : complete * bs].transpose(0, 1), bs, kind)
                if self.rule.startswith("sketch"):
                    sketched = sketch_keys(keys[:, : complete * bs], summaries, int(self.rule.removeprefix("sketch")))
                    approx = torch.einsum("hrgd,hld->hrgl", qg, sketched) * self.scale
                    seen = candidate[:, :complete].repeat_interleave(bs, dim=-1)  # [rows, complete * bs]
                    approx = approx.masked_fill(~seen[None, :, None, :], float("-inf"))
                    # A row with no candidate softmaxes only -inf (NaN); the candidate mask drops it below.
                    score = torch.softmax(approx, dim=-1).sum(dim=2).view(kv_heads, rows, complete, bs).sum(-1)
                elif self.rule in ("ranking", "moments"):
                    weight = ranking_radius_weight(kind)
                    score = torch.stack([rank_blocks(q[r:r + 1], summaries, self.scale, weight) for r in range(rows)], dim=1)
                else:
                    weight = LINEAR_RADIUS_WEIGHT if self.rule == "linear" else 1.0
                    score = block_scores(q.float(), summaries, weight).transpose(0, 1)  # [kv_heads, rows, complete]
                score = torch.nn.functional.pad(score, (0, num_blocks - complete), value=float("-inf"))
            score = score.masked_fill(~candidate[None], float("-inf"))
            top = torch.topk(score, min(self.budget_blocks, num_blocks), dim=-1)
            keep = torch.zeros_like(score, dtype=torch.bool)
            keep.scatter_(-1, top.indices, torch.isfinite(top.values))
            if self.selected is not None:
                chosen = top.indices.masked_fill(~torch.isfinite(top.values), EMPTY)  # [kv_heads, rows, K]
                for r, position in enumerate(positions.tolist()):
                    self.selected.blocks[(layer, position)] = chosen[:, r]
            keep |= ~candidate[None]  # sinks and the window (blocks past the row: causality hides them)
            keep = keep.repeat_interleave(bs, dim=-1)[..., :end]  # [kv_heads, rows, L]
            logits = logits.masked_fill(~keep[:, :, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.mass is not None:
            self.mass[layer] = block_mass(probs, bs)
        out = torch.matmul(probs, values[:, None])  # [kv_heads, rows, group, d]
        return out.transpose(0, 1).reshape(rows, heads, d).to(q.dtype)


@torch.inference_mode()
def ideal_selection(llm, stored: StoredPrompt, full: list[int], context: int, new_tokens: int, rule: str,
                    budget_blocks: int, sinks: int, window: int, mass: dict[int, torch.Tensor] | None = None,
                    selected: ResidentSets | None = None) -> tuple[dict, dict]:
    """Teacher-forced log-probs and argmaxes of tokens context+1 .. context+new_tokens; `mass`
    (a dict, with rule "dense") receives each layer's attention per block ([kv_heads, rows, blocks]),
    `selected` (another rule) the blocks each row chose."""
    model = llm.model
    c = model.config
    layout = stored.result.layout
    bs = layout.block_size
    total = context + new_tokens
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, bs, layout.dtype)
    cache = PagedKVCache(spec, -(-total // bs))
    for layer in range(c.num_layers):
        kv = stored.packed[layer]  # [blocks, kv_heads, 2, bs, d]
        cache.k[layer][:, :context] = kv[:, :, 0].transpose(0, 1).reshape(c.num_kv_heads, -1, c.head_dim)[:, :context]
        cache.v[layer][:, :context] = kv[:, :, 1].transpose(0, 1).reshape(c.num_kv_heads, -1, c.head_dim)[:, :context]
    backend = IdealSelection(cache, c.softmax_scale, rule, budget_blocks, sinks, window, c.sliding_window)
    backend.positions = torch.arange(context, total)
    backend.mass, backend.selected = mass, selected
    hidden = model(torch.tensor(full[context:total]), backend.positions, backend)
    logprobs = torch.log_softmax(model.compute_logits(hidden), dim=-1)
    targets = torch.tensor(full[context + 1 : total + 1])
    picked = logprobs.gather(1, targets[:, None])[:, 0]
    index = range(context + 1, total + 1)
    return dict(zip(index, picked.tolist())), dict(zip(index, logprobs.argmax(-1).tolist()))


def prefill_once(llm, client, prompt: list[int], budget_blocks: int, sinks: int, window: int,
                 summary_kind: str = DEFAULT_SUMMARY_KIND) -> StoredPrompt:
    result = Prefiller(llm.model, client, summary_kind=summary_kind).prefill("prompt", prompt, SamplingParams(max_tokens=1), budget_blocks=budget_blocks,
                                                  excluded_head_blocks=sinks, excluded_tail_blocks=window)
    layout = result.layout
    blocks = layout.num_blocks(len(prompt))
    packed = torch.empty((layout.num_layers, blocks, layout.num_kv_heads, 2, layout.block_size, layout.head_dim),
                         dtype=layout.dtype)
    layers = np.repeat(np.arange(layout.num_layers), blocks * layout.num_kv_heads)
    block_ids = np.tile(np.repeat(np.arange(blocks), layout.num_kv_heads), layout.num_layers)
    heads = np.tile(np.arange(layout.num_kv_heads), blocks * layout.num_layers)
    client.read_blocks("prompt", layers, heads, block_ids, packed).wait()
    client.free("prompt")
    return StoredPrompt(packed, result)


def pool_gb(engine_layout, config: DecodeConfig, prompt_tokens: int, max_tokens: int) -> float:
    """A pool that holds one request (DecodeEngine.row_plan), and two rows to spare."""
    rows = plan_rows(config, prompt_tokens, max_tokens, kv_itemsize=engine_layout.itemsize).total
    row_bytes = engine_layout.num_layers * engine_layout.num_kv_heads * engine_layout.unit_bytes
    return (rows + 2) * row_bytes / 2**30


def run_engine(llm, client, stored: StoredPrompt, config: DecodeConfig, params: SamplingParams, request_id: str,
               drafter=None, first_token: int | None = None, read_delay_s: float = 0.0) -> tuple[list[int], dict, float]:
    """Decode the stored prompt; the engine's block reads start `read_delay_s` late (a slow link)."""
    engine = DecodeEngine(llm.model, llm.tokenizer, DelayedReads(client, read_delay_s) if read_delay_s else client,
                          config, drafter=drafter)
    result = stored.copy_to(client, request_id, first_token)
    started = time.perf_counter()
    engine.add(result, params)
    try:
        outputs = engine.run_to_completion()
    finally:
        engine.close()
    seconds = time.perf_counter() - started
    return outputs[request_id].token_ids, engine.counters.snapshot(), seconds


# DecodeConfig fields a run may override from the command line.
OVERRIDES = ("max_replace_fraction", "radius_weight", "lookahead_topup_blocks")
SPARSE_MODES = ("sparse-current", "lookahead")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default qwen2.5-coder-0.5b (--quick: smollm2-135m)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context", type=at_least(1), default=None, help="prompt tokens (default 8192, quick 2048)")
    parser.add_argument("--new-tokens", type=at_least(2), default=None,
                        help="generated tokens, the prefill's first one included (default 256, quick 64)")
    parser.add_argument("--budgets", default="512,1024,2048,4096", help="comma-separated, in tokens: whole blocks of 16")
    parser.add_argument("--modes", default="sparse-current,lookahead",
                        help="comma-separated; a mode may carry variants run beside it: lookahead+topup4, lookahead+rate0.01, "
                        "lookahead+depth0.5 (bench.common.MODE_VARIANTS)")
    parser.add_argument("--num-draft-tokens", type=at_least(1), default=3,
                        help="drafts per step (at least 1: the teacher-forced pass feeds the file's tokens as drafts)")
    parser.add_argument("--sink-blocks", type=at_least(0), default=1)
    parser.add_argument("--window-blocks", type=at_least(1), default=4)
    parser.add_argument("--offsets", default="0", help="texts to run, comma-separated: where each starts in the "
                        "stdlib source, in lines / 37 (bench.common); results are given per text and pooled")
    parser.add_argument("--max-replace-fraction", type=float, default=None,
                        help="budget share one step may replace (default: DecodeConfig's)")
    parser.add_argument("--radius-weight", type=float, default=None, help="block ranking's radius weight (default: DecodeConfig's)")
    parser.add_argument("--lookahead-topup-blocks", type=int, default=None,
                        help="lookahead's on-demand top-up per layer and KV head (default: DecodeConfig's, 0)")
    parser.add_argument("--read-delay-ms", type=float, default=0.0,
                        help="every block read of the decode engine starts this late, one at a time on its I/O "
                        "thread (a slow link), so look-ahead prefetches can miss their step; with modes "
                        "lookahead and lookahead+skip this measures what each miss policy costs")
    parser.add_argument("--tag", default="", help="suffix of the result files' name")
    parser.add_argument("--skip-free-running", action="store_true", help="teacher-forced pass only")
    parser.add_argument("--skip-ideal", action="store_true", help="skip the ideal-selection diagnostic")
    parser.add_argument("--ideal-rules", default=None,
                        help=f"ideal-selection rules, comma-separated, of {','.join(IDEAL_RULES)} (default: the node's "
                        "ranking over the first summary kind, moments or ranking (min/max), and exact)")
    parser.add_argument("--summary-kinds", default=DEFAULT_SUMMARY_KIND,
                        help=f"key summary kinds to run the sparse modes with, comma-separated, of {','.join(SUMMARY_KINDS)}")
    parser.add_argument("--attention-mass", action="store_true",
                        help="per layer and KV head, the attention each sparse run held against the most any top-K "
                        "could (bench.attention_mass; one dense forward more per text)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    if args.read_delay_ms < 0:
        parser.error(f"--read-delay-ms must be >= 0, got {args.read_delay_ms}")
    kinds = args.summary_kinds.split(",")
    if set(kinds) - set(SUMMARY_KINDS):
        parser.error(f"--summary-kinds: unknown {sorted(set(kinds) - set(SUMMARY_KINDS))}; choose from {', '.join(SUMMARY_KINDS)}")
    args.ideal_rules = args.ideal_rules or f"{'moments' if kinds[0] == 'moments' else 'ranking'},exact"
    unknown = set(args.ideal_rules.split(",")) - set(IDEAL_RULES)
    if unknown:
        parser.error(f"--ideal-rules: unknown {sorted(unknown)}; choose from {', '.join(IDEAL_RULES)}")
    args.model = args.model or ("smollm2-135m" if args.quick else "qwen2.5-coder-0.5b")
    if args.context is None:
        args.context = 2048 if args.quick else 8192
    if args.new_tokens is None:
        args.new_tokens = 64 if args.quick else 256
    try:
        # A budget of 0 ran as 2,048 under the label 0; 100 failed in DecodeConfig after the prefill.
        budgets = token_counts(args.budgets, multiple_of=BLOCK, minimum=BLOCK)
    except argparse.ArgumentTypeError as error:
        parser.error(f"--budgets: {error}")
    try:
        offsets = token_counts(args.offsets, minimum=0)
    except argparse.ArgumentTypeError as error:
        parser.error(f"--offsets: {error}")
    always_held = (args.sink_blocks + args.window_blocks) * BLOCK
    if args.context <= always_held:
        parser.error(f"--context {args.context} leaves no block to select past {args.sink_blocks} sink and "
                     f"{args.window_blocks} window blocks ({always_held} tokens)")
    modes = args.modes.split(",")
    for label in modes:
        try:
            parse_mode(label, SPARSE_MODES)
        except ValueError as error:
            parser.error(str(error))
    k = args.num_draft_tokens

    started = time.perf_counter()
    llm = load_llm(args.model, args.dtype)
    if args.context + args.new_tokens + k + 1 > llm.max_model_len:
        parser.error(f"context + new tokens exceed {args.model}'s {llm.max_model_len} tokens")
    for offset in offsets:  # before any text's prefill, not after the first texts' runs
        try:
            real_text_token_ids(llm, args.context + args.new_tokens + k + 1, offset=offset)
        except ValueError as error:
            parser.error(f"--offsets {offset}: {error}")
    results = {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "machine": platform.processor() or platform.machine(), "context": args.context,
        "new_tokens": args.new_tokens, "num_draft_tokens": k, "sink_blocks": args.sink_blocks,
        "window_blocks": args.window_blocks, "summary_kinds": kinds, "offsets": offsets,
        "read_delay_ms": args.read_delay_ms,
        "goal": {"agreement": GOAL_AGREEMENT, "perplexity_ratio": GOAL_PPL_RATIO, "budget_tokens": 2048},
        "texts": [run_text(llm, args, offset, kinds, modes, budgets) for offset in offsets],
    }
    results["pooled"] = pool_texts(results["texts"], ("mode", "budget_tokens", "summary_kind"))
    results["pooled_ideal_selection"] = pool_texts(results["texts"], ("rule", "budget_tokens"), "ideal_selection")
    results["total_s"] = time.perf_counter() - started
    print_table(results)
    results["decode_config_overrides"] = {name: getattr(args, name) for name in OVERRIDES}
    write_results(Path(args.out), f"sparse_quality_{args.model}{'_' + args.tag if args.tag else ''}", results, plot=_plot)
    return 0


def run_text(llm, args, offset: int, kinds: list[str], modes: list[str], budgets: list[int]) -> dict:
    """Every run on one text (the stdlib source `offset` x 37 lines in): dense, then each sparse
    mode, budget and summary kind; the ideal diagnostic."""
    k = args.num_draft_tokens
    full = real_text_token_ids(llm, args.context + args.new_tokens + k + 1, offset=offset)
    prompt = full[: args.context]
    store = KVStore(int(_store_gb(llm, args.context + args.new_tokens + 64) * 2**30))
    client = connect(store, transport="inproc")
    t0 = time.perf_counter()
    stored_by_kind = {kind: prefill_once(llm, client, prompt, max(budgets) // 16, args.sink_blocks, args.window_blocks,
                                         kind) for kind in kinds}
    prefill_s = (time.perf_counter() - t0) / len(kinds)
    layout = stored_by_kind[kinds[0]].result.layout

    runs = [("dense", None, kinds[0])] + [(m, b, kind) for kind in kinds for m in modes for b in budgets]
    passes = 1 if args.skip_free_running else 2
    delay_s = args.read_delay_ms / 1000
    greedy = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    with tqdm(total=len(runs) * passes, desc=f"runs, text at offset {offset}") as bar:
        for label, budget, kind in runs:
            stored = stored_by_kind[kind]
            mode, variant = parse_mode(label, ("dense", *SPARSE_MODES))
            budget_field = {} if budget is None else {"budget_tokens": budget}  # dense has none
            config = DecodeConfig(mode=mode, **budget_field, num_draft_tokens=k, kv_pool_gb=1.0,
                                  sink_blocks=args.sink_blocks, window_blocks=args.window_blocks,
                                  **decode_overrides(args, OVERRIDES, variant))
            config = config.model_copy(update={"kv_pool_gb": pool_gb(layout, config, args.context, args.new_tokens)})
            tag = f"{label}-{budget}-{kind}"
            row = {"mode": label, "budget_tokens": budget, "summary_kind": kind}
            bar.set_postfix_str(f"{tag} teacher-forced")
            forcing = TeacherForcing(full)
            resident = ResidentSets()
            recording = resident.recording() if args.attention_mass and mode != "dense" else contextlib.nullcontext()
            with forcing.patched(), recording:
                _, counters, seconds = run_engine(llm, client, stored, config, greedy, f"tf-{tag}", drafter=forcing,
                                                  first_token=full[args.context], read_delay_s=delay_s)
            row["teacher_forced"] = {"logprob": forcing.logprob, "argmax": forcing.argmax, "counters": counters,
                                     "seconds": seconds}
            if resident.blocks:
                row["resident"] = resident
            bar.update(1)
            if not args.skip_free_running:
                bar.set_postfix_str(f"{tag} free-running")
                tokens, counters, seconds = run_engine(llm, client, stored, config, greedy, f"fr-{tag}",
                                                       drafter=NgramDrafter(), read_delay_s=delay_s)
                row["free_running"] = {"tokens": tokens, "counters": counters, "seconds": seconds}
                bar.update(1)
            rows.append(row)

    # The dense forward of the ideal diagnostic gives the attention every run's blocks are held against.
    mass = {} if args.attention_mass else None
    positions = torch.arange(args.context, args.context + args.new_tokens)
    stored = stored_by_kind[kinds[0]]

    def held(selected: ResidentSets, budget: int | None) -> dict:
        by_head = mass_by_head(mass, positions, selected, layout.block_size, args.sink_blocks, args.window_blocks,
                               (budget or 2048) // layout.block_size)
        return {**summarize_mass(by_head), "by_head": by_head}

    ideal = []
    if mass is not None or not args.skip_ideal:
        logprob, argmax = ideal_selection(llm, stored, full, args.context, args.new_tokens, "dense", 1,
                                          args.sink_blocks, args.window_blocks, mass=mass)
        if not args.skip_ideal:
            ideal.append({"rule": "dense", "budget_tokens": None, "logprob": logprob, "argmax": argmax})
    for row in rows:
        if "resident" in row:
            row["attention_mass"] = held(row.pop("resident"), row["budget_tokens"])
    if not args.skip_ideal:
        rules = [(rule, b) for rule in args.ideal_rules.split(",") for b in budgets]
        for rule, budget in tqdm(rules, desc="ideal selection (diagnostic)"):
            selected = ResidentSets() if mass is not None else None
            logprob, argmax = ideal_selection(llm, stored, full, args.context, args.new_tokens, rule, budget // 16,
                                              args.sink_blocks, args.window_blocks, selected=selected)
            ideal.append({"rule": rule, "budget_tokens": budget, "logprob": logprob, "argmax": argmax})
            if selected is not None:
                ideal[-1]["attention_mass"] = held(selected, budget)
    return {"offset": offset, "prefill_s": prefill_s, "runs": summarize(rows, args.context),
            "ideal_selection": summarize_ideal(ideal, rows[0], args.context)}


def pool_texts(texts: list[dict], key: tuple[str, ...], field: str = "runs") -> list[dict]:
    """Every text's rows of the same `key`, pooled over their scored tokens (the same number per
    text): agreement is the mean, perplexity the geometric mean, so the ratio to dense pools the
    per-token log-likelihoods of all texts."""
    groups: dict[tuple, list[dict]] = {}
    for text in texts:
        for row in text[field]:
            groups.setdefault(tuple(row.get(name) for name in key), []).append(row)
    pooled = []
    for values, rows in groups.items():
        if len(rows) != len(texts):
            continue
        pooled.append({
            **dict(zip(key, values)), "texts": len(rows),
            "top1_agreement": statistics.fmean(r["top1_agreement"] for r in rows),
            "perplexity": math.exp(statistics.fmean(math.log(r["perplexity"]) for r in rows)),
            "perplexity_ratio": math.exp(statistics.fmean(math.log(r["perplexity_ratio"]) for r in rows)),
            "per_text_top1_agreement": [r["top1_agreement"] for r in rows],
            "per_text_perplexity_ratio": [r["perplexity_ratio"] for r in rows],
        })
        if all("teacher_forced_counters" in r for r in rows):  # what the prefetches did, and the time it took
            pooled[-1]["teacher_forced_seconds"] = sum(r["teacher_forced_seconds"] for r in rows)
            pooled[-1].update({name: sum(r["teacher_forced_counters"][name] for r in rows)
                               for name in ("prefetch_hits", "prefetch_waits", "prefetch_skips")})
        if all("attention_mass" in r for r in rows):  # every text's rows weigh the same
            by_head = {name: np.mean([r["attention_mass"]["by_head"][name] for r in rows], axis=0).tolist()
                       for name in ("window", "ideal", "resident")}
            pooled[-1]["attention_mass"] = summarize_mass(by_head)
    return pooled


def _store_gb(llm, tokens: int) -> float:
    c = llm.model.config
    itemsize = next(llm.model.parameters()).element_size()
    per_token = c.num_layers * c.num_kv_heads * 2 * c.head_dim * itemsize
    return 2 * tokens * per_token / 2**30 + 0.05


def summarize(rows: list[dict], context: int) -> list[dict]:
    dense = rows[0]
    scored = sorted(dense["teacher_forced"]["logprob"])
    scored = [i for i in scored if i > context]  # position `context` is the prefill's
    out = []
    for row in rows:
        tf = row["teacher_forced"]
        if sorted(i for i in tf["logprob"] if i > context) != scored:
            raise RuntimeError(f"{row['mode']} {row['budget_tokens']}: scored positions differ from dense")
        nll = -sum(tf["logprob"][i] for i in scored) / len(scored)
        differ = [i - context for i in scored if tf["argmax"][i] != dense["teacher_forced"]["argmax"][i]]
        top1 = 1 - len(differ) / len(scored)
        summary = {
            "mode": row["mode"], "budget_tokens": row["budget_tokens"], "summary_kind": row["summary_kind"],
            "perplexity": math.exp(nll), "scored_tokens": len(scored), "top1_agreement": top1,
            "disagreements": differ,  # new-token indices where the argmax differs from dense's: where a run goes wrong
            "teacher_forced_seconds": tf["seconds"], "teacher_forced_counters": tf["counters"],
        }
        if "attention_mass" in row:
            summary["attention_mass"] = row["attention_mass"]
        if "free_running" in row:
            fr, ref = row["free_running"]["tokens"], dense["free_running"]["tokens"]
            # tokens[0] is the prefill's, the same in every mode: counted, a run whose first
            # decoded token differed still read 1 / new_tokens.
            decoded, ref_decoded = fr[1:], ref[1:]
            prefix = next((i for i, (a, b) in enumerate(zip(decoded, ref_decoded)) if a != b),
                          min(len(decoded), len(ref_decoded)))
            summary.update({
                "prefix_agreement": prefix / len(ref_decoded),
                "first_divergence": None if prefix == len(ref_decoded) else prefix + 1,  # index into tokens
                "positionwise_agreement": sum(a == b for a, b in zip(decoded, ref_decoded)) / len(ref_decoded),
                "free_running_seconds": row["free_running"]["seconds"],
                "free_running_tokens_per_s": (len(fr) - 1) / row["free_running"]["seconds"],
                "free_running_counters": row["free_running"]["counters"],
                "tokens": fr,
            })
        out.append(summary)
    ppl = out[0]["perplexity"]
    for s in out:
        s["perplexity_ratio"] = s["perplexity"] / ppl
    return out


def summarize_ideal(ideal: list[dict], dense_row: dict, context: int) -> list[dict]:
    tf = dense_row["teacher_forced"]
    scored = sorted(i for i in tf["logprob"] if i > context)
    dense_ppl = math.exp(-sum(tf["logprob"][i] for i in scored) / len(scored))
    out = []
    for row in ideal:
        if sorted(row["logprob"]) != scored:
            raise RuntimeError("ideal-selection positions differ from the engine's")
        ppl = math.exp(-sum(row["logprob"][i] for i in scored) / len(scored))
        differ = [i - context for i in scored if row["argmax"][i] != tf["argmax"][i]]
        out.append({"rule": row["rule"], "budget_tokens": row["budget_tokens"], "perplexity": ppl,
                    "perplexity_ratio": ppl / dense_ppl, "top1_agreement": 1 - len(differ) / len(scored),
                    "disagreements": differ})
        if "attention_mass" in row:
            out[-1]["attention_mass"] = row["attention_mass"]
    return out


def print_table(results: dict) -> None:
    for text in results["texts"]:
        print_text(results, text)
    pooled = results["pooled"]
    if len(results["texts"]) > 1:
        print(f"\npooled over {len(results['texts'])} texts (offsets {results['offsets']}): agreement = mean, "
              "perplexity ratio = geometric mean")
        print(f"{'mode':<26}{'budget':>7}{'top1 agree':>11}{'ppl/dense':>10}{'late: waits':>12}{'skips':>6}"
              f"{'tf s':>7}   per text (agreement / ppl ratio)")
        for r in pooled:
            per_text = ", ".join(f"{a:.1%} / {p:.3f}" for a, p in zip(r["per_text_top1_agreement"], r["per_text_perplexity_ratio"]))
            print(f"{run_label(r, results):<26}{str(r['budget_tokens'] or '-'):>7}{r['top1_agreement']:>11.2%}"
                  f"{r['perplexity_ratio']:>10.4f}{r['prefetch_waits']:>12}{r['prefetch_skips']:>6}"
                  f"{r['teacher_forced_seconds']:>7.1f}   {per_text}")
    massed = [(run_label(r, results), r) for r in pooled if "attention_mass" in r]
    massed += [(f"ideal: {r['rule']}", r) for r in results.get("pooled_ideal_selection") or [] if "attention_mass" in r]
    if len(results["texts"]) > 1 and massed:
        print("\nattention held, pooled (mean over texts, rows, layers and KV heads; worst: per layer and KV head)")
        print_mass(massed)
    goal = results["goal"]
    for r in pooled:
        if r["budget_tokens"] == goal["budget_tokens"]:
            ok = r["top1_agreement"] >= goal["agreement"] and r["perplexity_ratio"] <= goal["perplexity_ratio"]
            print(f"goal at {goal['budget_tokens']} ({run_label(r, results)}): top-1 agreement {r['top1_agreement']:.2%} >= 99%, "
                  f"perplexity {r['perplexity_ratio'] - 1:+.2%} vs dense within 1%: {'met' if ok else 'NOT met'}")


def print_text(results: dict, text: dict) -> None:
    runs = text["runs"]
    print(f"\n{results['model']}, text at offset {text['offset']}, context {results['context']} tokens, "
          f"{results['new_tokens']} new tokens, k={results['num_draft_tokens']}; scored tokens (teacher-forced): "
          f"{runs[0]['scored_tokens']}")
    head = (f"{'mode':<26}{'budget':>7}{'top1 agree':>11}{'ppl':>9}{'ppl/dense':>10}{'prefix agr':>11}"
            f"{'pos agr':>9}{'recall':>8}{'MB fetched':>11}{'accept':>8}{'late: waits':>12}{'skips':>6}{'tf s':>7}")
    print(head)
    for r in runs:
        fr = r.get("free_running_counters") or r["teacher_forced_counters"]
        tf = r["teacher_forced_counters"]
        rec = tf["prediction_recall"]
        fetched = (fr["bytes_fetched"] + fr["admission_bytes_fetched"]) / 2**20
        acc = fr["acceptance_rate"]
        print(f"{run_label(r, results):<26}{str(r['budget_tokens'] or '-'):>7}{r['top1_agreement']:>11.2%}{r['perplexity']:>9.4f}"
              f"{r['perplexity_ratio']:>10.4f}{_pct(r.get('prefix_agreement')):>11}{_pct(r.get('positionwise_agreement')):>9}"
              f"{_pct(rec):>8}{fetched:>11.1f}{_pct(acc):>8}{tf['prefetch_waits']:>12}{tf['prefetch_skips']:>6}"
              f"{r['teacher_forced_seconds']:>7.1f}")
    print("(recall, late prefetches (a layer waited for its prefetch, or skipped it) and tf s (seconds): "
          "teacher-forced pass; MB fetched and acceptance: free-running pass)")
    massed = [(run_label(r, results), r) for r in runs if "attention_mass" in r]
    massed += [(f"ideal: {r['rule']}", r) for r in text.get("ideal_selection") or [] if "attention_mass" in r]
    if massed:
        print("\nattention held (teacher-forced, dense forward's exact attention, mean over rows, layers and KV heads): "
              "the row's own top-K of the non-window blocks could hold `ideal`; the run missed `missed` of it")
        print_mass(massed)
    ideal = text.get("ideal_selection") or []
    if ideal:
        print("\nideal selection (diagnostic, no engine): every row attends to sinks + window + its own top-K blocks")
        print(f"{'rule':<8}{'budget':>7}{'top1 agree':>11}{'ppl':>9}{'ppl/dense':>10}   engine lookahead / sparse-current ppl/dense")
        engine = {(r["mode"], r["budget_tokens"]): r["perplexity_ratio"] for r in runs
                  if r["summary_kind"] == results["summary_kinds"][0]}
        for r in ideal:
            b = r["budget_tokens"]
            extra = "" if b is None else "   " + " / ".join(
                f"{engine[(mode, b)]:.4f}" if (mode, b) in engine else "-" for mode in ("lookahead", "sparse-current"))
            print(f"{r['rule']:<8}{str(b or '-'):>7}{r['top1_agreement']:>11.2%}{r['perplexity']:>9.4f}{r['perplexity_ratio']:>10.4f}{extra}")


def print_mass(massed: list[tuple[str, dict]]) -> None:
    for label, r in massed:
        m = r["attention_mass"]
        worst = ", ".join(f"L{p['layer']}h{p['kv_head']} {p['missed']:.3f}/{p['ideal']:.3f}" for p in m["worst"])
        print(f"{label:<26}{str(r['budget_tokens']):>7}  ideal {m['ideal_mean']:.3f}  "
              f"missed {m['missed_mean']:.3f}  worst (missed/ideal): {worst}")


def run_label(run: dict, results: dict) -> str:
    """The run's mode, and its summary kind when the run compares several."""
    if run["mode"] == "dense" or len(results.get("summary_kinds", ())) < 2:
        return run["mode"]
    return f"{run['mode']} ({run['summary_kind']})"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def _plot(results: dict, axes) -> None:
    """Teacher-forced agreement and perplexity ratio, pooled over the texts; free-running prefix
    agreement when there is one text."""
    ax_agree, ax_ppl = axes
    runs = results["pooled"]
    single = results["texts"][0]["runs"] if len(results["texts"]) == 1 else None
    modes = sorted({run_label(r, results) for r in runs if r["mode"] != "dense"})
    for i, mode in enumerate(modes):
        mine = [r for r in runs if run_label(r, results) == mode]
        xs = [r["budget_tokens"] for r in mine]
        ax_agree.plot(xs, [r["top1_agreement"] for r in mine], marker="o", color=f"C{i}", label=f"{mode} top-1 (teacher-forced)")
        prefix = [r for r in single or [] if run_label(r, results) == mode and "prefix_agreement" in r]
        if prefix:
            ax_agree.plot([r["budget_tokens"] for r in prefix], [r["prefix_agreement"] for r in prefix], marker="x",
                          linestyle="--", color=f"C{i}", label=f"{mode} prefix (free-running)")
        ax_ppl.plot(xs, [r["perplexity_ratio"] for r in mine], marker="o", color=f"C{i}", label=mode)
    for rule in IDEAL_RULES:
        mine = [r for r in results.get("pooled_ideal_selection") or [] if r["rule"] == rule]
        if mine:
            ax_ppl.plot([r["budget_tokens"] for r in mine], [r["perplexity_ratio"] for r in mine], marker=".",
                        linestyle=":", label=f"ideal top-K by {rule} (diagnostic)")
    if len(results["texts"]) > 1:
        ax_agree.set_title(f"mean over {len(results['texts'])} texts", fontsize=9)
        ax_ppl.set_title(f"geometric mean over {len(results['texts'])} texts", fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget tokens")
    ax_agree.axhline(GOAL_AGREEMENT, color="k", linestyle=":", linewidth=1, label="goal 99%")
    ax_agree.set_ylabel("agreement with dense")
    ax_agree.set_ylim(0, 1.02)
    ax_agree.legend(fontsize=7)
    ax_ppl.axhline(1.0, color="gray", linewidth=1)
    ax_ppl.axhline(GOAL_PPL_RATIO, color="k", linestyle=":", linewidth=1, label="goal +1%")
    ax_ppl.set_ylabel("perplexity / dense")
    ax_ppl.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
