"""Decode-node configuration: one pydantic model, validated before anything is allocated."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..models.device import parse_device

Mode = Literal["dense", "sparse-current", "lookahead"]


class DecodeConfig(BaseModel):
    # A misspelt option (budget_token=64) ran with the default, silently; kv_pool_gb=inf passed
    # and overflowed in the engine.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Mode = "lookahead"
    kv_pool_gb: float = Field(1.0, gt=0, description="device KV pool (HBM on a GPU, RAM here): every request's "
                                "working set and, in the sparse modes, its key summaries")
    budget_tokens: int = Field(2048, ge=16, description="selected KV per layer and KV head, in tokens")
    sink_blocks: int = Field(1, ge=0, description="first blocks, always resident")
    window_blocks: int = Field(4, ge=1, description="most recent blocks, always resident (local window)")
    num_draft_tokens: int = Field(3, ge=0, le=15, description="k: drafts verified per step (0 = plain decoding)")
    drafter: str = Field("ngram", min_length=1, description="'ngram' (prompt lookup) or a draft model (registry name / path)")
    draft_window_tokens: int = Field(
        1024, ge=16, description="draft model only: besides its first 16 tokens, its KV keeps this many recent ones, "
        "which bounds its memory and what a new request's catch-up runs. Qwen 0.5B drafting eight 8K / 16K stdlib "
        "texts had 62.7% of drafts accepted at 1024, 58.8% at 512, 54.8% at 256",
    )
    draft_catch_up_budget: int | None = Field(
        None, ge=0, description="draft model only: tokens a step may feed new requests' catch-ups beyond each one's "
        "first chunk (256), in admission order. None: one request's whole catch-up (a request admitted alone drafts "
        "at once); 0: one chunk per request a step (the shortest stall for the others, fewer drafts meanwhile)",
    )
    max_replace_fraction: float = Field(
        0.05, gt=0, le=1,
        description="budget share each layer and KV head may replace per step, on average (fractions of a block carry over)",
    )
    prefetch_rank_fraction: float = Field(
        0.25, gt=0, le=1,
        description="lookahead only: a missing block is prefetched only when the prediction ranks it within this share "
        "of the top-K; blocks ranked lower stay if resident but are not fetched (1: anywhere in the top-K). Pooled over "
        "four 8K texts on Qwen 0.5B at 2,048, 0.25 fetched 4x fewer bytes while decoding than 1, at the same quality",
    )
    lookahead_layer_group: int = Field(
        4, ge=1, description="lookahead only: the draft rows' block selection runs once per this many layers, for all "
        "of them together, and their prefetches go out as one I/O job after the group's last layer (1: after every "
        "layer). Each call's fixed cost (on a CPU, its code and data back in caches the model's weights flushed; on "
        "a GPU, a host sync) is paid once per group; the fetches still overlap the rest of the pass",
    )
    lookahead_topup_blocks: int = Field(
        0, ge=0, description="lookahead only: before attending, fetch on demand (and wait for) up to this many blocks "
        "per layer and KV head among the current query's top-K that the prediction missed; 0: pure look-ahead",
    )
    radius_weight: float | None = Field(
        None, ge=0, le=1,
        description="a block's estimated logit is q.center + w |q|.radius of its key summary box (for min/max, 1 is the "
        "upper bound); blocks are ranked by the softmax share of it, summed over the query heads of a KV group. "
        "None: the weight measured for the request's summary kind (kvstore.RANKING_RADIUS_WEIGHTS)",
    )
    summary_read_dtype: Literal["float32", "bfloat16", "uint8"] = Field(
        "uint8", description="key summaries are read from the store, and held in the pool's summary pages, in this "
        "dtype; bfloat16 moves and holds half the bytes (the store rounds min down and max up, so scores stay "
        "bounds); uint8 a quarter, as 8-bit codes over each channel's range across the request's blocks "
        "(kvstore.QuantizedSummaries); ranking widens one layer's candidates at a time to float32",
    )
    recall_sample_steps: int = Field(
        8, ge=1, description="the prediction-recall counter scores the current query every Nth step (it cost 13% of a step)"
    )
    miss_policy: Literal["wait", "skip"] = Field(
        "wait", description="lookahead: a layer whose prefetch has not landed when it runs 'wait's for it, or 'skip's "
        "it (attends without the rows still in flight, and plans that layer's next prefetch only once this one has "
        "landed, so the model never blocks on a prefetch); counted either way (prefetch_waits / prefetch_skips)",
    )
    attention_kernel: Literal["auto", "torch", "triton"] = Field(
        "auto", description="attention over the resident KV: 'triton' reads K/V from the pool by unit id (CUDA, or "
        "TRITON_INTERPRET=1); 'torch' gathers them first; 'auto' = torch, the faster one in the only GPU measurement "
        "so far (H200, bench/results/attention_kernel_cuda.json: the kernel before its split-K rewrite took 3x the "
        "gather path's time)",
    )
    max_num_seqs: int = Field(32, ge=1)
    block_size: int = Field(16, ge=1)
    device: str = Field("cpu", description="cpu, cuda or cuda:N: where the model and the KV pool live (the decode "
                        "engine checks that the GPU is usable when it starts, not here: a head node may have none)")
    fetch_timeout_s: float = Field(30.0, gt=0)
    store_keep_alive_s: float = Field(
        30.0, gt=0, description="how often a decode worker refreshes the store TTL of every request it holds: a store "
        "frees a request nobody touched for its ttl_s (600 s by default), and a request waiting in the queue or "
        "decoding densely does not touch its store for as long as it lasts")

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        parse_device(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> "DecodeConfig":
        if self.budget_tokens % self.block_size:
            raise ValueError(f"budget_tokens ({self.budget_tokens}) must be a multiple of block_size ({self.block_size})")
        if self.attention_kernel == "triton":
            from .triton_attention import triton_available

            if not triton_available(self.device):
                raise ValueError(
                    f"attention_kernel='triton' needs Triton installed and a CUDA device (or TRITON_INTERPRET=1), "
                    f"device is {self.device!r}; use 'auto' or 'torch'"
                )
        if self.num_draft_tokens >= self.block_size:
            raise ValueError("num_draft_tokens must be smaller than block_size (drafts spill into one block at most)")
        return self

    @property
    def budget_blocks(self) -> int:
        return self.budget_tokens // self.block_size

    @property
    def uses_triton_attention(self) -> bool:
        return self.attention_kernel == "triton"
