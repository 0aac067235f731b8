"""`LLM`: the single-process continuous-batching engine (model + paged KV cache + scheduler)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm.auto import tqdm

from ..device import require_device
from ..attention import AttentionBatch, PagedAttention
from ..kv_cache import KVCacheSpec, PagedKVCache
from ..sampling import (
    SamplingParams,
    TokenLogprob,
    make_generator,
    process_logits,
    require_known_tokens,
    sample,
    token_logprobs,
    tokenize_bad_words,
)
from ..structured_output import GrammarState
from .scheduler import RequestTooLarge, ScheduledBatch, Scheduler
from .sequence import Sequence
from .stopping import OutputText, finish_reason, request_eos_ids, visible_text

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger("oasiskv.llm")


class EmptyPromptError(ValueError):
    """A prompt with no tokens: there is nothing to condition on."""


class EngineConfig(BaseModel):
    # A misspelled option (kv_cache_gbb=...) was dropped without a word, as vLLM refuses it.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field("smollm2-135m", description="registry name, HF directory or .gguf file")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_gb: float = Field(1.0, gt=0, description="memory for the paged KV cache")
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=16, description="prefill chunk budget per step")
    max_model_len: int | None = Field(None, ge=1, description="defaults to the model's context")
    cache_dir: str | None = None

    @field_validator("device")
    @classmethod
    def _device_exists(cls, value: str) -> str:
        require_device(value)
        return value

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            # bf16 on GPUs. On CPUs fp32: bf16 GEMMs are 2-4x faster there for batched decode
            # (AVX512-BF16), but on the small registry models bf16 activations flip greedy
            # choices often enough to change answers; ask for bfloat16 explicitly for speed.
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return _DTYPES[self.dtype]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    finished: bool
    logprobs: list[TokenLogprob] | None = None  # of every output token, when the request asked for them


class LLM:
    def __init__(self, model: str | None = None, **overrides):
        from ..pull import resolve_model  # noqa: PLC0415 (keeps `import oasiskv.models` light)
        from ..loader import load_model_dir
        from ..tokenizer import load_tokenizer

        if model is not None and not (isinstance(model, str) and model.strip()):
            raise ValueError(f"model must be a registry name, a model directory or a .gguf file, got {model!r}")
        self.config = EngineConfig(**({"model": model} if model else {}), **overrides)
        dtype = self.config.torch_dtype()
        model_dir = resolve_model(self.config.model, cache_dir=self.config.cache_dir)
        self.model_dir = Path(model_dir)
        self.model = load_model_dir(model_dir, dtype=dtype, device=self.config.device)
        self.tokenizer = load_tokenizer(model_dir)
        self._setup(dtype)

    @classmethod
    def from_model(cls, model, tokenizer, **overrides) -> "LLM":
        """Wrap an already built model (tests, and the nodes that load weights themselves)."""
        self = cls.__new__(cls)
        self.config = EngineConfig(**overrides)
        self.model_dir = None
        self.model = model
        self.tokenizer = tokenizer
        self._setup(next(model.parameters()).dtype)
        return self

    def _setup(self, dtype: torch.dtype) -> None:
        mc = self.model.config
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.config.block_size, dtype)
        num_blocks = spec.blocks_for_bytes(int(self.config.kv_cache_gb * 2**30))
        self.cache = PagedKVCache(spec, num_blocks, self.config.device)
        self.backend = PagedAttention(self.cache, mc.sliding_window, mc.softmax_scale)
        self.scheduler = Scheduler(
            self.cache.allocator, spec.block_size, self.config.max_num_seqs, self.config.max_num_batched_tokens
        )
        if (self.config.max_model_len or 0) > mc.max_position_embeddings:  # was capped without a word
            raise ValueError(f"max_model_len {self.config.max_model_len} is longer than the model's context of "
                             f"{mc.max_position_embeddings} tokens")
        self.max_model_len = self.config.max_model_len or mc.max_position_embeddings
        self.eos_token_ids = request_eos_ids(mc, self.tokenizer)
        self._sequences: dict[str, Sequence] = {}

    # -- requests ------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        if not ids:
            raise EmptyPromptError("the prompt is empty: give at least one token")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str = "") -> str:
        params = params or SamplingParams()
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are computed by the cluster's prefill (oasiskv serve, "
                             "prefill_node.Prefiller), not by LLM.generate; LLM.prompt_logprobs(prompt) gives "
                             "the whole [tokens, vocab] tensor")
        ids = self.encode(prompt)
        if params.bad_words and not params.bad_words_token_ids:  # a copy: the caller's may serve other prompts
            params = dataclasses.replace(params, bad_words_token_ids=tokenize_bad_words(
                params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False)))
        require_known_tokens(params, self.model.config.vocab_size, self.eos_token_ids)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestTooLarge(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        seq = Sequence(ids, params, request_id=request_id,
                       grammar=GrammarState.for_params(params, self.tokenizer, self.model.config.vocab_size,
                                                       self.eos_token_ids))
        if not params.greedy:
            seq.generator = make_generator(params.seed)
        self.scheduler.add(seq)
        self._sequences[seq.request_id] = seq
        return seq.request_id

    def abort(self, request_id: str) -> None:
        seq = self._sequences.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the outputs of the sequences that produced a token."""
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler is stuck: waiting requests cannot get KV blocks")
            return []
        samplers = [seq for seq, n in zip(batch.sequences, batch.num_new) if batch.samples(seq, n)]
        logits_rows = self._run_model(batch)
        self.scheduler.after_step(batch)
        if not samplers:
            return []
        chosen_from = logits_rows
        failed: set[int] = set()
        if any(seq.params.processed for seq in samplers):
            chosen_from = logits_rows.float().clone()  # the logprobs stay the raw logits'
            for row, seq in enumerate(samplers):
                if seq.params.processed:
                    try:
                        chosen_from[row] = process_logits(logits_rows[row : row + 1], seq.params, seq.prompt_ids,
                                                          seq.output_ids, eos_token_ids=self.eos_token_ids,
                                                          grammar=seq.grammar)[0]
                    except ValueError as error:  # its structured output leaves no token: it ends alone
                        log.warning("request %s ended: %s", seq.request_id, error)
                        failed.add(row)
        new_tokens = sample(chosen_from, [s.params for s in samplers], [s.generator for s in samplers])
        outputs = []
        for row, (seq, token) in enumerate(zip(samplers, new_tokens)):
            if row in failed:  # its row's sample is dropped
                self.scheduler.finish(seq, "error")
                outputs.append(RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), seq.text, "error",
                                             True, None if seq.params.logprobs is None else list(seq.logprobs)))
                continue
            if seq.params.logprobs is not None:
                seq.logprobs += token_logprobs(logits_rows[row : row + 1], [token], seq.params.logprobs)
            outputs.append(self._append(seq, token))
        return outputs

    def _run_model(self, batch: ScheduledBatch):
        ids, positions, sample_rows = [], [], []
        row = 0
        for seq, count in zip(batch.sequences, batch.num_new):
            all_ids = seq.all_ids
            ids.extend(all_ids[seq.num_cached : seq.num_cached + count])
            positions.extend(range(seq.num_cached, seq.num_cached + count))
            row += count
            if batch.samples(seq, count):
                sample_rows.append(row - 1)
        device = self.config.device
        self.backend.batch = AttentionBatch.dense(
            [s.block_table for s in batch.sequences],
            [s.num_cached for s in batch.sequences],
            batch.num_new,
            self.cache.block_size,
            device,
        )
        hidden = self.model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), self.backend)
        if not sample_rows:
            return None
        # Sampled on the CPU, as the decode node does: the generators are CPU ones (a CUDA row
        # with a CPU generator fails in multinomial), and a few rows of logits are cheap to move.
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)]).cpu()

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        seq.output_ids.append(token)
        reason = finish_reason(token, len(seq.output_ids), seq.params, self.eos_token_ids,
                               seq.num_tokens >= self.max_model_len)
        if seq.output_text is None:
            seq.output_text = OutputText(self.tokenizer, seq.params.skip_special_tokens)
        seq.text, reason = visible_text(seq.output_text, seq.output_ids, seq.params, reason, self.eos_token_ids)
        if reason:
            self.scheduler.finish(seq, reason)
        return RequestOutput(
            seq.request_id, seq.prompt_ids, list(seq.output_ids), seq.text, reason, reason is not None,
            None if seq.params.logprobs is None else list(seq.logprobs),
        )

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: str | list[int]) -> torch.Tensor:
        """Log-probabilities [tokens, vocab] that the model gives after each prompt position
        (row i predicts token i + 1), computed through the paged cache and then freed."""
        ids = self.encode(prompt)
        blocks = self.cache.allocator.allocate(-(-len(ids) // self.cache.block_size))
        try:
            self.backend.batch = AttentionBatch.dense([blocks], [0], [len(ids)], self.cache.block_size, self.config.device)
            device = self.config.device
            hidden = self.model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), self.backend)
            return torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        finally:
            self.cache.allocator.free(blocks)

    # -- batch API -----------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[int] | Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, dict)):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
        prompts = list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        for p in params_list:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must be SamplingParams (or a list of them), got {type(p).__name__}; "
                                "e.g. SamplingParams(max_tokens=16)")
        order: list[str] = []
        try:
            for prompt, sp in zip(prompts, params_list):
                if not isinstance(prompt, (str, list, tuple)):
                    raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
                order.append(self.add_request(prompt, sp))
        except BaseException:
            for request_id in order:  # a bad prompt later in the list left the earlier ones running
                self.abort(request_id)
            raise
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm)
        started = time.perf_counter()
        try:
            while self.has_unfinished:
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
                        self._sequences.pop(out.request_id, None)
                        bar.update(1)
        except BaseException:
            # Left in the scheduler, they would hold KV blocks and make every later call fail the same way.
            for request_id in order:
                self.abort(request_id)
            raise
        finally:
            bar.close()
        self.last_generate_seconds = time.perf_counter() - started
        return [final[rid] for rid in order]

    def chat(self, conversations, params: SamplingParams | None = None, **kwargs) -> list[RequestOutput]:
        """conversations: one list of {role, content} messages, or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = []
        for i, conversation in enumerate(conversations):
            if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
                raise TypeError(f"conversation {i} must be a list of {{'role': ..., 'content': ...}} messages")
            try:
                prompts.append(self.tokenizer.apply_chat_template(conversation))
            except Exception as exc:  # the template's own complaint (a message without content, roles out of order)
                raise ValueError(f"conversation {i}: the chat template failed: {exc}") from exc
        return self.generate(prompts, params, **kwargs)
