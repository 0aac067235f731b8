"""Serving-cluster configuration: one pydantic model, validated before Ray starts."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..decode_node.config import DecodeConfig
from ..kvstore import DEFAULT_SUMMARY_KIND, SUMMARY_KINDS
from ..models.device import parse_device


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a misspelt option must not run as the default

    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    address: str | None = Field(None, description="join this Ray cluster instead of starting one")
    prefill_workers: int = Field(1, ge=1)
    decode_workers: int = Field(1, ge=1)
    stores: int = Field(1, ge=1)
    store_capacity_gb: float = Field(1.0, gt=0)
    store_port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    store_ttl_s: float = Field(
        600.0, gt=0, description="a store frees a request nobody has touched for this long (its worker died, say); "
        "decode workers refresh the requests they hold every decode.store_keep_alive_s, which follows it (a quarter "
        "of it, at most 30 s) unless set",
    )
    transport: Literal["auto", "nixl", "tcp"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the workers' weights and KV; 'auto' is bfloat16 on CUDA and float32 on CPUs, as in "
        "`oasiskv generate` (a GPU deployment served in float32)",
    )
    device: Literal["cpu", "cuda"] = Field(
        default_factory=lambda: os.environ.get("OASISKV_DEVICE") or "cpu",
        validate_default=True,  # $OASISKV_DEVICE is checked as a value given would be ('cuda:0' passed)
        description="where prefill and decode workers run the model and keep the decode KV pool; 'cuda' asks Ray for "
        "gpus_per_worker GPU(s) per prefill and decode worker (stores stay in host memory)",
    )
    gpus_per_worker: float = Field(
        1.0, gt=0, le=1, description="GPU share each prefill and decode worker asks Ray for (device='cuda'); "
        "0.5 lets a prefill and a decode worker share one GPU",
    )
    decode: DecodeConfig = Field(default_factory=DecodeConfig)
    placement: Literal["none", "resources"] = Field(
        "none", description="'resources': each role asks Ray for oasiskv_prefill / oasiskv_decode / oasiskv_store"
    )
    threads_per_worker: int | None = Field(None, ge=1)
    api_key: str | None = Field(default_factory=lambda: os.environ.get("OASISKV_API_KEY") or None)
    max_queued_requests: int = Field(64, ge=0, description="requests waiting for a decode pool before 429")
    request_timeout_s: float = Field(600.0, gt=0)
    start_timeout_s: float = Field(
        600.0, gt=0, description="how long serve waits, in all, for every store and worker to start: Ray places them "
        "once nodes with their resources join (on Kubernetes, once their pods are scheduled and pulled) and each loads "
        "its model",
    )
    shutdown_grace_s: float = Field(
        30.0, gt=0, description="on SIGTERM, how long requests in flight may run on; the rest are then aborted and "
        "the cluster shut down (keep it under Kubernetes' terminationGracePeriodSeconds)",
    )
    health_timeout_s: float = Field(5.0, gt=0, description="how long a worker has to answer a health poll")
    missed_polls_unhealthy: int = Field(
        3, ge=1, description="health polls in a row a worker may leave unanswered before requests stop going to it "
        "(a worker whose actor died is taken out at once)",
    )
    restart_broken_decode_workers: bool = Field(
        True, description="ask Ray to restart a decode worker that reports its engine broken for good (it reloads "
        "its model), as Kubernetes restarts a container that fails its liveness probe",
    )
    prefill_chunk_tokens: int = Field(1024, ge=16)
    prefix_cache_gb: float = Field(
        1.0, ge=0, description="host memory each prefill worker keeps of recent prompts' KV, so a prompt that begins as "
        "an earlier one did (a chat's next turn, a document asked again, the other choices of n > 1) is computed from "
        "where they part; 0 turns it off. The oasiskv prefill engine only (vLLM prefill workers run without one)",
    )
    summary_kind: Literal[SUMMARY_KINDS] = Field(
        DEFAULT_SUMMARY_KIND, description=f"how the stores summarize each block's keys for the sparse modes, one of "
        f"{list(SUMMARY_KINDS)} (kvstore/summary.py); the prefill names it in each request's layout",
    )
    prefill_engine: Literal["oasiskv", "vllm"] = Field(
        "oasiskv", description="'vllm': prefill actors run vLLM and write KV into the stores through OasisKVConnector"
    )
    vllm_kv_cache_gb: float = Field(1.0, gt=0, description="vLLM prefill actors' own KV cache (prefill_engine='vllm')")
    vllm_max_model_len: int | None = Field(None, ge=16, description="vLLM's max_model_len (default: the model's)")
    served_model_name: str | None = None

    @model_validator(mode="after")
    def _auto_dtype_follows_the_device(self) -> "ServeConfig":
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        return self

    @model_validator(mode="after")
    def _decode_device_follows(self) -> "ServeConfig":
        """`device` is the one switch; a decode.device set apart from it must agree with it."""
        if "device" in self.decode.model_fields_set:
            if parse_device(self.decode.device).type != self.device:
                raise ValueError(f"decode.device ({self.decode.device!r}) disagrees with device ({self.device!r}); "
                                 "set device only")
        elif self.decode.device != self.device:
            self.decode = self._decode_with(device=self.device)
        return self

    def _decode_with(self, **fields) -> DecodeConfig:
        """The decode config with `fields` set, validated again; what was set stays set."""
        return DecodeConfig(**{**self.decode.model_dump(exclude_unset=True), **fields})

    @model_validator(mode="after")
    def _keep_alive_within_ttl(self) -> "ServeConfig":
        """A decode worker must refresh its requests well inside the stores' TTL, or a request
        that waits in the queue is freed under it. Twice per TTL at least: one refresh may be
        held up by a store that is slow to answer."""
        if "store_keep_alive_s" not in self.decode.model_fields_set:
            keep_alive = min(30.0, self.store_ttl_s / 4)
            if keep_alive != self.decode.store_keep_alive_s:
                self.decode = self._decode_with(store_keep_alive_s=keep_alive)
        elif self.decode.store_keep_alive_s > self.store_ttl_s / 2:
            raise ValueError(f"decode.store_keep_alive_s ({self.decode.store_keep_alive_s:g} s) must be at most half of "
                             f"store_ttl_s ({self.store_ttl_s:g} s): the stores would free requests the decode workers "
                             "still hold")
        return self

    @model_validator(mode="after")
    def _prefix_cache_needs_the_oasiskv_prefill(self) -> "ServeConfig":
        if self.prefill_engine == "vllm" and "prefix_cache_gb" in self.model_fields_set and self.prefix_cache_gb > 0:
            raise ValueError("prefix_cache_gb is the oasiskv prefill engine's; vLLM prefill workers run without a "
                             "prefix cache (leave it out, or give 0)")
        return self

    @model_validator(mode="after")
    def _vllm_installed(self) -> "ServeConfig":
        if self.prefill_engine == "vllm":
            from ..prefill_node.vllm_worker import require_vllm

            require_vllm()
        return self

    @property
    def kv_itemsize(self) -> int:
        """Bytes per element of the workers' KV (the model dtype)."""
        return 4 if self.dtype == "float32" else 2

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def gpus_needed(self) -> float:
        """GPUs the prefill and decode workers ask Ray for, all together."""
        if self.device != "cuda":
            return 0.0
        return (self.prefill_workers + self.decode_workers) * self.gpus_per_worker

    def worker_threads(self) -> int | None:
        """Torch threads each prefill and decode worker is told to use. None with placement by
        role resources: each worker then splits its own node's CPUs (a pod's limit, not the
        head's cores) among the units of its role that node offers."""
        if self.threads_per_worker:
            return self.threads_per_worker
        if self.placement == "resources":
            return None
        return max(1, (os.cpu_count() or 2) // (self.prefill_workers + self.decode_workers))
