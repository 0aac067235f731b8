"""Look-ahead accuracy: how many of the true next-step top-K blocks each predictor finds, on real
long inputs (Python standard-library source), per layer and averaged.

    python bench/lookahead_accuracy.py                  # qwen2.5-coder-0.5b, contexts 8K and 16K
    python bench/lookahead_accuracy.py --quick          # smollm2-135m, contexts 2K and 4K, 8 positions,
                                                        # budget 512 (top-K = the same share of blocks)
    python bench/lookahead_accuracy.py --model smollm2-135m   # SmolLM2 has 8K context: 4K and 8K

Method. One dense forward runs the model over the longest context (slot == position in a paged
cache, so every key of every layer stays available) and keeps the post-RoPE queries of the rows
the evaluation needs. Because attention is causal, the first 8K tokens of that pass are exactly
an 8K-token context: one pass serves every context length. Decode positions t are spread over
the last ~200 tokens before each context length (--positions of them, --stride apart).

At a decode position t the decode node verifies 1 + k rows: the last token (position t) and k
drafts (t+1..t+k). That verification pass is re-run here for real against the cached keys of
positions < t (the draft rows' K/V go to scratch slots), once per drafter:
  - perfect drafter: the drafts are the true continuation of the file;
  - n-gram drafter: `NgramDrafter` (prompt lookup) proposes from the history ids[:t+1], as the
    decode node does (when it proposes nothing the current query is used, as the node does);
  - draft model (with --draft-model, e.g. qwen2.5-coder-0.5b for the 1.5B target): the decode
    node's `DraftModelDrafter` (bounded KV: sinks + window) proposes greedily from the same history.

Predictors, each the top-K (K = budget / 16 blocks, per layer and KV head) of `score_blocks`
(the decode node's ranking, `rank_blocks`: per query head, the softmax over the candidate
blocks of scale * (q.center + 0.2 |q|.radius) of their min/max key summary, the query rows
averaged first, summed over the query heads of the KV group). These rows use `minmax`
summaries; the node's default, `moments`, is in the *_moments rows below:
  - lookahead_perfect / lookahead_ngram / lookahead_draft_model: the draft rows' queries of that
    drafter's pass;
  - current: the query at position t (row 0; what `sparse-current` uses);
  - oracle_ranking: the target query itself through the ranking (the best any summary-based
    predictor with this ranking can do; it isolates the ranking's loss from the prediction's);
  - perfect_first_draft (diagnostic): the first true draft row alone;
  - lookahead_perfect_linear: the previous rule, the logits q.center + 0.4 |q|.radius summed
    over the group's heads without a softmax;
  - lookahead_perfect_bound: the rule before that, the min/max upper bound itself (radius
    weight 1), each block's best row.
Ceilings and what a richer summary would buy (diagnostics, not in the decode node):
  - lookahead_perfect_exact_keys / current_exact_keys: the same queries' exact attention over
    every key (< t), as if all keys were resident: the best any predictor from these queries can
    do, whatever the summary. The gap to 100% is the prediction's; the gap to the summary-based
    row is the summary's;
  - lookahead_perfect_sketch1 / _sketch2: attention over keys rebuilt from the min/max box plus
    1 or 2 bits per key element (which half / quarter of the box each value lies in). 1 bit
    costs 16 x d bits per block and KV head on top of the box: 1.5x the bf16 summary bytes; 2
    bits double them.
The default summary kind (`KVLayout.summary_kind = "moments"`: mean +- std per element, the
same bytes as min/max), ranked by the same rule with its radius weight (0.5):
  - lookahead_perfect_moments / lookahead_ngram_moments / current_moments (and
    lookahead_draft_model_moments).

Truth (the set to recall), per layer and KV head:
  - exact: top-K blocks by the exact attention weights of the true query at the target position
    (softmax over every key up to it), summed over the query heads of the KV group and over the
    block's tokens;
  - ranking: top-K by the min/max ranking of that true query (what a decode node on min/max
    summaries would select with the real next query; the definition its `prediction_recall`
    counter uses);
  - mass (not a set recall): the exact attention mass the predicted blocks hold, as a share of
    the mass the exact top-K holds (how much of what matters a predictor keeps).
Targets: next_token = position t+1 (the next query if one token is emitted); next_step =
position t+1+a, where a is the number of n-gram drafts that match the true continuation (the
query the engine's next step really runs); with --draft-model also next_step_draft_model, the
same with the draft model's accepted drafts.

Candidates exclude the sink (first block) and the decode node's window (the 4 newest blocks at
step t) from both sets, as the decode node does (blocks leaving the window between two steps
stay resident there, so they are not counted either way). Recall = |truth & prediction| /
|truth|, averaged over KV heads, then over positions (the per-layer figures) and layers.

Reference: the paper reports 98.74% (look-ahead) vs 83.9% (current query); the goal is >= 98.7%.
Writes bench/results/lookahead_accuracy_<model>.json and a PNG.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# Shared 2-core machine: OpenMP threads that spin while other processes hold the cores made
# every step 10-50x slower here (measured); passive waiting keeps timings meaningful.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from oasiskv.decode_node.lookahead import recall, score_blocks, top_blocks  # noqa: E402
from oasiskv.decode_node.config import DecodeConfig  # noqa: E402
from oasiskv.decode_node.draft_model import build_drafter  # noqa: E402
from oasiskv.decode_node.speculative import DrafterMismatch, NgramDrafter  # noqa: E402
from oasiskv.kvstore import (  # noqa: E402
    block_scores,
    narrow_summaries,
    quantize_summaries,
    ranking_radius_weight,
    summarize_layer,
)
from oasiskv.models.attention import AttentionBatch, PagedAttention, first_visible_block  # noqa: E402
from oasiskv.models.errors import ModelError  # noqa: E402
from oasiskv.models.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from oasiskv.models.sampling import SamplingParams  # noqa: E402

from bench.common import at_least, grouped_bar_positions, real_text_token_ids, token_counts, write_results  # noqa: E402

BLOCK = 16
PAPER = {"lookahead": 0.9874, "current": 0.839}
GOAL = 0.987
PREDICTORS = ("lookahead_perfect", "lookahead_ngram", "current", "oracle_ranking", "perfect_first_draft",
              "lookahead_perfect_linear", "lookahead_perfect_bound", "lookahead_perfect_exact_keys",
              "current_exact_keys", "lookahead_perfect_sketch1", "lookahead_perfect_sketch2",
              "lookahead_perfect_moments", "lookahead_ngram_moments", "current_moments")
DRAFT_MODEL_PREDICTORS = ("lookahead_draft_model", "lookahead_draft_model_moments")
TRUTHS = ("exact", "ranking", "mass")
LINEAR_RADIUS_WEIGHT = 0.4  # the best weight for the linear rule, measured
MINMAX_WEIGHT = ranking_radius_weight("minmax")


def default_contexts(model: str, quick: bool) -> list[int]:
    if quick:
        return [2048, 4096]
    if model.startswith("smollm2"):
        return [4096, 8192]  # SmolLM2's context is 8K
    return [8192, 16384]


# ---------------------------------------------------------------------------------------------
# Shared with sparse_quality.py and decode_throughput.py: a dense pass that keeps the whole KV.
# ---------------------------------------------------------------------------------------------
class CapturingAttention(PagedAttention):
    """Dense paged attention that keeps the post-RoPE queries of chosen rows of each forward."""

    def __init__(self, cache, sliding_window, scale, num_layers: int):
        super().__init__(cache, sliding_window, scale)
        self.keep: torch.Tensor | None = None  # rows of the current forward to keep
        self.kept: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def attend(self, layer, q, k, v):
        out = super().attend(layer, q, k, v)
        if self.keep is not None:
            self.kept[layer].append(q[self.keep].float().clone())
        return out

    def take(self) -> torch.Tensor:
        """[layers, rows, heads, head_dim] of everything kept since the last take()."""
        out = torch.stack([torch.cat(rows) for rows in self.kept])
        self.kept = [[] for _ in self.kept]
        return out


class DenseContext:
    """One dense forward over `ids`, keeping the whole KV (block table = identity, so slot ==
    position), the queries and final hidden states of `keep_positions`; and verification passes
    of a few rows at any position t against the keys of positions < t."""

    def __init__(self, model, ids: list[int], keep_positions, chunk_tokens: int = 1024, scratch_tokens: int = 32,
                 progress: tqdm | None = None, summary_dtype: torch.dtype = torch.bfloat16):
        config = model.config
        self.model = model
        self.summary_dtype = summary_dtype
        self.ids = list(ids)
        self.dtype = next(model.parameters()).dtype
        # The model's device: the cache, the batch and every index tensor of a forward live there.
        self.device = device = next(model.parameters()).device
        n = len(ids)
        self.num_blocks = -(-n // BLOCK)
        total_blocks = self.num_blocks + -(-scratch_tokens // BLOCK)
        spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK, self.dtype)
        self.cache = PagedKVCache(spec, total_blocks, device)
        self.table = list(range(total_blocks))
        self.scratch = self.num_blocks * BLOCK
        self.backend = CapturingAttention(self.cache, config.sliding_window, config.softmax_scale, config.num_layers)
        keep = sorted({int(p) for p in keep_positions})
        hidden_rows = []
        with torch.inference_mode():
            for start in range(0, n, chunk_tokens):
                end = min(n, start + chunk_tokens)
                rows = [p - start for p in keep if start <= p < end]
                self.backend.keep = torch.tensor(rows, dtype=torch.long, device=device) if rows else None
                self.backend.batch = AttentionBatch.dense([self.table], [start], [end - start], BLOCK, device)
                hidden = model(torch.tensor(ids[start:end], device=device), torch.arange(start, end, device=device),
                               self.backend)
                if rows:
                    hidden_rows.append(hidden[rows].clone())
                if progress is not None:
                    progress.update(end - start)
        self.backend.keep = None
        queries = self.backend.take() if keep else None
        self.queries = {p: queries[:, i] for i, p in enumerate(keep)}  # p -> [layers, heads, d]
        hidden = torch.cat(hidden_rows) if keep else None
        self.hidden = {p: hidden[i] for i, p in enumerate(keep)}  # p -> [hidden]

    @torch.inference_mode()
    def verify(self, t: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `tokens` at positions t.. against the cached keys < t: (queries [layers, rows,
        heads, d], logits [rows, vocab])."""
        rows, device = len(tokens), self.device
        positions = torch.arange(t, t + rows, device=device)
        scratch = self.scratch + torch.arange(rows, device=device)
        slots = torch.cat((torch.arange(t, device=device), scratch))
        key_positions = torch.cat((torch.arange(t, device=device), positions))
        self.backend.batch = AttentionBatch.from_key_lists([positions], [slots], [key_positions], scratch)
        self.backend.keep = torch.arange(rows, device=device)
        hidden = self.model(torch.tensor(tokens, device=device), positions, self.backend)
        self.backend.keep = None
        return self.backend.take(), self.model.compute_logits(hidden)

    def keys(self, layer: int, end: int) -> torch.Tensor:
        """[kv_heads, end, d] keys of positions < end."""
        return self.cache.k[layer][:, :end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        return self.cache.v[layer][:, :end]

    def summaries(self, layer: int, end: int, dtype: torch.dtype | None = None, kind: str = "minmax") -> torch.Tensor:
        """[kv_heads, blocks, 2, d] key summaries (of `kind`) of positions < end, as the decode
        node sees them: read from the store in `dtype` (default summary_dtype; rounded outward),
        widened to float32. uint8: coded over these blocks' ranges (the node codes the prompt's)."""
        exact = summarize_layer(self.keys(layer, end).transpose(0, 1), BLOCK, kind)
        dtype = dtype or self.summary_dtype
        if dtype == torch.uint8:  # the codes' values: they rank as codes times steps do (QuantizedSummaries)
            return quantize_summaries(exact.unsqueeze(0)).dequantize()[0]
        return narrow_summaries(exact, dtype).float()

    def packed_kv(self, num_blocks: int) -> torch.Tensor:
        """[layers, blocks, kv_heads, 2, block_size, d] of blocks < num_blocks: the store's unit
        layout, in host memory (what the store is written from and NIXL registers)."""
        layers = []
        for k, v in zip(self.cache.k, self.cache.v):
            kv = torch.stack((k[:, : num_blocks * BLOCK], v[:, : num_blocks * BLOCK]), dim=1)  # [h, 2, T, d]
            h, _, _, d = kv.shape
            layers.append(kv.view(h, 2, num_blocks, BLOCK, d).permute(2, 0, 1, 3, 4).cpu())
        return torch.stack(layers).contiguous()


def block_attention_mass(q: torch.Tensor, keys: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Exact attention of one query row. q [heads, d] at position keys.shape[1] - 1; keys
    [kv_heads, L, d] -> [kv_heads, ceil(L / 16)] attention mass per block, summed over the query
    heads of each KV group and the block's tokens."""
    kv_heads, length, d = keys.shape
    group = q.shape[0] // kv_heads
    logits = torch.matmul(q.float().view(kv_heads, group, d), keys.float().transpose(-1, -2)) * scale
    if window is not None and length > window:
        logits[..., : length - window] = float("-inf")
    mass = torch.softmax(logits, dim=-1).sum(dim=1)  # [kv_heads, L]
    blocks = -(-length // BLOCK)
    mass = torch.nn.functional.pad(mass, (0, blocks * BLOCK - length))
    return mass.view(kv_heads, blocks, BLOCK).sum(-1)


def candidate_mask(t: int, sink_blocks: int, window_blocks: int, sliding_window: int | None = None) -> torch.Tensor:
    """Blocks a decode step at position t may select: not sinks, not in its window (the
    `window_blocks` newest blocks, the partly filled one included), and in a sliding-window
    layer not before the first block its query at t may see, as the decode node ranks them
    (`WorkingSet.first_candidate_block`). Hidden blocks carry no attention: as candidates they
    filled the true top-K with ties and took predictions' slots (Gemma 3: 55% of the truth)."""
    tail = t // BLOCK
    window_start = max(sink_blocks, tail - window_blocks + 1)
    first = sink_blocks if sliding_window is None else max(sink_blocks, first_visible_block(t, sliding_window, BLOCK))
    mask = torch.zeros(window_start, dtype=torch.bool)
    mask[first:] = True
    return mask


def load_llm(name: str, dtype: str = "float32", device: str = "cpu"):
    from oasiskv.models.engine import LLM

    return LLM(name, dtype=dtype, kv_cache_gb=0.05, device=device)


# ---------------------------------------------------------------------------------------------
def linear_scores(queries: torch.Tensor, summaries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The decode node's previous rule: q.center + 0.4 |q|.radius summed over the group's query
    heads (no softmax), the mean over rows."""
    scores = block_scores(queries, summaries, LINEAR_RADIUS_WEIGHT).mean(dim=0)
    return scores.masked_fill(~candidates[None, :], float("-inf"))


def bound_max_scores(queries: torch.Tensor, summaries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The decode node's first rule: the min/max upper bound, each block's best row."""
    scores = block_scores(queries, summaries).amax(dim=0)
    return scores.masked_fill(~candidates[None, :], float("-inf"))


def sketch_keys(keys: torch.Tensor, summaries: torch.Tensor, bits: int) -> torch.Tensor:
    """Keys [kv_heads, blocks * 16, d] as a summary with `bits` per key element would rebuild them:
    each element is the middle of the 2**bits equal slices of its block's [min, max] box
    (`summaries` [kv_heads, blocks, 2, d]) that it lies in."""
    kv_heads, length, d = keys.shape
    blocks = summaries.shape[1]
    per_block = keys.float().view(kv_heads, blocks, BLOCK, d)
    lo, hi = summaries[:, :, None, 0], summaries[:, :, None, 1]
    levels = 2 ** bits
    step = (hi - lo) / levels
    slice_index = ((per_block - lo) / step.clamp_min(1e-30)).floor().clamp(0, levels - 1)
    return (lo + (slice_index + 0.5) * step).view(kv_heads, length, d)


def rows_block_mass(queries: torch.Tensor, keys: torch.Tensor, scale: float, candidates: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """queries [rows, heads, d], keys [kv_heads, L, d] -> [kv_heads, blocks]: the rows' mean attention
    mass per block (summed over each group's heads). With `candidates` ([blocks] bool, L = 16 x
    blocks) the softmax runs over the candidate blocks' keys only, as a node holding only their
    summaries would compute it; non-candidates get -inf."""
    if candidates is None:
        return torch.stack([block_attention_mass(row, keys, scale) for row in queries]).mean(dim=0)
    kv_heads, _, d = keys.shape
    q = queries.float().view(queries.shape[0], kv_heads, -1, d)
    logits = torch.einsum("rhgd,hld->rhgl", q, keys.float()) * scale
    logits = logits.masked_fill(~candidates.repeat_interleave(BLOCK), float("-inf"))
    mass = torch.softmax(logits, dim=-1).sum(dim=2).mean(dim=0)  # [kv_heads, L]
    mass = mass.view(kv_heads, -1, BLOCK).sum(-1)
    return mass.masked_fill(~candidates, float("-inf"))


def accepted_prefix(drafts: list[int], truth: list[int]) -> int:
    """How many drafts greedy verification accepts: the prefix that matches the true tokens."""
    accepted = 0
    for draft, true in zip(drafts, truth):
        if draft != true:
            break
        accepted += 1
    return accepted


def caught_up_drafts(draft_model, history: list[int], k: int) -> list[int]:
    """The draft model's greedy drafts once it has caught up on `history` (a request catching up
    gets none while it feeds one chunk a call, as in the decode node)."""
    if k == 0:
        return []
    for _ in range(len(history) // draft_model.max_chunk + 2):
        tokens = draft_model.propose(["bench"], [history], k, [SamplingParams()])[0].tokens
        if tokens:
            return tokens
    raise RuntimeError("the draft model proposed nothing after catching up")


def evaluate_position(ctx: DenseContext, t: int, k: int, top_k: int, sinks: int, window: int, drafter: NgramDrafter,
                      scale: float, sliding_window, draft_model=None) -> dict:
    ids = ctx.ids
    truth_tokens = ids[t + 1 : t + 1 + k]
    perfect_q, _ = ctx.verify(t, [ids[t]] + truth_tokens)
    ngram = drafter.propose(["bench"], [ids[: t + 1]], k)[0].tokens
    ngram_q, _ = ctx.verify(t, [ids[t]] + ngram)
    accepted = accepted_prefix(ngram, truth_tokens)
    targets = {"next_token": t + 1, "next_step": t + 1 + accepted}
    predictor_names = PREDICTORS
    if draft_model is not None:
        drafted = caught_up_drafts(draft_model, ids[: t + 1], k)
        drafted_q, _ = ctx.verify(t, [ids[t]] + drafted)
        drafted_accepted = accepted_prefix(drafted, truth_tokens)
        targets["next_step_draft_model"] = t + 1 + drafted_accepted
        predictor_names = PREDICTORS + DRAFT_MODEL_PREDICTORS
    num_layers = perfect_q.shape[0]
    out = {f"{truth}/{target}/{pred}": [] for truth in TRUTHS for target in targets for pred in predictor_names}
    for layer in range(num_layers):
        candidates = candidate_mask(t, sinks, window, sliding_window[layer])
        summaries = ctx.summaries(layer, candidates.numel() * BLOCK, kind="minmax")
        keys_before_t = ctx.keys(layer, t)
        candidate_keys = ctx.keys(layer, candidates.numel() * BLOCK)
        predictions = {
            "lookahead_perfect": top_blocks(score_blocks(perfect_q[layer, 1:], summaries, candidates, scale, MINMAX_WEIGHT), top_k),
            "lookahead_ngram": top_blocks(score_blocks(ngram_q[layer, 1:] if ngram else ngram_q[layer, :1], summaries,
                                                       candidates, scale, MINMAX_WEIGHT), top_k),
            "current": top_blocks(score_blocks(perfect_q[layer, :1], summaries, candidates, scale, MINMAX_WEIGHT), top_k),
            # Diagnostic: the first true draft row alone (no vote among rows).
            "perfect_first_draft": top_blocks(score_blocks(perfect_q[layer, 1:2], summaries, candidates, scale, MINMAX_WEIGHT), top_k),
            # The previous rules, for comparison: logits summed over the group without a softmax;
            # the upper bound itself, each block's best row.
            "lookahead_perfect_linear": top_blocks(linear_scores(perfect_q[layer, 1:], summaries, candidates), top_k),
            "lookahead_perfect_bound": top_blocks(bound_max_scores(perfect_q[layer, 1:], summaries, candidates), top_k),
        }
        for name, rows in (("lookahead_perfect_exact_keys", perfect_q[layer, 1:]), ("current_exact_keys", perfect_q[layer, :1])):
            mass = rows_block_mass(rows, keys_before_t, scale)[:, : candidates.numel()]
            predictions[name] = top_blocks(mass.masked_fill(~candidates[None], float("-inf")), top_k)
        moments = ctx.summaries(layer, candidates.numel() * BLOCK, kind="moments")
        weight = ranking_radius_weight("moments")
        for name, rows in (("lookahead_perfect_moments", perfect_q[layer, 1:]),
                           ("lookahead_ngram_moments", ngram_q[layer, 1:] if ngram else ngram_q[layer, :1]),
                           ("current_moments", perfect_q[layer, :1])):
            predictions[name] = top_blocks(score_blocks(rows, moments, candidates, scale, weight), top_k)
        if draft_model is not None:
            rows = drafted_q[layer, 1:] if drafted else drafted_q[layer, :1]
            predictions["lookahead_draft_model"] = top_blocks(
                score_blocks(rows, summaries, candidates, scale, MINMAX_WEIGHT), top_k)
            predictions["lookahead_draft_model_moments"] = top_blocks(
                score_blocks(rows, moments, candidates, scale, weight), top_k)
        for bits in (1, 2):
            sketched = sketch_keys(candidate_keys, summaries, bits)
            predictions[f"lookahead_perfect_sketch{bits}"] = top_blocks(
                rows_block_mass(perfect_q[layer, 1:], sketched, scale, candidates), top_k)
        for target, p in targets.items():
            true_q = ctx.queries[p][layer]
            mass = block_attention_mass(true_q, ctx.keys(layer, p + 1), scale, sliding_window[layer])
            mass = mass[:, : candidates.numel()].masked_fill(~candidates[None], 0.0)
            truths = {"exact": top_blocks(mass.masked_fill(~candidates[None], float("-inf")), top_k),
                      "ranking": top_blocks(score_blocks(true_q[None], summaries, candidates, scale, MINMAX_WEIGHT), top_k)}
            preds = {**predictions, "oracle_ranking": truths["ranking"]}
            for truth, actual in truths.items():
                for name, predicted in preds.items():
                    out[f"{truth}/{target}/{name}"].append(recall(predicted, actual))
            best = float(mass.gather(1, truths["exact"]).sum())
            for name, predicted in preds.items():
                # Share of the true top-K's attention mass that the predicted blocks hold.
                out[f"mass/{target}/{name}"].append(float(mass.gather(1, predicted).sum()) / best if best > 0 else 1.0)
    row = {"t": t, "ngram_drafts": len(ngram), "ngram_accepted": accepted, "recall": out}
    if draft_model is not None:
        row.update(draft_model_drafts=len(drafted), draft_model_accepted=drafted_accepted)
    return row


def run_context(ctx: DenseContext, context: int, args, scale: float, sliding_window, bar, draft_model=None) -> dict:
    k = args.num_draft_tokens
    top_k = args.budget_tokens // BLOCK
    drafter = NgramDrafter()
    rows = []
    for t in positions_for(context, args.positions, args.stride, k):
        rows.append(evaluate_position(ctx, t, k, top_k, args.sink_blocks, args.window_blocks, drafter, scale,
                                      sliding_window, draft_model))
        bar.update(1)
    keys = rows[0]["recall"].keys()
    per_layer = {key: [statistics.fmean(r["recall"][key][layer] for r in rows) for layer in range(len(rows[0]["recall"][key]))]
                 for key in keys}
    mean = {key: statistics.fmean(values) for key, values in per_layer.items()}
    per_position = {key: [statistics.fmean(r["recall"][key]) for r in rows] for key in keys}
    proposed = sum(r["ngram_drafts"] for r in rows)
    extra = {}
    if draft_model is not None:
        extra["draft_model_acceptance"] = (sum(r["draft_model_accepted"] for r in rows)
                                           / max(1, sum(r["draft_model_drafts"] for r in rows)))
    return {
        "context": context,
        "positions": [r["t"] for r in rows],
        "candidate_blocks": int(candidate_mask(rows[-1]["t"], args.sink_blocks, args.window_blocks).sum()),
        "ngram_acceptance": sum(r["ngram_accepted"] for r in rows) / proposed if proposed else None,
        "ngram_no_draft_fraction": sum(r["ngram_drafts"] == 0 for r in rows) / len(rows),
        "recall_mean": mean,
        "recall_median_over_positions": {key: statistics.median(v) for key, v in per_position.items()},
        "recall_min_over_positions": {key: min(v) for key, v in per_position.items()},
        "recall_per_layer": per_layer,
        **extra,
    }


def trivial_context(context: int, args) -> str | None:
    """Why `context` cannot measure recall with these arguments, or None. Where the top-K holds
    every candidate block, every predictor's recall is 100% and the goal reads as met (a
    1,024-token context at the default 2,048-token budget did)."""
    positions = positions_for(context, args.positions, args.stride, args.num_draft_tokens)
    if positions[0] < 1:
        return (f"context {context} is too short for {args.positions} positions {args.stride} tokens apart "
                f"and {args.num_draft_tokens} drafts")
    candidates = int(candidate_mask(positions[0], args.sink_blocks, args.window_blocks).sum())
    top_k = args.budget_tokens // BLOCK
    if candidates <= top_k:
        return (f"context {context}: its first position has {candidates} candidate blocks (past {args.sink_blocks} "
                f"sink and {args.window_blocks} window blocks), and the top-{top_k} of --budget-tokens "
                f"{args.budget_tokens} would hold them all, so every recall would be 100%; use a longer context "
                "or a smaller budget")
    return None


def positions_for(context: int, count: int, stride: int, k: int) -> list[int]:
    """`count` decode positions, `stride` apart, ending k + 2 tokens before `context` (so every
    target query and true draft lies inside the context)."""
    last = context - k - 2
    return [last - stride * (count - 1 - i) for i in range(count)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default qwen2.5-coder-0.5b (--quick: smollm2-135m)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths in tokens")
    parser.add_argument("--positions", type=at_least(1), default=None, help="decode positions per context (default 24, quick 8)")
    parser.add_argument("--stride", type=at_least(1), default=8, help="tokens between decode positions")
    parser.add_argument("--budget-tokens", type=at_least(BLOCK), default=None, help="default 2048 (--quick: 512, so top-K stays "
                        "a similar share of the shorter contexts' blocks)")
    parser.add_argument("--num-draft-tokens", type=at_least(1), default=3,
                        help="drafts per step (at least 1: look-ahead predicts from the draft rows)")
    parser.add_argument("--draft-model", default=None,
                        help="also predict from a draft model's drafts (registry name or path sharing the target's "
                             "tokenizer, e.g. qwen2.5-coder-0.5b for --model qwen2.5-coder-1.5b)")
    parser.add_argument("--summary-dtype", default=DecodeConfig().summary_read_dtype, choices=["float32", "bfloat16", "uint8"],
                        help="the dtype the decode node reads key summaries in (DecodeConfig.summary_read_dtype)")
    parser.add_argument("--sink-blocks", type=at_least(0), default=1)
    parser.add_argument("--window-blocks", type=at_least(1), default=4)
    parser.add_argument("--offset", type=at_least(0), default=0, help="start of the text, in lines / 37 (bench.common)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    args.model = args.model or ("smollm2-135m" if args.quick else "qwen2.5-coder-0.5b")
    if args.positions is None:
        args.positions = 8 if args.quick else 24
    if args.budget_tokens is None:
        args.budget_tokens = 512 if args.quick else 2048
    if args.budget_tokens % BLOCK:
        parser.error(f"--budget-tokens must be a multiple of the block size {BLOCK}, got {args.budget_tokens}")
    try:
        contexts = token_counts(args.contexts) if args.contexts else default_contexts(args.model, args.quick)
    except argparse.ArgumentTypeError as error:
        parser.error(f"--contexts: {error}")
    for context in contexts:
        problem = trivial_context(context, args)
        if problem:
            parser.error(problem)

    started = time.perf_counter()
    llm = load_llm(args.model, args.dtype)
    model = llm.model
    if max(contexts) > llm.max_model_len:
        parser.error(f"context {max(contexts)} exceeds {args.model}'s {llm.max_model_len} tokens")
    try:
        ids = real_text_token_ids(llm, max(contexts), offset=args.offset)
    except ValueError as error:
        parser.error(f"--offset {args.offset}: {error}")
    # Loaded before the long dense pass, so a draft model that cannot serve this target fails at once.
    try:
        draft_model = (build_drafter(DecodeConfig(drafter=args.draft_model), model, llm.tokenizer,
                                     next(model.parameters()).dtype) if args.draft_model else None)
    except (DrafterMismatch, ModelError) as error:
        parser.error(f"--draft-model {args.draft_model}: {error}")
    k = args.num_draft_tokens
    keep = {p for c in contexts for t in positions_for(c, args.positions, args.stride, k) for p in range(t, t + k + 2)}
    with tqdm(total=len(ids), desc="dense pass (keeps all KV)", unit="tok") as bar:
        ctx = DenseContext(model, ids, keep, progress=bar, summary_dtype=getattr(torch, args.summary_dtype))
    forward_s = time.perf_counter() - started
    results = {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "budget_tokens": args.budget_tokens, "top_k_blocks": args.budget_tokens // BLOCK,
        "num_draft_tokens": k, "summary_dtype": args.summary_dtype, "sink_blocks": args.sink_blocks, "window_blocks": args.window_blocks,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "reference_paper": PAPER, "goal": GOAL,
        "dense_pass_s": forward_s, "draft_model": args.draft_model, "contexts": [],
    }
    config = model.config
    with tqdm(total=len(contexts) * args.positions, desc="decode positions") as bar:
        for c in contexts:
            results["contexts"].append(run_context(ctx, c, args, config.softmax_scale, config.sliding_window, bar,
                                                   draft_model))
    results["total_s"] = time.perf_counter() - started
    print_table(results)
    write_results(Path(args.out), f"lookahead_accuracy_{args.model}", results, plot=_plot)
    return 0


def predictors_of(results: dict) -> tuple[str, ...]:
    return PREDICTORS + (DRAFT_MODEL_PREDICTORS if results.get("draft_model") else ())


def print_table(results: dict) -> None:
    print(f"\nrecall of the true top-{results['top_k_blocks']} blocks (budget {results['budget_tokens']} tokens), "
          f"{results['model']}, k={results['num_draft_tokens']} drafts; mean over layers and positions")
    cols = ("exact/next_token", "exact/next_step", "ranking/next_token", "ranking/next_step", "mass/next_token")
    if results.get("draft_model"):
        cols += ("exact/next_step_draft_model",)
    for row in results["contexts"]:
        acc = row["ngram_acceptance"]
        print(f"\ncontext {row['context']} tokens, {len(row['positions'])} positions, {row['candidate_blocks']} candidate "
              f"blocks; n-gram acceptance {acc if acc is None else f'{acc:.0%}'}, no draft at "
              f"{row['ngram_no_draft_fraction']:.0%} of positions"
              + (f"; draft model {results['draft_model']} acceptance {row['draft_model_acceptance']:.0%}"
                 if results.get("draft_model") else ""))
        widths = [max(20, len(c) + 2) for c in cols]
        print(f"  {'predictor':<30}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths)) + f"{'min/pos (exact nt)':>20}")
        for pred in predictors_of(results):
            cells = "".join(f"{row['recall_mean'][f'{c}/{pred}']:>{w}.2%}" for c, w in zip(cols, widths))
            worst = row["recall_min_over_positions"][f"exact/next_token/{pred}"]
            print(f"  {pred:<30}{cells}{worst:>20.2%}")
        look = row["recall_mean"]["exact/next_token/lookahead_perfect"]
        cur = row["recall_mean"]["exact/next_token/current"]
        print(f"  lookahead/current (exact, next token): {look / cur:.3f}x; paper {PAPER['lookahead']:.2%} vs "
              f"{PAPER['current']:.1%}; goal >= {GOAL:.1%}: {'met' if look >= GOAL else 'NOT met'} (perfect drafter)")


def _plot(results: dict, axes) -> None:
    ax_layers, ax_bars = axes
    last = results["contexts"][-1]
    predictors = predictors_of(results)
    colors = distinct_colors(len(predictors))
    for pred, color in zip(predictors, colors):
        values = last["recall_per_layer"][f"exact/next_token/{pred}"]
        ax_layers.plot(range(len(values)), values, marker=".", label=pred, color=color)
    ax_layers.set_title(f"per layer, context {last['context']} (exact, next token)")
    ax_layers.set_xlabel("layer")
    ax_layers.set_ylabel("recall of true top-K")
    ax_layers.legend(fontsize=7)
    width, positions = grouped_bar_positions(len(predictors), len(results["contexts"]))
    for i, (pred, xs, color) in enumerate(zip(predictors, positions, colors)):
        ax_bars.bar(xs, [r["recall_mean"][f"exact/next_token/{pred}"] for r in results["contexts"]], width, label=pred,
                    color=color)
        ax_bars.scatter(xs, [r["recall_mean"][f"mass/next_token/{pred}"] for r in results["contexts"]], marker="_",
                        s=200, color="k", zorder=3, label="attention mass held" if i == 0 else None)
    ax_bars.axhline(PAPER["lookahead"], color="k", linestyle="--", linewidth=1, label="paper look-ahead")
    ax_bars.axhline(PAPER["current"], color="gray", linestyle=":", linewidth=1, label="paper current")
    ax_bars.set_xticks(range(len(results["contexts"])), [str(r["context"]) for r in results["contexts"]])
    ax_bars.set_xlabel("context tokens")
    ax_bars.set_ylim(0, 1.45)
    ax_bars.set_title("mean over layers, next token (bars: recall of the exact top-K)")
    ax_bars.legend(fontsize=6, loc="upper center", ncol=3)


def distinct_colors(count: int) -> list:
    """`count` distinct colors (the default cycle repeats after 10)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return [cmap(i % 20) for i in range(count)]


if __name__ == "__main__":
    sys.exit(main())
