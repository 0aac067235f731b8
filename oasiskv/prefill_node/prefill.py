"""Chunked prefill into a KV store.

Runs the target model over a prompt (in chunks of `chunk_tokens`), and as each layer finishes
its last chunk writes that layer's KV blocks to the store (the store computes the key
summaries), so transfers overlap the remaining layers. The last prompt row's queries score the
blocks of each layer to predict the decode node's first working set.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ..kvstore import DEFAULT_SUMMARY_KIND, KVLayout, pack_layer, rank_blocks, ranking_radius_weight, summarize_layer
from ..models.attention import AttentionBatch, PagedAttention, first_visible_block
from ..models.engine.stopping import request_eos_ids
from ..models.kv_cache import KVCacheSpec, PagedKVCache
from ..models.sampling import (
    SamplingParams,
    TokenLogprob,
    make_generator,
    process_logits,
    require_known_tokens,
    sample,
    token_logprobs,
)
from ..models.structured_output import GrammarState
from ..models.transformer import DecoderModel
from .cancellation import raise_if
from .prefix_cache import PrefixCache

log = logging.getLogger("oasiskv.prefill")

# Prompt positions whose logits over the vocabulary are made at once for prompt_logprobs
# (256 x 152K fp32 is 156 MB).
PROMPT_LOGITS_ROWS = 256


@dataclass
class PrefillResult:
    request_id: str
    prompt_ids: list[int]
    first_token: int
    layout: KVLayout
    # [layers, kv_heads, k] predicted top-K blocks (best first) from the last prompt row's query;
    # k may be 0 when the prompt has no blocks outside the sinks and the window.
    initial_selection: torch.Tensor
    kv_bytes_written: int
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    cached_tokens: int = 0  # the prompt's beginning taken from the prefix cache, not computed
    # When the request asked for prompt_logprobs: those of prompt tokens 1.. (ranked); token 0
    # has none, nothing coming before it.
    prompt_logprobs: list[TokenLogprob] | None = None


def kv_layout_for(model: DecoderModel, block_size: int = 16, summary_kind: str = DEFAULT_SUMMARY_KIND) -> KVLayout:
    c = model.config
    return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, next(model.parameters()).dtype, summary_kind)


def first_working_set(last_query: torch.Tensor, summaries: torch.Tensor, num_tokens: int, block_size: int,
                      excluded_head_blocks: int, excluded_tail_blocks: int, budget_blocks: int,
                      window: int | None, scale: float, radius_weight: float) -> torch.Tensor:
    """[kv_heads, k] one layer's first working set for a prompt of `num_tokens`: the top
    `budget_blocks` of [excluded_head_blocks, blocks - excluded_tail_blocks) (the decode node keeps
    its sinks and window resident anyway) by the decode node's ranking of the prompt's last query
    rows against the key summaries, best first.

    In a sliding-window layer only the blocks its first decode query (at num_tokens) may see are
    ranked, as the decode node ranks them: hidden blocks in the softmax took shares from the
    visible ones (on Gemma 3, 14 of 18 layers kept another set; a local layer's held 0.18 of the
    attention against 0.47). Where fewer are visible than k, hidden ones fill the set, last; the
    decode node drops them."""
    num_blocks = -(-num_tokens // block_size)
    start = excluded_head_blocks
    stop = max(start, num_blocks - excluded_tail_blocks)
    top_k = min(budget_blocks, stop - start)
    scores = torch.full((summaries.shape[0], max(0, stop - start)), float("-inf"))
    visible = start if window is None else min(stop, max(start, first_visible_block(num_tokens, window, block_size)))
    if visible < stop:
        scores[:, visible - start :] = rank_blocks(last_query, summaries[:, visible:stop], scale, radius_weight).float().cpu()
    return torch.topk(scores, top_k, dim=-1).indices + start


class _CapturingAttention(PagedAttention):
    """Dense paged attention that, on the final chunk, ships each layer's KV to the store and
    keeps the last row's query for the working-set prediction."""

    def __init__(self, cache, sliding_window, scale, on_layer_done):
        super().__init__(cache, sliding_window, scale)
        self.final_chunk = False
        self.on_layer_done = on_layer_done

    def attend(self, layer, q, k, v):
        out = super().attend(layer, q, k, v)
        if self.final_chunk:
            self.on_layer_done(layer, q[-1:])
        return out


_GRAMMAR_COMPILES = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")


class Prefiller:
    def __init__(self, model: DecoderModel, client, block_size: int = 16, chunk_tokens: int = 1024,
                 summary_kind: str = DEFAULT_SUMMARY_KIND, tokenizer=None, prefix_cache: PrefixCache | None = None):
        self.model = model
        self.prefix_cache = prefix_cache
        self.client = client
        self.layout = kv_layout_for(model, block_size, summary_kind)
        self.chunk_tokens = chunk_tokens
        # What min_tokens keeps the first token from being: the EOS ids the decode node stops on
        # (with no tokenizer, the model's alone).
        self.eos_token_ids = request_eos_ids(model.config, tokenizer)
        self.tokenizer = tokenizer  # a structured output's vocabulary

    @torch.inference_mode()
    def prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        budget_blocks: int = 128,
        excluded_head_blocks: int = 1,
        excluded_tail_blocks: int = 4,
        cancelled: Callable[[], bool] | None = None,
        grammar: GrammarState | None = None,
    ) -> PrefillResult:
        """Prefill `prompt_ids`, write its KV to the store under `request_id`, sample the first token.

        The initial selection ranks blocks [excluded_head_blocks, blocks - excluded_tail_blocks)
        (the decode node keeps sinks and its window resident anyway). `cancelled` is asked
        before each chunk: once it says so, the store's KV is freed and `PrefillCancelled` raised."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        model, layout = self.model, self.layout
        config = model.config
        num_tokens = len(prompt_ids)
        if any(not 0 <= t < config.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {config.vocab_size}) for this model")
        require_known_tokens(params, config.vocab_size, self.eos_token_ids)
        # `grammar`: the request's structured output, compiled by the caller (the worker, before it
        # takes its turn). Else compiled on a thread while the prompt is computed: a schema takes
        # seconds against Qwen's vocabulary.
        grammar_compile = (None if params.structured_outputs is None or grammar is not None else _GRAMMAR_COMPILES.submit(
            GrammarState.for_params, params, self.tokenizer, config.vocab_size, self.eos_token_ids))
        if num_tokens >= config.max_position_embeddings:
            raise ValueError(f"the prompt ({num_tokens} tokens) leaves no room in the model's context of "
                             f"{config.max_position_embeddings} tokens")
        num_blocks = layout.num_blocks(num_tokens)
        device = next(model.parameters()).device
        spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, layout.block_size, layout.dtype)
        cache = PagedKVCache(spec, num_blocks, device)
        table = cache.allocator.allocate(num_blocks)
        slots = torch.arange(num_tokens, device=device)  # blocks 0..n-1 in order: slot == position
        self.client.allocate(request_id, layout, num_tokens)
        cached = 0
        handles = []
        selections: dict[int, torch.Tensor] = {}

        def ship_layer(layer: int, last_query: torch.Tensor) -> None:
            keys = cache.k[layer][:, slots].transpose(0, 1)  # [tokens, kv_heads, d]
            values = cache.v[layer][:, slots].transpose(0, 1)
            handles.append(self.client.write_layer(request_id, layer, pack_layer(keys, values, layout.block_size).cpu()))
            summaries = summarize_layer(keys, layout.block_size, layout.summary_kind)  # as the store keeps them
            selections[layer] = first_working_set(
                last_query, summaries, num_tokens, layout.block_size, excluded_head_blocks, excluded_tail_blocks,
                budget_blocks, config.sliding_window[layer], config.softmax_scale,
                ranking_radius_weight(layout.summary_kind))

        backend = _CapturingAttention(cache, config.sliding_window, config.softmax_scale, ship_layer)
        prompt_logprobs = None if params.prompt_logprobs is None else []
        try:
            # A cached beginning has no logits: prompt logprobs need every position computed.
            cached = self._load_prefix(prompt_ids, cache) if prompt_logprobs is None else 0
            for start in range(cached, num_tokens, self.chunk_tokens):
                raise_if(cancelled, request_id)
                end = min(num_tokens, start + self.chunk_tokens)
                backend.final_chunk = end == num_tokens
                backend.batch = AttentionBatch.dense([table], [start], [end - start], layout.block_size, device)
                hidden = model(torch.tensor(prompt_ids[start:end], device=device), torch.arange(start, end, device=device), backend)
                if prompt_logprobs is not None:
                    prompt_logprobs += self._prompt_logprobs(hidden, prompt_ids[start + 1 : end + 1], params.prompt_logprobs)
            logits = model.compute_logits(hidden[-1:]).cpu()  # sampled with a CPU generator, as the decode node does
            generator = None if params.greedy else make_generator(params.seed)
            grammar = grammar if grammar_compile is None else grammar_compile.result()
            chosen_from = (process_logits(logits, params, prompt_ids, [], eos_token_ids=self.eos_token_ids,
                                          grammar=grammar) if params.processed else logits)
            first = sample(chosen_from, [params], [generator])[0]
            first_logprob = None if params.logprobs is None else token_logprobs(logits, [first], params.logprobs)[0]
            for handle in handles:
                handle.wait()
        except BaseException as error:
            try:
                self.client.free(request_id)
            except Exception as free_error:  # a store that is down: the caller needs the first error, not this one
                log.warning("prefill of %s stopped (%r) and its store free failed too: %r", request_id, error, free_error)
            raise
        selection = torch.stack([selections[layer] for layer in range(config.num_layers)])
        self.client.release(request_id)  # the decode node takes it over; its free reuses the memory at once
        if self.prefix_cache is not None:
            try:
                self.prefix_cache.insert(prompt_ids, cache.k, cache.v)
            except Exception as error:  # out of memory, say: the request is done all the same, its KV handed over
                log.warning("prefix cache kept nothing of %s: %r", request_id, error)
        written = num_blocks * config.num_layers * config.num_kv_heads * layout.unit_bytes
        return PrefillResult(request_id, list(prompt_ids), first, layout, selection, written, first_logprob, cached,
                             prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, next_tokens: list[int], top: int) -> list[TokenLogprob]:
        """The logprobs of `next_tokens` from the chunk's rows before them, a slice of rows at a
        time: a whole chunk's logits over the vocabulary (152K entries each for Qwen) would take
        gigabytes."""
        entries: list[TokenLogprob] = []
        for at in range(0, len(next_tokens), PROMPT_LOGITS_ROWS):
            tokens = next_tokens[at : at + PROMPT_LOGITS_ROWS]
            entries += token_logprobs(self.model.compute_logits(hidden[at : at + len(tokens)]), tokens, top, ranked=True)
        return entries

    def _load_prefix(self, prompt_ids: list[int], cache: PagedKVCache) -> int:
        """Copy the prompt's cached beginning into `cache` (slot == position); returns its tokens."""
        if self.prefix_cache is None:
            return 0
        hit = self.prefix_cache.lookup(prompt_ids)
        for layer in range(len(cache.k) if hit.tokens else 0):
            cache.k[layer][:, :hit.tokens], cache.v[layer][:, :hit.tokens] = hit.layer(layer)
        return hit.tokens
