"""`oasiskv serve`: the OpenAI-compatible cluster (Ray + prefill, decode and store actors)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_arguments_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registry name, HF directory or .gguf file")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="the API's address (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000, help="the API's port")
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster (e.g. auto, HOST:6379; default: start a local one)")
    parser.add_argument("--prefill-workers", type=int, default=1, help="prefill worker actors")
    parser.add_argument("--decode-workers", type=int, default=1, help="decode worker actors")
    parser.add_argument("--stores", type=int, default=1, help="KV store actors; requests are spread over them")
    parser.add_argument("--store-capacity-gb", type=float, default=1.0,
                        help="host memory each store preallocates for whole requests' KV and key summaries")
    parser.add_argument("--store-port", type=int, default=0, help="first store's port (0: any free port)")
    parser.add_argument("--store-ttl-s", type=float, default=600.0,
                        help="a store frees a request nobody has touched for this long (its decode worker died, say); "
                             "decode workers refresh what they hold every quarter of it, at most every 30 s")
    parser.add_argument("--fetch-timeout-s", type=float, default=None,
                        help="a decode worker ends a request whose store has not answered a read or write this long "
                             "after it was issued; the rest of the batch decodes on (default: 30)")
    parser.add_argument("--transport", choices=["auto", "nixl", "tcp"], default="auto",
                        help="how decode workers read KV from the stores (auto: NIXL where installed)")
    parser.add_argument("--placement", choices=["none", "resources"], default="none",
                        help="'resources': roles go where Ray advertises oasiskv_prefill/decode/store")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the workers' weights and KV (default auto: bfloat16 with --device cuda, else float32)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="where prefill and decode workers run the model and the decode KV pool lives; 'cuda' gives "
                             "each of them --gpus-per-worker of a Ray GPU (default: $OASISKV_DEVICE, else cpu)")
    parser.add_argument("--gpus-per-worker", type=float, default=1.0,
                        help="GPU share per prefill and decode worker with --device cuda (0.5: two share a GPU)")
    parser.add_argument("--mode", choices=["dense", "sparse-current", "lookahead"], default="lookahead",
                        help="dense: the whole KV fetched at admission; sparse-current: the current query's top-K "
                             "fetched on demand; lookahead: the draft rows' top-K prefetched in the background")
    parser.add_argument("--kv-pool-gb", type=float, default=1.0,
                        help="device KV pool per decode worker: working sets and their key summaries")
    parser.add_argument("--budget-tokens", type=int, default=2048,
                        help="sparse modes: tokens of KV each request holds per layer and KV head, besides the sink "
                             "and the local window (a multiple of 16)")
    parser.add_argument("--num-draft-tokens", type=int, default=3,
                        help="drafts verified per step (0: plain decoding)")
    parser.add_argument("--drafter", default="ngram", help="'ngram' or a draft model name")
    parser.add_argument("--draft-window-tokens", type=int, default=None,
                        help="draft model: recent tokens its KV keeps besides the first 16 (default 1024; Qwen 0.5B "
                             "drafting stdlib text had 62.7%% of drafts accepted at 1024, 58.8%% at 512)")
    parser.add_argument("--draft-catch-up-budget", type=int, default=None,
                        help="draft model: tokens a step may feed new requests' catch-ups beyond each one's first "
                             "chunk of 256 (default: one request's whole catch-up; 0: one chunk per request a step)")
    parser.add_argument("--max-replace-fraction", type=float, default=None,
                        help="budget share each layer and KV head may replace per decode step, on average "
                             "(default 0.05; measured at 8K on Qwen 0.5B over four texts, 0.01 fetched 5x fewer bytes while "
                             "decoding but perplexity rose from +1.0%% to +2.1%% of dense; --prefetch-rank-fraction saves "
                             "as much without that loss: bench/sparse_quality.py)")
    parser.add_argument("--lookahead-topup-blocks", type=int, default=None,
                        help="lookahead: before attending, also fetch (and wait for) up to this many of the current "
                             "query's top blocks per layer and KV head that the prediction missed (default 0; measured "
                             "at 8K on Qwen 0.5B, 4 brought perplexity from +0.97%% to +0.11%% of dense for 1.6x the "
                             "bytes: bench/sparse_quality.py)")
    parser.add_argument("--prefetch-rank-fraction", type=float, default=None,
                        help="lookahead: prefetch a missing block only when the prediction ranks it within this share "
                             "of the top-K; lower-ranked blocks stay if resident but are not fetched (default 0.25; "
                             "measured at 8K on Qwen 0.5B, 0.25 fetched 4x fewer bytes while decoding than 1, at the "
                             "same agreement and perplexity: bench/sparse_quality.py)")
    parser.add_argument("--lookahead-layer-group", type=int, default=None,
                        help="lookahead: rank, plan and fetch the draft rows' blocks once per this many layers, for all "
                             "of them together (default 4; 1: after every layer). Each call's fixed cost is paid once per "
                             "group; measured at bf16 8K on Qwen 0.5B, lookahead went from 1.93x to 2.11x dense "
                             "tokens/s with it (medians of 3 runs, the same blocks fetched: bench/RESULTS.md)")
    parser.add_argument("--miss-policy", choices=["wait", "skip"], default=None,
                        help="lookahead: when a layer's prefetch has not landed, 'wait' for it (default) or 'skip' it "
                             "(attend without the blocks still in flight; the model never blocks on a prefetch); "
                             "counted either way (oasiskv_prefetch_waits_total / oasiskv_prefetch_skips_total)")
    parser.add_argument("--summary-kind", choices=["moments", "minmax"], default=None,
                        help="how blocks' keys are summarized for the sparse modes' ranking: 'moments' (mean +- std) or "
                             "'minmax' (Quest's box); same bytes (default: moments)")
    parser.add_argument("--threads-per-worker", type=int, default=None,
                        help="torch threads of each prefill and decode worker (default: this machine's CPUs split among the "
                             "workers; with --placement resources, its own node's CPUs split among the units of its "
                             "role that node offers)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or OASISKV_API_KEY)")
    parser.add_argument("--max-queued-requests", type=int, default=64,
                        help="requests waiting for a worker at most; more are refused with a 429")
    parser.add_argument("--request-timeout-s", type=float, default=600.0,
                        help="a request still running this long after it arrived is aborted")
    parser.add_argument("--start-timeout-s", type=float, default=600.0,
                        help="how long to wait, in all, for every store and worker to be placed by Ray and start")
    parser.add_argument("--shutdown-grace-s", type=float, default=30.0,
                        help="on SIGTERM or Ctrl-C, how long requests in flight may run on before they are aborted "
                             "and the cluster is shut down")
    parser.add_argument("--prefix-cache-gb", type=float, default=None,
                        help="host memory each prefill worker keeps of recent prompts' KV, in whole blocks, so a prompt "
                             "that begins as an earlier one did (a chat's next turn, a document asked again, the other "
                             "choices of n > 1) is prefilled from where they part (default 1; 0: off; the oasiskv "
                             "prefill engine only)")
    parser.add_argument("--prefill-engine", choices=["oasiskv", "vllm"], default="oasiskv",
                        help="'vllm': prefill with vLLM (the vllm extra) through OasisKVConnector")
    parser.add_argument("--vllm-kv-cache-gb", type=float, default=1.0, help="vLLM prefill workers' own KV cache")
    parser.add_argument("--vllm-max-model-len", type=int, default=None,
                        help="vLLM prefill workers' longest prompt (default: the model's context length)")


def config_from_args(args: argparse.Namespace):
    from .config import ServeConfig

    decode = {"mode": args.mode, "kv_pool_gb": args.kv_pool_gb, "budget_tokens": args.budget_tokens,
              "num_draft_tokens": args.num_draft_tokens, "drafter": args.drafter}
    # Options left unset keep DecodeConfig's defaults (the flags are named after its fields).
    for name in ("max_replace_fraction", "lookahead_topup_blocks", "prefetch_rank_fraction", "lookahead_layer_group",
                 "draft_window_tokens", "draft_catch_up_budget", "miss_policy", "fetch_timeout_s"):
        if getattr(args, name) is not None:
            decode[name] = getattr(args, name)
    fields = dict(model=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port,
                  address=args.address, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                  stores=args.stores, store_capacity_gb=args.store_capacity_gb, store_port=args.store_port,
                  store_ttl_s=args.store_ttl_s,
                  transport=args.transport, placement=args.placement, dtype=args.dtype, decode=decode,
                  gpus_per_worker=args.gpus_per_worker,
                  threads_per_worker=args.threads_per_worker, max_queued_requests=args.max_queued_requests,
                  request_timeout_s=args.request_timeout_s, start_timeout_s=args.start_timeout_s,
                  shutdown_grace_s=args.shutdown_grace_s,
                  prefill_engine=args.prefill_engine,
                  vllm_kv_cache_gb=args.vllm_kv_cache_gb, vllm_max_model_len=args.vllm_max_model_len)
    if args.api_key:
        fields["api_key"] = args.api_key
    if args.summary_kind:
        fields["summary_kind"] = args.summary_kind
    if args.prefix_cache_gb is not None:  # left unset, so that the vLLM engine can refuse it only when given
        fields["prefix_cache_gb"] = args.prefix_cache_gb
    if args.device:
        fields["device"] = args.device
    return ServeConfig(**fields)


# The draft-model flags change nothing with n-gram drafts (the drafter is the server's, not a
# request's): someone tuning a deployment should hear so at start-up rather than infer it from
# unchanged metrics. The lookahead flags are read whatever --mode is: a request may ask for
# lookahead itself (oasiskv_mode).
_DRAFT_MODEL_ONLY_FLAGS = ("draft_window_tokens", "draft_catch_up_budget")


def unread_flags(args: argparse.Namespace, config) -> list[str]:
    """One line for each flag given that the configured drafter does not read."""
    if config.decode.drafter != "ngram":
        return []
    return [f"--{name.replace('_', '-')} is read only with a draft model: ignored with --drafter ngram"
            for name in _DRAFT_MODEL_ONLY_FLAGS if getattr(args, name) is not None]


def run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from ..config_errors import describe
    from ..models.errors import ModelError
    from .launcher import ClusterUnreachable, NotEnoughGPUs, WorkerStartFailed
    from .server import PortUnavailable, run_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValidationError as error:
        message = describe(error, args)
        if not args.device and os.environ.get("OASISKV_DEVICE"):  # the flag's default came from there
            message = message.replace("--device:", "--device (from $OASISKV_DEVICE):")
        print(f"error: invalid configuration: {message}", file=sys.stderr)
        return 2
    for line in unread_flags(args, config):
        logging.getLogger("oasiskv.serve").warning(line)
    try:
        run_server(config)
    except (ModelError, NotEnoughGPUs, WorkerStartFailed, PortUnavailable, ClusterUnreachable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
