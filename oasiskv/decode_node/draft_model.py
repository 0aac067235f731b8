"""A small draft model as the drafter, with a bounded KV cache.

The draft model keeps, per request, only its first `sink_tokens` and its most recent tokens
(a ring of `window_tokens + max_chunk` slots), so its memory does not grow with the context.
Each propose() first feeds the tokens accepted since the last call (rolling back what the target
rejected), then runs k single-token steps batched across requests.

Its compute is bounded too: a history longer than the ring (a new request's prompt) is not run
through the draft model whole. Only the sinks and the tokens the ring keeps are fed; the rest
would be evicted before the catch-up ends. Running them would be a second prefill of every
prompt on the decode node (8 requests of 8K tokens: minutes of the 0.5B model on a CPU). The
kept tokens' K/V then come from a cold start (they see the sinks and each other, not what came
before them), which can only cost acceptance: verification keeps the output exact.

Nor do many new requests' catch-ups stall the batch at once. Each call feeds every request up
to `max_chunk` tokens, plus at most `catch_up_budget` more tokens shared by all (by default one
request's whole catch-up: sinks + ring), like chunked prefill's token budget. A request still
catching up gets no drafts (its step verifies one row) while the others draft as usual. A
budget of 0 caps each request at one chunk a call (the smallest stall, but a request goes
without drafts for several steps: dense lost 11% tokens/s that way, Qwen 1.5B at 8K on CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..models.attention import PAD_POSITION, AttentionBatch, PagedAttention
from ..models.kv_cache import KVCacheSpec, PagedKVCache
from ..models.sampling import SamplingParams, make_generator, process_logits, stream_seed, target_probs
from ..models.structured_output import GrammarState
from ..models.transformer import DecoderModel
from .config import DecodeConfig
from .speculative import Draft, DrafterMismatch, NgramDrafter

log = logging.getLogger("oasiskv.decode")


@dataclass
class _DraftState:
    region: torch.Tensor  # cache slots owned by this request
    slot_positions: torch.Tensor  # position held by each slot (PAD when empty)
    fed: list[int]  # tokens whose K/V are in the ring
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None  # the request's structured output, followed through the drafts


class DraftModelDrafter:
    def __init__(self, model: DecoderModel, target_vocab_size: int, draft_tokenizer=None, target_tokenizer=None,
                 sink_tokens: int = 16, window_tokens: int = 1024, max_chunk: int = 256, max_requests: int = 32,
                 catch_up_budget: int | None = None):
        check_vocabularies(model.config.vocab_size, target_vocab_size, draft_tokenizer, target_tokenizer)
        self.model = model
        self.target_tokenizer = target_tokenizer  # a structured output's vocabulary
        self.target_vocab_size = target_vocab_size
        self.sink_tokens = sink_tokens
        self.window_tokens = window_tokens
        self.max_chunk = max_chunk
        self.ring = window_tokens + max_chunk
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.max_requests = max_requests
        self.catch_up_budget = sink_tokens + self.ring if catch_up_budget is None else catch_up_budget
        if self.catch_up_budget < 0:
            raise ValueError(f"catch_up_budget must be >= 0, got {catch_up_budget}")
        c = model.config
        dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        block_size = 16
        self.slots_per_request = -(-(sink_tokens + self.ring) // block_size) * block_size
        spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, block_size, dtype)
        self.cache = PagedKVCache(spec, max_requests * self.slots_per_request // block_size, self.device)
        self.backend = PagedAttention(self.cache, c.sliding_window, c.softmax_scale)
        self.states: dict[str, _DraftState] = {}

    @property
    def kv_bytes(self) -> int:
        """The draft model's KV cache, allocated at start-up for `max_requests` rings: fixed device
        memory beside the decode engine's pool (`kv_pool_gb` does not cover it)."""
        return self.cache.num_blocks * self.cache.spec.bytes_per_block

    def _slot(self, position: int) -> int:
        if position < self.sink_tokens:
            return position
        return self.sink_tokens + (position - self.sink_tokens) % self.ring

    def _state(self, request_id: str, params: SamplingParams, eos_token_ids=(),
               grammar: GrammarState | None = None) -> _DraftState:
        if request_id not in self.states:
            if len(self.states) >= self.max_requests:
                raise RuntimeError(f"the draft model's KV holds {self.max_requests} requests and all are in use; "
                                   f"build it with max_requests >= the engine's max_num_seqs")
            blocks = self.cache.allocator.allocate(self.slots_per_request // self.cache.block_size)
            region = (torch.tensor(blocks)[:, None] * self.cache.block_size + torch.arange(self.cache.block_size)).reshape(-1)
            seed = None if params.seed is None else stream_seed(params.seed, "draft")
            generator = None if params.greedy else make_generator(seed)
            self.states[request_id] = _DraftState(region, torch.full((len(region),), PAD_POSITION), [], generator,
                                                  self._grammar(request_id, params, eos_token_ids, grammar))
        return self.states[request_id]

    def _grammar(self, request_id: str, params: SamplingParams, eos_token_ids,
                 compiled: GrammarState | None) -> GrammarState | None:
        """Drafts under the request's spec, as the target verifies them: blind ones were mostly
        refused. `compiled`: the engine's state for it, whose compiled spec is shared. Without it,
        the spec is compiled here; without the target's tokenizer, or a spec that does not
        compile, it drafts blind."""
        if compiled is not None:
            return compiled.fresh_copy()
        if params.structured_outputs is None or self.target_tokenizer is None:
            return None
        try:
            return GrammarState.for_params(params, self.target_tokenizer, self.target_vocab_size, list(eos_token_ids))
        except ValueError as error:
            log.warning("request %s: drafting blind to its structured output: %s", request_id, error)
            return None

    @torch.inference_mode()
    def propose(self, request_ids: list[str], histories: list[list[int]], k: int, params: list[SamplingParams], *,
                prompt_lengths: list[int] | None = None, eos_token_ids=(), grammars=None) -> list[Draft]:
        if k == 0:
            return [Draft([]) for _ in histories]
        grammars = grammars or [None] * len(request_ids)
        states = [self._state(r, p, eos_token_ids, g) for r, p, g in zip(request_ids, params, grammars)]
        for state, history in zip(states, histories):
            fed = len(state.fed)
            if fed <= len(history) and history[:fed] == state.fed:  # the usual step: the history went on
                common = fed
            else:
                common = 0
                for a, b in zip(state.fed, history):
                    if a != b:
                        break
                    common += 1
            # Always leave the last token unfed: its row produces the first draft's logits.
            del state.fed[min(common, len(history) - 1) :]
        # Catch up: each request's first max_chunk tokens this call, and the shared budget
        # granted in request order (the earliest requests finish first and start drafting). A
        # request's final chunk ends at its last token, whose row gives the first draft's logits.
        logits = torch.zeros((len(states), self.target_vocab_size))
        grants, shared = [], self.catch_up_budget
        for state, history in zip(states, histories):
            extra = min(max(0, self._tokens_to_feed(state, history) - self.max_chunk), shared)
            shared -= extra
            grants.append(self.max_chunk + extra)
        while True:
            feeds = []
            for i, (state, history) in enumerate(zip(states, histories)):
                feed = []
                if len(state.fed) < len(history):
                    feed = self._next_feed(state, history, min(self.max_chunk, grants[i]))
                grants[i] -= len(feed)
                feeds.append(feed)
            if not any(feeds):
                break
            self._forward(states, feeds, logits)
        ready = [len(s.fed) == len(h) for s, h in zip(states, histories)]
        if not any(ready):
            return [Draft([]) for _ in states]
        tokens: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        # (prompt, output) of each request whose logits are processed as the target processes the
        # row it verifies a draft with (earlier drafts count as output): a draft blind to a bias
        # or a penalty was mostly rejected (a model drafting for itself had 24 of 157 accepted
        # under repetition_penalty 1.3).
        processed = [None] * len(states)
        if prompt_lengths is not None:
            processed = [(h[:n], h[n:]) if p.processed else None for h, n, p in zip(histories, prompt_lengths, params)]
        for step in range(k):
            next_tokens = []
            for i, (row, p, state) in enumerate(zip(logits, params, states)):
                if not ready[i]:
                    next_tokens.append([])
                    continue
                if processed[i] is not None:
                    prompt, output = processed[i]
                    try:
                        row = process_logits(row[None], p, prompt, output + tokens[i], eos_token_ids=eos_token_ids,
                                             grammar=state.grammar)[0]
                    except ValueError:  # the spec allows nothing here: no further drafts this step
                        ready[i] = False
                        next_tokens.append([])
                        continue
                if p.greedy:
                    token = int(row.argmax())
                else:
                    dist = target_probs(row, p)
                    token = int(torch.multinomial(dist, 1, generator=state.generator))
                    probs[i].append(dist)
                tokens[i].append(token)
                next_tokens.append([token])
            if step + 1 < k:
                self._forward(states, next_tokens, logits)
        # Draft tokens were fed for steps 0..k-2; they are rolled back next call if rejected.
        return [Draft(t, torch.stack(pr) if pr else None) for t, pr in zip(tokens, probs)]

    def _tokens_to_feed(self, state: _DraftState, history: list[int]) -> int:
        """How many tokens catching up on `history` runs through the model (skipped ones aside)."""
        keep_from = len(history) - self.ring
        fed = len(state.fed)
        if fed >= keep_from or keep_from <= self.sink_tokens:
            return len(history) - fed
        return max(0, self.sink_tokens - fed) + self.ring

    def _next_feed(self, state: _DraftState, history: list[int], allowance: int) -> list[int]:
        """The next tokens to feed: at most `allowance` (<= max_chunk), never one the ring would
        evict before the history is fed (those are skipped: see the module's docstring)."""
        keep_from = len(history) - self.ring  # the oldest position the ring holds once all is fed
        fed = len(state.fed)
        if fed < self.sink_tokens:
            end = self.sink_tokens if keep_from > self.sink_tokens else fed + allowance
            return history[fed : min(end, fed + allowance)]
        if fed < keep_from:
            state.fed.extend(history[fed:keep_from])
            # Whatever the ring held is older than what comes next; nothing of it may be seen.
            state.slot_positions[self.sink_tokens :] = PAD_POSITION
            fed = keep_from
        return history[fed : fed + allowance]

    def _forward(self, states: list[_DraftState], feeds: list[list[int]], logits_out: torch.Tensor) -> None:
        """Feed each request's tokens (possibly none); the last fed row's logits of each fed
        request go to its row of `logits_out`."""
        ids, positions, query_positions, key_slots, key_positions, writes, last_rows = [], [], [], [], [], [], []
        active = [i for i, f in enumerate(feeds) if f]
        row = 0
        for i in active:
            state, feed = states[i], feeds[i]
            start = len(state.fed)
            pos = torch.arange(start, start + len(feed))
            slots = state.region[torch.tensor([self._slot(int(p)) for p in pos])]
            state.slot_positions[torch.tensor([self._slot(int(p)) for p in pos])] = pos
            ids.extend(feed)
            positions.append(pos)
            query_positions.append(pos)
            key_slots.append(state.region)
            key_positions.append(state.slot_positions.clone())
            writes.append(slots)
            state.fed.extend(feed)
            row += len(feed)
            last_rows.append(row - 1)
        self.backend.batch = AttentionBatch.from_key_lists(query_positions, key_slots, key_positions, torch.cat(writes).to(self.device))
        hidden = self.model(torch.tensor(ids, device=self.device), torch.cat(positions).to(self.device), self.backend)
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)]).cpu()
        logits_out[torch.tensor(active)] = logits[:, : logits_out.shape[-1]]

    def release(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            blocks = (state.region[:: self.cache.block_size] // self.cache.block_size).tolist()
            self.cache.allocator.free(blocks)


def check_vocabularies(draft_vocab: int, target_vocab: int, draft_tokenizer=None, target_tokenizer=None) -> None:
    """A drafter must speak the target's token ids; refuse at start-up otherwise."""
    if draft_tokenizer is not None and target_tokenizer is not None:
        d, t = draft_tokenizer.vocab_size, target_tokenizer.vocab_size
        probe = range(0, min(d, t), max(1, min(d, t) // 512))
        mismatched = [i for i in probe if draft_tokenizer.id_to_token(i) != target_tokenizer.id_to_token(i)]
        if d != t or mismatched:
            raise DrafterMismatch(
                f"draft tokenizer ({d} tokens) does not match the target's ({t} tokens)"
                + (f"; e.g. id {mismatched[0]} is {draft_tokenizer.id_to_token(mismatched[0])!r} vs "
                   f"{target_tokenizer.id_to_token(mismatched[0])!r}" if mismatched else "")
            )
    if draft_vocab < target_vocab and draft_tokenizer is None:
        raise DrafterMismatch(f"draft model vocabulary ({draft_vocab}) is smaller than the target's ({target_vocab})")


def build_drafter(config: DecodeConfig, target: DecoderModel, target_tokenizer, dtype: torch.dtype):
    """`config.drafter` as a drafter: 'ngram' (prompt lookup), or a draft model's registry name or
    path, loaded in `dtype` on the target's device, checked against its vocabulary and shaped by
    the config's draft_window_tokens and draft_catch_up_budget, with a ring for each of the
    engine's max_num_seqs requests."""
    if config.drafter == "ngram":
        return NgramDrafter()
    from ..models.loader import load_model_dir
    from ..models.pull import resolve_model
    from ..models.tokenizer import load_tokenizer

    draft_dir = resolve_model(config.drafter, progress=False)
    draft = load_model_dir(draft_dir, dtype=dtype, device=next(target.parameters()).device)
    return DraftModelDrafter(draft, target.config.vocab_size, load_tokenizer(draft_dir), target_tokenizer,
                             window_tokens=config.draft_window_tokens, catch_up_budget=config.draft_catch_up_budget,
                             max_requests=config.max_num_seqs)
