"""The prefill worker as a Ray actor: loads the target model once, prefills requests into the
store the router names, and returns the first token plus the predicted working set."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from ..kvstore import DEFAULT_SUMMARY_KIND, connect
from ..models.cpus import worker_threads
from ..models.device import require_device
from ..models.engine.stopping import request_eos_ids
from ..models.loader import load_model_dir
from ..models.pull import resolve_model
from ..models.sampling import SamplingParams
from ..models.structured_output import GrammarState
from ..models.tokenizer import load_tokenizer
from .cancellation import Cancellations, raise_if
from .prefill import Prefiller, PrefillResult, kv_layout_for
from .prefix_cache import PrefixCache


class PrefillWorker:
    def __init__(self, model: str, dtype: str = "float32", block_size: int = 16, chunk_tokens: int = 1024,
                 threads: int | None = None, transport: str = "auto",
                 summary_kind: str = DEFAULT_SUMMARY_KIND, device: str = "cpu", role_resource: str | None = None,
                 prefix_cache_gb: float = 0.0):
        require_device(device)  # before minutes of model loading
        _check_prefix_cache_fits(prefix_cache_gb)
        chosen = worker_threads(threads, role_resource)
        if chosen:
            torch.set_num_threads(chosen)
        model_dir = resolve_model(model, progress=False)
        self.model = load_model_dir(model_dir, dtype=getattr(torch, dtype), device=device)
        _check_prefix_cache_fits(prefix_cache_gb, _host_bytes(self.model, device),
                                 kv_layout_for(self.model, block_size).kv_bytes_per_block)
        # The first token's min_tokens must keep out every EOS the decode node stops on.
        self.tokenizer = load_tokenizer(model_dir)
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.transport = transport
        self.summary_kind = summary_kind
        self._prefillers: dict[str, Prefiller] = {}
        # One cache for every store: a prompt's KV is the same whichever store it is written to.
        self.prefix_cache = PrefixCache(int(prefix_cache_gb * 2**30), block_size)
        self._lock = threading.Lock()  # one prefill at a time: it uses every core it is given
        self.cancellations = Cancellations()

    def ready(self) -> bool:
        return True

    def _prefiller(self, store_address: str) -> Prefiller:
        if store_address not in self._prefillers:
            client = connect(store_address, transport=self.transport)
            self._prefillers[store_address] = Prefiller(self.model, client, self.block_size, self.chunk_tokens,
                                                        self.summary_kind, self.tokenizer, self.prefix_cache)
        return self._prefillers[store_address]

    def prefill(self, request_id: str, prompt_ids: list[int], params: dict, store_address: str,
                budget_blocks: int, sink_blocks: int, window_blocks: int) -> PrefillResult:
        sampling = SamplingParams(**params)
        with self.cancellations.tracking(request_id) as cancelled:
            # A structured output compiles before the prefill takes its turn: a schema takes seconds
            # against Qwen's vocabulary, and every other prompt waited behind it.
            grammar = GrammarState.for_params(sampling, self.tokenizer, self.model.config.vocab_size,
                                              request_eos_ids(self.model.config, self.tokenizer))
            with self._lock:
                raise_if(cancelled, request_id)  # cancelled while it waited for the prefills before it
                return self._prefiller(store_address).prefill(
                    request_id, prompt_ids, sampling, budget_blocks=budget_blocks, excluded_head_blocks=sink_blocks,
                    excluded_tail_blocks=window_blocks, cancelled=cancelled, grammar=grammar,
                )

    def cancel(self, request_id: str) -> bool:
        """Stop the prefill of `request_id` at its next chunk (or before it starts); its KV is
        freed from the store. False: none is queued or running here."""
        return self.cancellations.cancel(request_id)

    def free(self, request_id: str, store_address: str) -> None:
        """Drop a request's KV from the store (a request cancelled after its prefill)."""
        try:
            self._prefiller(store_address).client.free(request_id)
        except Exception:  # already freed by the decode side, or expired
            pass


def _memory_limit_bytes() -> int | None:
    """This process's memory: the machine's, or its cgroup's limit (a pod's) where lower."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    for cgroup_limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, v1
        try:
            text = Path(cgroup_limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def _host_bytes(model: torch.nn.Module, device: str) -> int:
    """What the model's weights take of host memory (none on a GPU)."""
    if device != "cpu":
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _check_prefix_cache_fits(prefix_cache_gb: float, model_bytes: int = 0, block_bytes: int = 0) -> None:
    """A cache is filled as prompts come; one the memory cannot hold beside the model would end in
    the OOM killer hours later, so it is refused when the worker starts (before the model loads,
    against the memory alone; after, with the model's weights). So is one that could not hold a
    single block, which would only cost each prompt a lookup."""
    cache_bytes = prefix_cache_gb * 2**30
    limit = _memory_limit_bytes()
    if limit is not None and cache_bytes + model_bytes >= limit:
        beside = f" beside its model's {model_bytes / 2**30:.1f} GiB" if model_bytes else ""
        raise ValueError(f"--prefix-cache-gb {prefix_cache_gb:g} does not fit this prefill worker's memory "
                         f"({limit / 2**30:.1f} GiB){beside}: it also holds the prompt it prefills, and every "
                         f"prefill worker on the machine has a cache of its own")
    if 0 < cache_bytes < block_bytes:
        raise ValueError(f"--prefix-cache-gb {prefix_cache_gb:g} holds not one block of this model's KV "
                         f"({block_bytes / 2**20:.2f} MiB); give 0 to turn the cache off")
