"""The decode engine: continuous batching of requests whose prompt KV lives in a store.

A request arrives as a `PrefillResult` (first token, store descriptor, predicted first working
set). It is admitted when its working-set rows fit the device pool: its first working set is
read from its store while the running batch decodes, and it joins the batch once that has
landed. Then every step verifies
`1 + k` rows per request (the last token and k drafts) over its working set, emits the accepted
tokens, writes completed blocks back to the store (sparse modes) and finally frees everything
in the pool and the store.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kvstore import DEFAULT_SUMMARY_KIND, KVStoreError, StoreTimeout, ranking_radius_weight, summarize_keys
from ..kvstore.summary import summary_read_dtype
from ..models.device import require_device
from ..models.engine.scheduler import RequestTooLarge
from ..models.engine.stopping import OutputText, finish_reason, request_eos_ids, stop_reason, visible_text
from ..models.sampling import (
    SamplingParams,
    TokenLogprob,
    make_generator,
    process_logits,
    require_known_tokens,
    stream_seed,
    token_logprobs,
)
from ..models.structured_output import COMPILE_LIMIT_S, GrammarState
from ..models.transformer import DecoderModel
from .attention import SparseAttention, StepRequest
from .config import DecodeConfig
from .counters import DecodeCounters
from .io_thread import FetchHandle, IOThreadClient, transfer_ended
from .lookahead import PlanRequest, plan_replacements_many
from .speculative import Draft, Drafter, NgramDrafter, verify
from .summary_pages import SummaryPages
from .working_set import DevicePool, RowPlan, WorkingSet, plan_rows

log = logging.getLogger("oasiskv.decode")

# How long a step with nothing to decode waits for the store (admissions' reads, write-backs,
# rows in quarantine) before it returns. Admissions: requests that arrived together start as
# one batch, and one store that does not answer holds the others up no longer than this.
IDLE_WAIT_S = 0.2
# How long a request's structured output may take to compile here before the request fails: the
# API refuses a spec that took over COMPILE_LIMIT_S there, and this worker's load may differ.
GRAMMAR_COMPILE_TIMEOUT_S = 3 * COMPILE_LIMIT_S
# How long a finish waits for its store free to be answered (a healthy store answers in about a
# millisecond) before its final output goes out anyway: the most a store that does not answer
# holds up the decode loop per finished request.
FREE_ANSWER_WAIT_S = 0.5


@dataclass
class WriteBack:
    """A write-back in flight and the pool rows (ring rows) it reads from."""

    handle: object
    rows: set[int]


@dataclass
class Admission:
    """A request's first reads, in flight on its store's I/O thread while the batch decodes:
    its first working set, and the block summaries (sparse modes)."""

    blocks: FetchHandle
    summaries: Future | None
    num_units: int

    @property
    def deadline(self) -> float:
        """Monotonic; past it the request ends with a StoreTimeout (the summaries are read on
        the same thread, queued just after the blocks)."""
        return self.blocks.deadline

    def futures(self) -> list[Future]:
        return [self.blocks.future] + ([self.summaries] if self.summaries is not None else [])

    def landed(self) -> bool:
        """Both reads have ended (landed or failed)."""
        return all(future.done() for future in self.futures())


@dataclass
class DecodeRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int]
    initial_selection: torch.Tensor
    num_kv: int = 0  # tokens whose K/V are in the working set / store
    ws: WorkingSet | None = None
    summaries: SummaryPages | None = None
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None  # its structured output's matcher
    grammar_compile: Future | None = None  # while its spec compiles (it waits, the batch goes on)
    grammar_deadline: float = 0.0  # when a compile still running fails the request
    text: str = ""
    finish_reason: str | None = None
    write_backs: list[WriteBack] = field(default_factory=list)
    failure: BaseException | None = None  # what its store failed it with (`_fail`)
    admission: Admission | None = None  # while its first reads are in flight
    mode: str = "lookahead"
    summary_kind: str = DEFAULT_SUMMARY_KIND  # how the store summarized the prompt (its KVLayout); write-back matches it
    # A prefill that predicted no working set (vLLM prefill has no queries to give) makes the
    # first step choose its blocks from its own query, as sparse-current does.
    first_step_mode: str | None = None
    plan: RowPlan | None = None
    output_text: OutputText | None = None  # decodes only the tokens each step adds
    arrived: float = field(default_factory=time.perf_counter)
    _history: list[int] = field(default_factory=list, repr=False)

    @property
    def history(self) -> list[int]:
        """Prompt and output as one list, extended as the output grows rather than built again
        each step (a copy of 32K tokens per request and step); the same list every time, so a
        drafter can tell it continues what it has already seen. Read-only to callers."""
        if not self._history:
            self._history.extend(self.prompt_ids)
        self._history.extend(self.output_ids[len(self._history) - len(self.prompt_ids) :])
        return self._history


@dataclass
class DecodeOutput:
    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    # Set when the request's store failed it (its KV could not be read at admission or during
    # a step, a write-back did not land): it has left the engine, keeping the tokens emitted before, and
    # its caller gets this error instead of a finish.
    error: str | None = None
    # The logprobs of new_token_ids, when the request asked for them.
    logprobs: list[TokenLogprob] | None = None
    # What ended a "stop" finish, as vLLM reports it: a stop_token_ids id, the stop string, or None (EOS).
    stop_reason: str | int | None = None


class DecodeEngine:
    def __init__(self, model: DecoderModel, tokenizer, client, config: DecodeConfig | None = None,
                 drafter: Drafter | None = None):
        from ..prefill_node.prefill import kv_layout_for  # geometry helper only

        self.config = config or DecodeConfig()
        require_device(self.config.device)  # before anything is allocated there
        self.model = model
        self.tokenizer = tokenizer
        self.client = IOThreadClient(client, self.config.fetch_timeout_s)
        self.layout = kv_layout_for(model, self.config.block_size)
        self.pool = DevicePool(self.layout, int(self.config.kv_pool_gb * 2**30), self.config.device,
                               summary_read_dtype(self.config.summary_read_dtype))
        self.client.register(self.pool.tensor)
        self.counters = DecodeCounters()
        mc = model.config
        self.backend = SparseAttention(
            self.pool, self.client, mc.sliding_window, mc.softmax_scale, self.config.max_replace_fraction,
            self.config.miss_policy, self.counters, self.config.recall_sample_steps, self.config.uses_triton_attention,
            self.config.lookahead_topup_blocks, self.config.prefetch_rank_fraction, self.config.lookahead_layer_group,
        )
        self.drafter = drafter if drafter is not None else NgramDrafter()
        self.eos_token_ids = request_eos_ids(mc, tokenizer)
        self.waiting: deque[DecodeRequest] = deque()
        self._grammar_compiles = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        self.admitting: list[DecodeRequest] = []  # given their rows; their first reads in flight
        self.running: list[DecodeRequest] = []
        self._ended_before_failure: list[DecodeOutput] = []  # see step()
        # (pool rows, transfers that may still write into them): rows of requests that ended
        # while a transfer of theirs had not (its store stopped answering); they go back to the
        # pool once every such transfer has ended.
        self.quarantine: list[tuple[list[int], list]] = []
        self._queued_frees: set[Future] = set()  # store frees not waited for (`_free_in_store`)
        self._steps = 0

    # -- admission -----------------------------------------------------------------------
    def row_plan(self, prompt_tokens: int, max_tokens: int, mode: str | None = None,
                 budget_tokens: int | None = None) -> RowPlan:
        return plan_rows(self.config, prompt_tokens, max_tokens, mode, budget_tokens, kv_itemsize=self.layout.itemsize)

    def add(self, prefill, params: SamplingParams, mode: str | None = None, budget_tokens: int | None = None) -> str:
        """Queue a prefilled request (a prefill_node.PrefillResult). `mode` and `budget_tokens`
        override the engine's defaults for this request."""
        mode = mode or self.config.mode
        if mode not in ("dense", "sparse-current", "lookahead"):
            raise ValueError(f"mode must be dense, sparse-current or lookahead, got {mode!r}")
        if budget_tokens is not None and (not isinstance(budget_tokens, int) or budget_tokens < self.config.block_size
                                          or budget_tokens % self.config.block_size):
            raise ValueError(f"budget_tokens must be a positive multiple of {self.config.block_size}, got {budget_tokens}")
        if any(r.request_id == prefill.request_id for r in (*self.waiting, *self.admitting, *self.running)):
            # Both would free the same store request when they finish, and the other would fail mid-step.
            raise ValueError(f"request {prefill.request_id!r} is already in this engine")
        self._check_layout(prefill)
        require_known_tokens(params, self.model.config.vocab_size, self.eos_token_ids)
        context = self.model.config.max_position_embeddings
        if len(prefill.prompt_ids) + params.max_tokens > context:
            raise RequestTooLarge(
                f"request {prefill.request_id}: prompt ({len(prefill.prompt_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) exceeds the model's context of {context} tokens"
            )
        plan = self.row_plan(len(prefill.prompt_ids), params.max_tokens, mode, budget_tokens)
        if plan.total > self.pool.num_rows:
            raise RequestTooLarge(
                f"request {prefill.request_id} needs {plan.total} rows of the device KV pool "
                f"({plan.total * self.pool.row_bytes / 2**20:.1f} MiB); the pool has {self.pool.num_rows}"
            )
        req = DecodeRequest(prefill.request_id, list(prefill.prompt_ids), params, [prefill.first_token],
                            prefill.initial_selection, num_kv=len(prefill.prompt_ids), mode=mode,
                            summary_kind=prefill.layout.summary_kind, plan=plan)
        if not params.greedy:
            req.generator = make_generator(None if params.seed is None else stream_seed(params.seed, "verify"))
        # The first token may already end the request.
        reason = finish_reason(prefill.first_token, 1, params, self.eos_token_ids, False)
        req.output_text = OutputText(self.tokenizer, params.skip_special_tokens)
        req.text, req.finish_reason = visible_text(req.output_text, req.output_ids, params, reason, self.eos_token_ids)
        if params.structured_outputs is not None and not req.finish_reason:
            # Compiled on a thread: against Qwen's vocabulary a schema takes seconds, and the
            # batch would stop for them. The request waits for it; the ones behind it go first.
            req.grammar_compile = self._grammar_compiles.submit(self._compile_grammar, params, req.output_ids)
            req.grammar_deadline = time.monotonic() + GRAMMAR_COMPILE_TIMEOUT_S
        self.waiting.append(req)
        return req.request_id

    _SHARED_LAYOUT = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")

    def _check_layout(self, prefill) -> None:
        """The prefill's KV must be this engine's: a bf16 or 16-token-block prefill decoded by an
        fp32 or 32-token-block engine read its blocks as something else and output garbage,
        with no error. The summary kind may differ: it is each request's own."""
        theirs = prefill.layout
        differ = [f"{name} {getattr(theirs, name)} (this engine: {getattr(self.layout, name)})"
                  for name in self._SHARED_LAYOUT if getattr(theirs, name) != getattr(self.layout, name)]
        if differ:
            raise ValueError(f"request {prefill.request_id}: its prefill wrote KV of another layout: {', '.join(differ)}; "
                             "prefill and decode must run the same model, dtype and block size")

    def _compile_grammar(self, params: SamplingParams, output_ids: list[int]) -> GrammarState:
        """The request's structured output, following its output so far (the prefill chose its
        first token under the same spec)."""
        grammar = GrammarState.for_params(params, self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
        grammar.sync(output_ids)
        return grammar

    def _take_compiled(self, req: DecodeRequest) -> None:
        """Take the request's structured output once its compile has ended; one that failed, or
        that still runs past its deadline, sets the request's failure (`_admit_waiting` ends it)."""
        future = req.grammar_compile
        if future is None:
            return
        if not future.done():
            if time.monotonic() > req.grammar_deadline:
                future.cancel()  # if it has not started; a running compile ends in its thread
                req.grammar_compile = None
                req.failure = TimeoutError(f"its structured output took over {GRAMMAR_COMPILE_TIMEOUT_S:g} s to "
                                           "compile on this worker")
            return
        req.grammar_compile = None
        try:
            req.grammar = future.result()
        except Exception as error:  # a spec its first token breaks, or that does not compile here
            req.failure = error

    def _admit_waiting(self) -> list[DecodeOutput]:
        """End the queued requests that ended at their first token, wherever they wait (they need
        no seat and no rows: behind a full engine they waited for a seat), and those whose
        structured output failed, then start the admission of the queued requests that fit, in
        order; one whose structured output is compiling lets those behind it go first."""
        finished = []
        for req in self.waiting:  # once, here: a compile that ends later is taken at the next step
            self._take_compiled(req)
        for req in [r for r in self.waiting if r.failure is not None]:
            self.waiting.remove(req)
            self._free_in_store(req.request_id)
            log.warning("request %s: its structured output failed: %s", req.request_id, req.failure)
            finished.append(DecodeOutput(req.request_id, [], req.output_ids, req.text, True, None,
                                         error=f"its structured output failed: {type(req.failure).__name__}: "
                                               f"{req.failure}"))
        if any(req.finish_reason for req in self.waiting):
            still_waiting = [req for req in self.waiting if not req.finish_reason]
            for req in self.waiting:
                if req.finish_reason:
                    self._free_in_store(req.request_id)
                    finished.append(DecodeOutput(req.request_id, [], req.output_ids, req.text, True, req.finish_reason,
                                                 stop_reason=self._stop_reason(req, req.finish_reason)))
            self.waiting.clear()
            self.waiting.extend(still_waiting)
        for req in list(self.waiting):
            if len(self.running) + len(self.admitting) >= self.config.max_num_seqs:
                break
            if req.grammar_compile is not None:
                continue
            if req.plan.total > self.pool.allocator.num_free:
                break
            self.waiting.remove(req)
            try:
                self._admit(req, req.plan)  # starts its reads; a store that fails them ends it in _join_admitted
            except BaseException:
                self.waiting.appendleft(req)  # where abort_all finds it; it was in no list and its stream hung
                raise
            self.admitting.append(req)
        return finished

    def _admit(self, req: DecodeRequest, plan: RowPlan) -> None:
        """Give the request its pool rows and start reading its first working set and summaries
        (`_join_admitted` waits for them); on failure the rows go back (once the read into them
        has ended)."""
        rows = torch.tensor(self.pool.allocator.allocate(plan.total))
        transfers: list = []
        try:
            self._start_first_reads(req, plan, rows, transfers)
        except BaseException:
            self._give_back_rows(req.request_id, rows.tolist(), transfers)
            raise

    def _start_first_reads(self, req: DecodeRequest, plan: RowPlan, rows: torch.Tensor, transfers: list) -> None:
        layout = self.layout
        ws = WorkingSet(req.request_id, rows, plan, layout.num_layers, layout.num_kv_heads, layout.block_size)
        num_blocks = layout.num_blocks(req.num_kv)
        tail = num_blocks - 1
        always = sorted(set(range(min(plan.sinks, num_blocks))) | set(ws.window_blocks(tail)))
        layers, heads, blocks, row_index = [], [], [], []
        all_layers = np.repeat(np.arange(layout.num_layers), layout.num_kv_heads)
        all_heads = np.tile(np.arange(layout.num_kv_heads), layout.num_layers)
        for block in always:
            index = ws.ring_index(block)
            ws.set_everywhere(index, block)
            layers.append(all_layers)
            heads.append(all_heads)
            blocks.append(np.full(all_layers.size, block))
            row_index.append(np.full(all_layers.size, index))
        # Rows not fetched whole below start as zeros, not as whatever their last owner left there.
        filled = {ws.ring_index(block) for block in always}
        self.pool.clear_rows(rows[[i for i in range(plan.kv_rows) if i not in filled]])
        if plan.budget and req.mode == "lookahead" and not req.initial_selection.numel():
            req.first_step_mode = "sparse-current"
        if plan.budget and req.initial_selection.numel():
            window_start = ws.window_blocks(tail).start
            wanted_by_layer = []
            windows = self.model.config.sliding_window
            for layer in range(layout.num_layers):
                # Keep the prediction's candidates that are not resident anyway (sinks, window)
                # and that the layer may see (a sliding window's first query is at num_kv); heads
                # may keep different numbers, so all are cut to the shortest.
                first = ws.first_candidate_block(req.num_kv, windows[layer])
                per_head = [w[(w >= first) & (w < window_start)][: plan.budget] for w in req.initial_selection[layer]]
                width = min(len(w) for w in per_head)
                wanted_by_layer.append(torch.stack([w[:width] for w in per_head]))
            fetches = plan_replacements_many(0, [PlanRequest(ws, layer, wanted, None)
                                                 for layer, wanted in enumerate(wanted_by_layer)])
            for layer, fetch in enumerate(fetches):
                layers.append(np.full(len(fetch), layer))
                heads.append(fetch.heads)
                blocks.append(fetch.blocks)
                row_index.append(fetch.row_indices)
        layers, heads, blocks, row_index = (np.concatenate(x).astype(np.int64) for x in (layers, heads, blocks, row_index))
        slots = self.pool.unit_ids(rows[torch.from_numpy(row_index)], torch.from_numpy(layers), torch.from_numpy(heads))
        transfers.append(self.client.read_blocks(req.request_id, layers, heads, blocks, self.pool.tensor,
                                                 slots.numpy()))
        summaries = (self.client.call_later("read_summaries", req.request_id, dtype=self.config.summary_read_dtype)
                     if plan.budget else None)
        req.summaries = SummaryPages(self.pool, ws.summary_rows)
        req.admission = Admission(transfers[-1], summaries, int(blocks.size))
        req.ws = ws

    def _join_admitted(self, wait_s: float = 0.0) -> list[DecodeOutput]:
        """The admitted requests whose first reads have landed join the batch; one whose reads
        failed, or have not landed within the fetch timeout, ends alone. `wait_s`: how long to
        wait for every admission in flight to land first."""
        if not self.admitting:
            return []
        if wait_s > 0:
            now = time.monotonic()
            earliest = min(req.admission.deadline for req in self.admitting)
            concurrent.futures.wait([f for req in self.admitting for f in req.admission.futures()],
                                    timeout=max(0.0, min(wait_s, earliest - now)))
        outputs = []
        now = time.monotonic()
        for req in list(self.admitting):
            try:
                if req.admission.landed():
                    self._join(req)
                elif now >= req.admission.deadline:
                    raise StoreTimeout(f"its first working set was not read within {self.config.fetch_timeout_s:.1f}s "
                                       "(its store does not answer)")
            except KVStoreError as error:  # its store failed it; the batch has not been touched
                outputs.append(self._fail(req, "not admitted", error))
        return outputs

    def _join(self, req: DecodeRequest) -> None:
        admission = req.admission
        admission.blocks.wait(0)  # raises what the read failed with
        if admission.summaries is not None:
            summaries = admission.summaries.result()
            self.counters.summary_bytes_fetched += summaries.nbytes  # values, or codes with their ranges
            req.summaries.write(0, summaries)
        self.counters.admission_bytes_fetched += admission.num_units * self.layout.unit_bytes
        req.admission = None
        self.admitting.remove(req)
        self.running.append(req)

    # -- one step ------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.admitting or self.running)

    def step(self) -> list[DecodeOutput]:
        """One verification pass over the running batch; the requests whose admission reads
        have landed join it first. With none running it may return without a pass (admissions
        still reading, rows still in quarantine): call it again while `has_unfinished`.

        A step that raises has left the requests it ended (failed, finished) out of the engine,
        where `abort_all` cannot name them: their outputs are kept for `take_ended_before_failure`
        (their streams waited for ever)."""
        outputs: list[DecodeOutput] = []
        try:
            self._step(outputs)
        except Exception:
            self._ended_before_failure += [out for out in outputs if out.finished or out.error is not None]
            raise
        return outputs

    def take_ended_before_failure(self) -> list[DecodeOutput]:
        ended, self._ended_before_failure = self._ended_before_failure, []
        return ended

    @torch.inference_mode()
    def _step(self, outputs: list[DecodeOutput]) -> None:
        self.release_ended_rows()
        outputs += self._admit_waiting()
        outputs += self._join_admitted(0.0 if self.running else IDLE_WAIT_S)
        if not self.running:
            compiling = [r.grammar_compile for r in self.waiting if r.grammar_compile is not None]
            if compiling and not self.admitting:
                concurrent.futures.wait(compiling, timeout=IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)
            elif self.waiting and not self.admitting:
                if self.quarantine:
                    self.settle(IDLE_WAIT_S)  # rows a store still holds; the queue waits
                elif not outputs:  # requests that ended just now gave their rows back: the next step admits
                    raise RuntimeError("no request fits the device KV pool although it is empty")
            return
        k = self.config.num_draft_tokens
        reqs, held = [], []
        for req in list(self.running):  # _fail below takes a request out of self.running
            try:
                (reqs if self._write_backs_settled(req, req.num_kv, req.num_kv + k) else held).append(req)
            except KVStoreError as error:  # a block of its own never reached its store, or it was not extended
                outputs.append(self._fail(req, "its store failed it", error))
        if not reqs:
            self._wait_for_write_backs(held)
            return
        ids, positions, step_reqs, batch = [], [], [], []
        for req, draft in zip(reqs, self._propose(reqs, k)):
            tokens = [req.output_ids[-1]] + draft.tokens
            pos = torch.arange(req.num_kv, req.num_kv + len(tokens))
            batch.append((req, draft))
            ids.extend(tokens)
            positions.append(pos)
            mode, req.first_step_mode = req.first_step_mode or req.mode, None
            step_reqs.append(StepRequest(req.ws, req.summaries, pos, len(draft.tokens), mode, req.plan.budget,
                                         self._radius_weight(req)))
        if not batch:
            return
        self._steps += 1
        self.backend.prepare(step_reqs, self._steps)
        device = self.config.device
        hidden = self.model(torch.tensor(ids, device=device), torch.cat(positions).to(device), self.backend)
        logits = self.model.compute_logits(hidden).cpu()
        start = 0
        for req, draft in batch:
            rows = 1 + len(draft.tokens)
            if req.ws.failure is not None:  # a block it attended over never came: its logits are not its own
                start += rows
                outputs.append(self._fail(req, "a block read from its store failed", req.ws.failure))
                continue
            chosen_from = logits[start : start + rows]
            if req.params.processed:
                try:
                    chosen_from = process_logits(chosen_from, req.params, req.prompt_ids, req.output_ids, draft.tokens,
                                                 self.eos_token_ids, req.grammar)
                except ValueError as error:  # an output its structured output refuses: it ends alone
                    start += rows
                    outputs.append(self._fail(req, "its structured output could not go on", error))
                    continue
            usable = chosen_from.shape[0]  # fewer where the spec leaves a later row without a token
            emitted = verify(chosen_from, draft if usable == rows else draft.first(usable - 1), req.params,
                             req.generator)
            # Emitted token i was chosen from row i (the last one the correction or bonus).
            logprobs = (None if req.params.logprobs is None
                        else token_logprobs(logits[start : start + rows], emitted, req.params.logprobs))
            start += rows
            self.counters.drafts_proposed += len(draft.tokens)
            # As verified, before a stop token or string cuts the run (as vLLM 0.32 counts them): the
            # acceptance rate measures the drafter, and every one of these drafts was the target's choice.
            self.counters.drafts_accepted += len(emitted) - 1
            old_kv = req.num_kv
            req.num_kv += len(emitted)  # the last token and the accepted drafts now have K/V
            if req.mode != "dense":
                self._write_back(req, old_kv)  # a store that refuses it fails the request at a later step
            outputs.append(self._emit(req, emitted, logprobs))
        self.counters.steps += 1

    def _radius_weight(self, req: DecodeRequest) -> float:
        if self.config.radius_weight is not None:
            return self.config.radius_weight
        return ranking_radius_weight(req.summary_kind)

    def _propose(self, reqs: list[DecodeRequest], k: int) -> list[Draft]:
        if k == 0:
            return [Draft([]) for _ in reqs]
        budgets = [min(k, r.params.max_tokens - len(r.output_ids)) for r in reqs]
        drafts = self.drafter.propose([r.request_id for r in reqs], [r.history for r in reqs], k, [r.params for r in reqs],
                                      prompt_lengths=[len(r.prompt_ids) for r in reqs],
                                      eos_token_ids=self.eos_token_ids, grammars=[r.grammar for r in reqs])
        return [d.first(b) for d, b in zip(drafts, budgets)]

    def _write_backs_settled(self, req: DecodeRequest, first: int, last: int) -> bool:
        """Whether this step may write positions first..last into the request's ring rows: the
        write-backs that read from those rows (a ring row comes round a window later) have landed.
        One that has not holds the request out of this step, while the batch decodes on, until it
        lands or its deadline passes (`StoreTimeout`); a failed one raises its error. Landed ones
        are forgotten. Waiting for them here held up every request of the batch, for the timeout
        when the store had stopped answering."""
        if not req.write_backs:
            return True
        bs, ws = self.layout.block_size, req.ws
        written = {int(ws.rows[ws.ring_index(block)]) for block in range(first // bs, last // bs + 1)}
        pending, settled = [], True
        for write_back in req.write_backs:
            if write_back.rows & written:
                if not write_back.handle.done() and time.monotonic() < write_back.handle.deadline:
                    pending.append(write_back)
                    settled = False
                    continue
                write_back.handle.wait_due()  # it has landed, or this raises
            elif not write_back.handle.done():
                pending.append(write_back)
        req.write_backs = pending
        return settled

    def _wait_for_write_backs(self, held: list[DecodeRequest]) -> None:
        """Every running request is held out by a write-back: wait a little for one to land
        rather than spin."""
        handles = [w.handle for req in held for w in req.write_backs]
        if handles:
            earliest = min(handle.deadline for handle in handles)
            timeout = max(0.0, min(IDLE_WAIT_S, earliest - time.monotonic()))
            concurrent.futures.wait([handle.future for handle in handles], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _write_back(self, req: DecodeRequest, old_kv: int) -> None:
        """Blocks completed this step go to the store (KV + summaries), so they stay fetchable
        after they leave the window."""
        bs, layout = self.layout.block_size, self.layout
        done = range(old_kv // bs, req.num_kv // bs)
        if not done:
            return
        ws = req.ws
        rows = torch.tensor([int(ws.rows[ws.ring_index(b)]) for b in done])
        layer_ids = torch.arange(layout.num_layers)
        head_ids = torch.arange(layout.num_kv_heads)
        units = self.pool.unit_ids(rows[:, None, None], layer_ids[None, :, None], head_ids[None, None, :])
        block_ids = torch.tensor(list(done))[:, None, None].expand_as(units)
        layers = layer_ids[None, :, None].expand_as(units)
        heads = head_ids[None, None, :].expand_as(units)
        # The store extends the request first; a refusal fails the handle (`_settle_write_backs`).
        handle = self.client.write_back(
            req.request_id, req.num_kv, layers.reshape(-1).numpy(), heads.reshape(-1).numpy(),
            block_ids.reshape(-1).numpy(), self.pool.tensor, units.reshape(-1).numpy(),
        )
        req.write_backs.append(WriteBack(handle, set(rows.tolist())))
        self.counters.blocks_written_back += len(done)
        if not req.plan.budget:
            # No budget rows (every block a sink): nothing is ever ranked, and its summaries were
            # never read, so there are none for these to follow (writing them raised, and the
            # failed step ended every request of the worker).
            return
        keys = self.pool.units[units][:, :, :, 0]  # [blocks, layers, heads, bs, d]
        summaries = summarize_keys(keys, kind=req.summary_kind).permute(1, 2, 0, 3, 4)  # [layers, heads, blocks, 2, d]
        req.summaries.write(done.start, summaries)  # rewrites a block the prefill wrote partly filled

    def _emit(self, req: DecodeRequest, emitted: list[int], logprobs: list[TokenLogprob] | None = None) -> DecodeOutput:
        new = []
        reason = None
        for i, token in enumerate(emitted):
            req.output_ids.append(token)
            new.append(token)
            reason = finish_reason(token, len(req.output_ids), req.params, self.eos_token_ids, False)
            if reason:
                break
            if req.params.stop and i + 1 < len(emitted):
                # A stop string may end inside an accepted run: the tokens after it must not be
                # output (they were, and counted in usage). The last token is checked below.
                _, reason = visible_text(req.output_text, req.output_ids, req.params, None, self.eos_token_ids)
                if reason:
                    break
        self.counters.generated_tokens += len(new)
        req.text, reason = visible_text(req.output_text, req.output_ids, req.params, reason, self.eos_token_ids)
        if reason:
            self._finish(req, reason)
        return DecodeOutput(req.request_id, new, list(req.output_ids), req.text, reason is not None, reason,
                            logprobs=None if logprobs is None else logprobs[: len(new)],
                            stop_reason=self._stop_reason(req, reason))

    def _stop_reason(self, req: DecodeRequest, reason: str | None) -> str | int | None:
        if reason != "stop":
            return None
        # A fresh decoder: the request's OutputText follows the shown text and must not be rewound.
        return stop_reason(OutputText(self.tokenizer, req.params.skip_special_tokens), req.output_ids, req.params,
                           self.eos_token_ids)

    def _finish(self, req: DecodeRequest, reason: str, wait_for_free: bool = True) -> None:
        """Take the request out: its drafter state, its store memory and its rows. The free is
        queued on its store's I/O thread behind the request's transfers, and the rows go back
        through quarantine while a transfer into them may still land, so the decode loop never
        waits a store out. `wait_for_free`: give the free a moment to be answered (it normally
        is, so the final output follows it); False for a request whose store may not answer.
        A finish once waited for its transfers and its free for up to the fetch timeout: a
        frozen store held up every request of the worker, on healthy stores too, each time one
        of its requests ended."""
        req.finish_reason = reason
        self.drafter.release(req.request_id)
        for batch in (self.running, self.admitting):
            if req in batch:
                batch.remove(req)
        self._free_in_store(req.request_id, wait=wait_for_free)
        if req.ws is not None:
            self._release_working_set(req)

    @staticmethod
    def _transfers_of(req: DecodeRequest) -> list:
        """Every transfer into the request's rows still tracked: its admission read, prefetches
        and write-backs."""
        first = [req.admission.blocks] if req.admission is not None else []
        return first + [h for h in req.ws.pending if h is not None] + [w.handle for w in req.write_backs]

    def _release_working_set(self, req: DecodeRequest) -> None:
        """The request's rows go back (through quarantine while a transfer may still land)."""
        self._give_back_rows(req.request_id, req.ws.rows.tolist(), self._transfers_of(req))
        req.write_backs.clear()
        req.ws = None

    def _give_back_rows(self, request_id: str, rows: list[int], transfers: list) -> None:
        """Rows go back to the pool at once, or, while a transfer may still write into them,
        into quarantine until it has ended (`release_ended_rows`)."""
        unended = [handle for handle in transfers if not transfer_ended(handle)]
        if unended:
            log.warning("request %s: %d transfer(s) into its %d pool rows have not ended; the rows wait for them",
                        request_id, len(unended), len(rows))
            self.quarantine.append((rows, unended))
        else:
            self.pool.allocator.free(rows)

    def release_ended_rows(self) -> None:
        """Give back the quarantined rows whose transfers have all ended."""
        if not self.quarantine:
            return
        held = []
        for rows, transfers in self.quarantine:
            transfers = [handle for handle in transfers if not transfer_ended(handle)]
            if transfers:
                held.append((rows, transfers))
            else:
                self.pool.allocator.free(rows)
        self.quarantine = held

    def settle(self, timeout_s: float) -> bool:
        """Wait, at most `timeout_s`, for the quarantined rows to come back and the queued store
        frees to be answered; whether they all were."""
        deadline = time.monotonic() + timeout_s
        self.release_ended_rows()
        while self.quarantine and time.monotonic() < deadline:
            time.sleep(0.01)
            self.release_ended_rows()
        concurrent.futures.wait(list(self._queued_frees), timeout=max(0.0, deadline - time.monotonic()))
        return not (self.quarantine or self._queued_frees)

    def _fail(self, req: DecodeRequest, what: str, error: BaseException) -> DecodeOutput:
        """End one request that its store failed (a read, an extend or a write-back it needs), or
        whose structured output could not go on, alone: the rest of the batch goes on. It keeps
        what it has emitted; its caller gets the error instead of a finish."""
        log.warning("request %s: %s: %s", req.request_id, what, error)
        req.failure = error
        self._finish(req, "error", wait_for_free=not isinstance(error, StoreTimeout))
        return DecodeOutput(req.request_id, [], list(req.output_ids), req.text, True, None,
                            error=f"{what}: {type(error).__name__}: {error}")

    def _free_in_store(self, request_id: str, wait: bool = True) -> None:
        """Give a request's store memory back, as far as its store can be reached: queued on the
        store's I/O thread (after the request's transfers). A store that died took the memory
        with it (Ray restarts it empty), and one that does not answer must not keep the engine
        from going on: a free that raised failed the step, and every request in it. `wait`:
        wait up to FREE_ANSWER_WAIT_S for the answer, so that the caller's next word (a final
        output, and the router's release of the request's store reservation after it) normally
        follows the free; `settle` waits for the rest."""
        future = self.client.call_later("free", request_id)
        # The callback holds the set and the counters, not the engine: the store's I/O thread
        # keeps its last job, and through it an engine (and its pool) that was otherwise gone.
        queued, counters = self._queued_frees, self.counters
        queued.add(future)

        def answered(future: Future) -> None:
            _count_free(counters, request_id, future.exception())
            queued.discard(future)

        future.add_done_callback(answered)
        if wait:
            concurrent.futures.wait([future], timeout=FREE_ANSWER_WAIT_S)

    def free_in_store(self, request_id: str) -> None:
        """Free a request this engine never took (aborted before it came, or refused by `add`)
        in its store: queued on the store's I/O thread, so a store that does not answer holds up
        nothing else."""
        self._free_in_store(request_id, wait=False)

    def abort(self, request_id: str) -> None:
        """End a request its caller gave up on, without waiting for its store: a caller often
        gives up because that store stopped answering, and waiting held up every other request
        for the timeout twice over (its transfers, then its free)."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                if req.grammar_compile is not None:
                    req.grammar_compile.cancel()  # if it has not started: the next one's compile goes first
                self._free_in_store(request_id, wait=False)
                return
        for req in (*self.admitting, *self.running):
            if req.request_id == request_id:
                self._finish(req, "abort", wait_for_free=False)
                return

    def abort_all(self) -> list[str]:
        """Abort every waiting and running request (pool rows, drafter state and store memory are
        given back) and return their ids; the engine can step again afterwards. What a step that
        raised midway leaves behind is undone here too. Every request is attempted even if an
        earlier one fails (a failed transfer, say); the first error is raised at the end."""
        errors: list[BaseException] = []
        aborted: list[str] = []

        def attempt(fn, *args) -> None:
            try:
                fn(*args)
            except Exception as error:  # keep freeing the rest
                errors.append(error)

        while self.waiting:
            req = self.waiting.popleft()
            if req.grammar_compile is not None:
                req.grammar_compile.cancel()
            req.finish_reason = req.finish_reason or "abort"
            aborted.append(req.request_id)
            attempt(self._free_in_store, req.request_id)
        while self.running or self.admitting:
            req = (self.running or self.admitting).pop()
            req.finish_reason = "abort"
            aborted.append(req.request_id)
            attempt(self.drafter.release, req.request_id)
            if req.ws is not None:
                # Rows go back once no transfer can land in them: a step that raised midway may
                # have left some in flight, and a store that stopped answering holds its own.
                self._release_working_set(req)
            attempt(self._free_in_store, req.request_id)
        if errors:
            raise RuntimeError(f"DecodeEngine.abort_all: {len(errors)} error(s), the first: {errors[0]!r}") from errors[0]
        return aborted

    def close(self) -> None:
        """Abort every request (`abort_all`), unregister the pool from the client and stop the I/O
        thread. Idempotent; the engine cannot step afterwards. Every stage is attempted even if an
        earlier one fails; the first error is raised at the end."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            self.abort_all()
        except Exception as error:
            errors.append(error)
        self._grammar_compiles.shutdown(wait=False, cancel_futures=True)
        self.settle(self.config.fetch_timeout_s)
        if self.quarantine:
            # Unregistered memory that a transfer then writes into is worse than a leak at exit.
            log.warning("closing with %d request(s)' transfers not ended (a store does not answer); the pool "
                        "stays registered", len(self.quarantine))
        elif hasattr(self.client.client, "unregister"):  # a StoreDirectory registers with each store itself
            try:
                self.client.unregister(self.pool.tensor)
            except Exception as error:
                errors.append(error)
        self.client.close(self.config.fetch_timeout_s)  # runs what is queued, then stops the threads
        if errors:
            raise RuntimeError(f"DecodeEngine.close: {len(errors)} error(s), the first: {errors[0]!r}") from errors[0]

    def run_to_completion(self) -> dict[str, DecodeOutput]:
        """Step until every request has finished; the rows and store memory of those that failed
        are back too (unless a store holds them up past the fetch timeout)."""
        final = {}
        while self.has_unfinished:
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        self.settle(self.config.fetch_timeout_s)
        return final


def _count_free(counters: DecodeCounters, request_id: str, error: BaseException | None) -> None:
    if isinstance(error, KVStoreError):
        counters.store_free_failures += 1
        log.warning("request %s: its store memory was not freed: %s", request_id, error)
    elif error is not None:
        log.error("request %s: freeing its store memory raised %r", request_id, error)
