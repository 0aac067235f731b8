"""A vLLM KV connector that prefills into an OasisKV store.

Load it into a vLLM prefill instance with

    KVTransferConfig(kv_connector="OasisKVConnector",
                     kv_connector_module_path="oasiskv.prefill_node.vllm_connector",
                     kv_role="kv_producer",
                     kv_connector_extra_config={"block_size": 16, "transport": "auto"})

and give each request that should land in a store
`SamplingParams(extra_args={"kv_transfer_params": {"oasiskv_request_id": ..., "oasiskv_store": "host:port"}})`.
Requests without these parameters are served by vLLM as usual.

Scheduler side: follows each such request's vLLM blocks and, in the step that computes its last
prompt token, hands the worker the slots of the whole prompt. Worker side: as each attention
layer finishes that step, reads the layer's K/V for the prompt out of vLLM's paged cache and
writes it to the store (which keeps the key summaries); `wait_for_save` waits for the
writes. `request_finished` returns the store descriptor in the request's `kv_transfer_params`,
so an OasisKV decode worker can take the request over. A write that fails frees the request in
the store, so the caller sees an unknown request rather than partial KV.

Only vLLM's CPU attention backend is read today: its per-layer cache is
[blocks, kv_heads, block_size, 2 * head_dim], with an element order inside a block that depends
on the instruction set; that order is learned once from the backend's own cache-write kernel
rather than assumed.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..kvstore import DEFAULT_SUMMARY_KIND, KVLayout, connect, pack_layer

log = logging.getLogger(__name__)

REQUEST_ID_PARAM = "oasiskv_request_id"
STORE_PARAM = "oasiskv_store"
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class PromptSave:
    """One request whose prompt KV goes to the store during this step."""

    vllm_request_id: str
    store_request_id: str
    store_address: str
    num_tokens: int
    block_ids: list[int]


@dataclass
class OasisKVConnectorMetadata(KVConnectorMetadata):
    saves: list[PromptSave] = field(default_factory=list)


@dataclass
class _Followed:
    store_request_id: str
    store_address: str
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    saved: bool = False


def layout_from_vllm(vllm_config, block_size: int, summary_kind: str = DEFAULT_SUMMARY_KIND) -> KVLayout:
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = vllm_config.cache_config.cache_dtype
    if dtype not in ("auto", None):
        raise NotImplementedError(f"OasisKVConnector stores unquantized KV; vLLM was started with kv_cache_dtype={dtype!r}")
    return KVLayout(
        model_config.get_num_layers(parallel),
        model_config.get_num_kv_heads(parallel),
        model_config.get_head_size(),
        block_size,
        model_config.dtype,
        summary_kind,
    )


def learn_cpu_block_order(isa: str, dtype: torch.dtype, block_size: int, head_dim: int,
                          write=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the CPU backend puts token t, channel d of K and of V inside one (block, head).

    Writes known tensors (K = V = token index, then = channel index) into a one-block scratch
    cache with the backend's own kernel and reads back where each landed. Returns two
    [block_size, head_dim] long tensors of flat offsets into a [block_size * 2 * head_dim] block."""
    if write is None:
        from vllm import _custom_ops as ops

        write = ops.cpu_attn_reshape_and_cache
    if max(block_size, head_dim) - 1 > 256 and dtype == torch.bfloat16:
        raise NotImplementedError(f"cannot learn the cache order of bf16 blocks of {block_size} x {head_dim} exactly")
    token = torch.arange(block_size, dtype=dtype)[:, None, None].expand(block_size, 1, head_dim).contiguous()
    channel = torch.arange(head_dim, dtype=dtype)[None, None, :].expand(block_size, 1, head_dim).contiguous()
    slots = torch.arange(block_size, dtype=torch.long)
    seen = []
    for probe in (token, channel):
        scratch = torch.full((1, 1, block_size, 2 * head_dim), -1.0, dtype=dtype)
        key_cache, value_cache = scratch.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
        write(probe, probe, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")
        seen.append(scratch.flatten().long())
    token_at, channel_at = seen
    half = block_size * head_dim
    orders = []
    for region in (slice(0, half), slice(half, 2 * half)):  # K rows come first, then V rows
        offsets = torch.arange(region.start, region.stop)
        index = token_at[region] * head_dim + channel_at[region]
        if (token_at[region] < 0).any() or torch.unique(index).numel() != half:
            raise NotImplementedError(f"vLLM's CPU cache order for isa={isa!r} is not a permutation of a block")
        order = torch.empty(half, dtype=torch.long)
        order[index] = offsets
        orders.append(order.view(block_size, head_dim))
    return orders[0], orders[1]


class PromptKVReader:
    """Reads a prompt's K/V ([tokens, kv_heads, head_dim] each) out of one layer of vLLM's CPU cache."""

    def __init__(self, key_order: torch.Tensor, value_order: torch.Tensor):
        self.key_order = key_order
        self.value_order = value_order

    def read(self, kv_layer: torch.Tensor, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks, kv_heads, block_size, _ = kv_layer.shape
        flat = kv_layer.view(num_blocks, kv_heads, -1)
        positions = torch.arange(num_tokens)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
        offsets = positions % block_size
        heads = torch.arange(kv_heads)
        keys = flat[blocks[:, None, None], heads[None, :, None], self.key_order[offsets][:, None, :]]
        values = flat[blocks[:, None, None], heads[None, :, None], self.value_order[offsets][:, None, :]]
        return keys, values


class OasisKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = int(extra.get("block_size", 16))
        self.transport = str(extra.get("transport", "auto"))
        self.layout = layout_from_vllm(vllm_config, self.block_size, str(extra.get("summary_kind", DEFAULT_SUMMARY_KIND)))
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise NotImplementedError(
                f"this model has {len(groups)} KV-cache groups (sliding-window layers keep only their window); "
                "OasisKVConnector needs every layer's full prompt KV: start vLLM with disable_hybrid_kv_cache_manager=True"
            )
        # scheduler side
        self._followed: dict[str, _Followed] = {}
        # worker side
        self._clients: dict[str, Any] = {}
        self._readers: dict[tuple, PromptKVReader] = {}
        self._pending: list = []
        self._failed: set[str] = set()
        self._allocated: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if REQUEST_ID_PARAM in params and request.request_id not in self._followed:
            if not params.get(STORE_PARAM):  # raising here would stop the engine for every request
                log.error("request %s: kv_transfer_params has %s but no %s (the store's host:port); not saved",
                          request.request_id, REQUEST_ID_PARAM, STORE_PARAM)
                return 0, False
            self._followed[request.request_id] = _Followed(
                str(params[REQUEST_ID_PARAM]), str(params[STORE_PARAM]), len(request.prompt_token_ids or []))
        return 0, False  # a producer never loads KV

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output) -> OasisKVConnectorMetadata:
        meta = OasisKVConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            followed = self._followed.get(new.req_id)
            if followed is not None:
                followed.block_ids = list(new.block_ids[0])
                self._maybe_save(meta, new.req_id, followed, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            followed = self._followed.get(req_id)
            if followed is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                followed.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                followed.block_ids.extend(new_blocks[0])
            self._maybe_save(meta, req_id, followed, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    @staticmethod
    def _maybe_save(meta: OasisKVConnectorMetadata, req_id: str, followed: _Followed, computed_after_step: int) -> None:
        if followed.saved or computed_after_step < followed.num_prompt_tokens:
            return
        followed.saved = True
        meta.saves.append(PromptSave(req_id, followed.store_request_id, followed.store_address,
                                     followed.num_prompt_tokens, list(followed.block_ids)))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        followed = self._followed.pop(request.request_id, None)
        if followed is None:
            return False, None
        params = {
            REQUEST_ID_PARAM: followed.store_request_id,
            STORE_PARAM: followed.store_address,
            "num_tokens": followed.num_prompt_tokens,
            "saved": followed.saved,
            "layout": self.layout.to_wire(),
        }
        return False, params  # the save completed inside the step (wait_for_save)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, cache in kv_caches.items():  # fail at start-up, not in the first request
            self._require_cpu_cache(name, cache)

    def _require_cpu_cache(self, layer_name: str, cache: torch.Tensor) -> None:
        if cache.device.type != "cpu" or cache.dim() != 4 or cache.shape[-1] != 2 * self.layout.head_dim:
            raise NotImplementedError(
                "OasisKVConnector reads vLLM's CPU attention cache ([blocks, kv_heads, block_size, 2*head_dim]); "
                f"layer {layer_name} has a {cache.device.type} cache of shape {tuple(cache.shape)}"
            )

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, OasisKVConnectorMetadata) or not meta.saves:
            return
        layer = _layer_index(layer_name)
        reader = self._reader_for(layer_name, kv_layer)
        for save in meta.saves:
            if save.store_request_id in self._failed:
                continue
            try:
                client = self._client(save.store_address)
                if save.store_request_id not in self._allocated:
                    client.allocate(save.store_request_id, self.layout, save.num_tokens)
                    self._allocated.add(save.store_request_id)
                keys, values = reader.read(kv_layer, save.block_ids, save.num_tokens)
                packed = pack_layer(keys, values, self.block_size).cpu()
                self._pending.append((save, client.write_layer(save.store_request_id, layer, packed), packed))
            except Exception as exc:  # the engine must keep serving; the caller sees the request missing
                self._fail(save, exc)

    def wait_for_save(self) -> None:
        pending, self._pending = self._pending, []
        for save, handle, _buffer in pending:
            try:
                handle.wait()
            except Exception as exc:
                self._fail(save, exc)
        for save in {save.store_request_id: save for save, _handle, _buffer in pending}.values():
            if save.store_request_id not in self._failed:  # the decode node takes it over
                self._clients[save.store_address].release(save.store_request_id)
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        for save in getattr(meta, "saves", []):
            self._allocated.discard(save.store_request_id)
            self._failed.discard(save.store_request_id)

    def _fail(self, save: PromptSave, exc: Exception) -> None:
        log.error("OasisKVConnector: writing %s to the store at %s failed: %s: %s",
                  save.store_request_id, save.store_address, type(exc).__name__, exc)
        self._failed.add(save.store_request_id)
        if save.store_request_id in self._allocated:
            try:
                self._clients[save.store_address].free(save.store_request_id)
            except Exception:  # the store is gone: nothing left to free
                pass

    def _client(self, address: str):
        with self._lock:
            if address not in self._clients:
                self._clients[address] = connect(address, transport=self.transport)
            return self._clients[address]

    def _reader_for(self, layer_name: str, kv_layer: torch.Tensor) -> PromptKVReader:
        from vllm.forward_context import get_forward_context

        attention = get_forward_context().no_compile_layers.get(layer_name)
        isa = getattr(attention, "isa", None)
        head_dim = self.layout.head_dim
        self._require_cpu_cache(layer_name, kv_layer)
        if isa is None:
            raise NotImplementedError(f"layer {layer_name} is not run by vLLM's CPU attention backend (no `isa`), "
                                      "the only cache layout OasisKVConnector reads")
        key = (isa, kv_layer.dtype, kv_layer.shape[2], head_dim)
        if key not in self._readers:
            self._readers[key] = PromptKVReader(*learn_cpu_block_order(isa, kv_layer.dtype, kv_layer.shape[2], head_dim))
        return self._readers[key]

    def shutdown(self) -> None:
        for client in self._clients.values():
            try:
                client.close()
            except Exception:
                pass
        self._clients.clear()


def _layer_index(layer_name: str) -> int:
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"cannot tell the layer index of vLLM attention layer {layer_name!r}")
    return int(match.group(1))
