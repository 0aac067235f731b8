"""Arguments and entry point of `oasiskv bench serve`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

from .arrivals import arrival_offsets
from .datasets import TokenCounter, build_requests
from .report import format_report, record_json, result_record, save_json
from .runner import RunConfig, RunInterrupted, make_client, run_requests
from .sse import ENDPOINT_PATHS, RequestOptions, count_unreported_output_tokens, openai_error_message, send_request
from .stats import parse_goodput, summarize, timeline

MAX_PROMPTS = 1_000_000
# Longer than any served model's context, so a prompt over it could only be refused by the
# server; the whole dataset is held in memory before the run (several bytes a token).
MAX_PROMPT_TOKENS = 1 << 20
MAX_DATASET_TOKENS = 1 << 28


def add_arguments_bench(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    sub.required = True
    serve = sub.add_parser(
        "serve", formatter_class=parser.formatter_class,
        help="load-test an OpenAI-compatible endpoint (ours or vLLM's)",
        description="Stream requests to an OpenAI-compatible endpoint on an arrival schedule and "
                    "report throughput, goodput and TTFT/TPOT/ITL/E2E latency, as `vllm bench serve` does.")
    add_serve_arguments(serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server; the only address contacted (redirects are not followed)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions or /v1/chat/completions")
    target.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OASISKV_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OASISKV_API_KEY or $OPENAI_API_KEY)")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset", choices=("random", "files", "jsonl"), default="random",
                      help="random words, stretches of source files, or prompts from a JSONL file")
    data.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    data.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    data.add_argument("--random-output-len", type=int, default=128, help="random: max_tokens")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    data.add_argument("--files-dir", type=Path, default=None,
                      help="source files for long prompts (default: the Python standard library)")
    data.add_argument("--files-glob", default="*.py", help="files: which files under --files-dir")
    data.add_argument("--files-input-len", type=int, default=4096, help="files: prompt tokens")
    data.add_argument("--files-output-len", type=int, default=256, help="files: max_tokens")
    data.add_argument("--jsonl-path", type=Path, help='prompts, one {"prompt": ..., "max_tokens": ...} a line')
    data.add_argument("--jsonl-output-len", type=int, default=128, help="max_tokens when a line has none")
    data.add_argument("--tokenizer", help="tokenizer.json (or a directory with one) for exact prompt lengths, "
                                          "and to count output tokens when the server reports no usage")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second; inf sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 is Poisson, <1 burstier, >1 steadier")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrival schedule")
    load.add_argument("--temperature", type=float, default=0.0, help="sent with every request")
    load.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM/OasisKV extension)")
    load.add_argument("--no-stream-usage", action="store_true",
                      help="do not send stream_options.include_usage (servers that reject it); output tokens "
                           "are then counted with --tokenizer, or else one per chunk (a lower bound)")
    load.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds for each whole request, from sending it to its last byte (inf: no limit); "
                           "a request still running then fails")
    load.add_argument("--max-duration", type=float, default=3600.0,
                      help="seconds for the whole run; then requests in flight are cancelled (failed) and those "
                           "not yet sent are not sent (reported apart)")
    load.add_argument("--skip-initial-test", action="store_true",
                      help="do not send one short request first to check the endpoint")

    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                     help="SLOs for goodput, in ms: ttft:MS tpot:MS e2e:MS")
    out.add_argument("--percentiles", default="90,99", help="latency percentiles to report (0-100), e.g. 50,90,99")
    out.add_argument("--save-result", action="store_true", help="write a JSON record and a PNG plot")
    out.add_argument("--result-dir", type=Path, default=Path("."), help="where --save-result writes")
    out.add_argument("--result-filename", help="default: bench-serve-<endpoint>-<dataset>-<time>.json")
    out.add_argument("--no-plot", action="store_true", help="with --save-result: JSON only")
    out.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="stored in the JSON record")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) == "serve":
        return run_serve(args)
    print(f"oasiskv bench: unknown benchmark {getattr(args, 'bench_command', None)!r}", file=sys.stderr)
    return 2


def _check_args(args: argparse.Namespace) -> tuple[dict, list[float]]:
    url = urlsplit(args.base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"--base-url must be an http(s) URL, not {args.base_url!r}")
    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        raise ValueError(f"--num-prompts must be in 1..{MAX_PROMPTS}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not (args.max_duration > 0 and args.request_timeout > 0):
        raise ValueError("--max-duration and --request-timeout must be > 0")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), not {args.request_rate:g}")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness (the gamma shape of the arrival gaps) must be a finite number > 0, "
                         f"not {args.burstiness:g}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), not {args.random_range_ratio:g}")
    if args.dataset == "jsonl" and not args.jsonl_path:
        raise ValueError("--dataset jsonl needs --jsonl-path")
    if args.result_filename is not None and not args.save_result:
        raise ValueError("--result-filename is written only with --save-result: add --save-result, or leave "
                         "--result-filename out")
    # A flag read only by another dataset would be ignored, and the run quietly use other prompts.
    for flag, value, dataset in (("--jsonl-path", args.jsonl_path, "jsonl"), ("--files-dir", args.files_dir, "files")):
        if value is not None and args.dataset != dataset:
            raise ValueError(f"{flag} is read only with --dataset {dataset}, and the dataset is {args.dataset}: "
                             f"add --dataset {dataset}, or leave {flag} out")
    for name in ("random_input_len", "random_output_len", "files_input_len", "files_output_len", "jsonl_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    _check_input_lengths(args)
    try:
        percentiles = [float(p) for p in str(args.percentiles).split(",") if p.strip()]
    except ValueError as exc:
        raise ValueError(f"--percentiles must be numbers separated by commas, got {args.percentiles!r}") from exc
    if any(not 0 <= p <= 100 for p in percentiles):  # what numpy.percentile takes, as vLLM's accepts
        raise ValueError("--percentiles must be between 0 and 100")
    malformed = [item for item in args.metadata if "=" not in item or item.startswith("=")]
    if malformed:
        raise ValueError(f"--metadata takes KEY=VALUE items, got {malformed[0]!r}")
    if args.save_result:
        _check_result_path(args)
    return parse_goodput(args.goodput), percentiles


def _result_path(args: argparse.Namespace, stamp: str) -> Path:
    """Where --save-result writes its JSON: --result-filename under --result-dir (an absolute
    --result-filename, or one with a folder of its own, names its folder itself)."""
    name = args.result_filename or f"bench-serve-{args.endpoint}-{args.dataset}-{stamp}.json"
    return Path(args.result_dir) / name


def _check_result_path(args: argparse.Namespace) -> None:
    """Before the run, not after it: a folder that cannot be made or written threw away a whole
    run's results (--result-dir, and then a --result-filename with a folder of its own)."""
    checks = []
    name = args.result_filename
    if name is not None:
        if not Path(name).name or Path(name).name in (".", "..") or name.endswith("/"):
            raise ValueError(f"--result-filename {name!r} names no file")
    if name is None or not Path(name).is_absolute():
        checks.append(("--result-dir", Path(args.result_dir)))
    target = Path(args.result_dir) / name if name is not None else None  # as _result_path names it
    if target is not None and Path(name).parent != Path("."):
        checks.append(("--result-filename", target.parent))
    for flag, folder in checks:
        try:
            folder.mkdir(parents=True, exist_ok=True)  # as vLLM's bench serve makes it
        except OSError as exc:
            raise ValueError(f"{flag}: the folder {str(folder)!r} cannot be made: {exc}") from exc
        try:
            tempfile.TemporaryFile(dir=folder).close()  # a real write: root passes os.access everywhere
        except OSError as exc:
            raise ValueError(f"{flag}: cannot write in the folder {str(folder)!r}: {exc}") from exc
    if target is not None and target.exists() and (target.is_dir() or not os.access(target, os.W_OK)):
        raise ValueError(f"--result-filename: {str(target)!r} exists and is not a file this user can write")


def _check_input_lengths(args: argparse.Namespace) -> None:
    """Refuse prompts too long for any model before building them, which could take more memory
    than the machine has."""
    name, length = {"random": ("--random-input-len", args.random_input_len),
                    "files": ("--files-input-len", args.files_input_len)}.get(args.dataset, (None, 0))
    if name is None:
        return
    ratio = args.random_range_ratio if args.dataset == "random" else 0.0
    longest = int(length * (1 + ratio))
    if longest > MAX_PROMPT_TOKENS:
        raise ValueError(f"{name} {length} makes prompts of up to {longest} tokens; the limit is "
                         f"{MAX_PROMPT_TOKENS} (longer than any model's context)")
    if length * args.num_prompts > MAX_DATASET_TOKENS:
        raise ValueError(f"{args.num_prompts} prompts of {length} tokens ({length * args.num_prompts} in all) are over "
                         f"the {MAX_DATASET_TOKENS} tokens a run may hold in memory; send fewer or shorter prompts")


_MODELS_SHAPE = 'expected OpenAI\'s {"object": "list", "data": [{"id": "<model>", ...}, ...]}'
_QUOTE_CHARS = 200


def _one_line(text: str, limit: int = _QUOTE_CHARS) -> str:
    """`text` on one line (whitespace runs made one space), cut to `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


async def _discover_model(config: RunConfig) -> str:
    async with make_client(config, 1) as client:
        response = await client.get("/v1/models")
    body = response.text
    if not response.is_success:
        refusal = openai_error_message(body)
        if refusal is not None:
            raise ValueError(f"GET /v1/models answered HTTP {response.status_code}: {_one_line(refusal)}"
                             f"{_hint(response.status_code, refusal) or '; pass --model'}")
        raise ValueError(f"GET /v1/models answered HTTP {response.status_code}: {_one_line(body)!r}; "
                         "pass --model, or check --base-url")
    try:
        listing = json.loads(body)
    except ValueError:
        listing = None
    models = listing.get("data") if isinstance(listing, dict) else None
    if not (isinstance(models, list)
            and all(isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"] for m in models)):
        raise ValueError(f"the server's /v1/models answer is not OpenAI-shaped ({_MODELS_SHAPE}, "
                         f"got {_one_line(body)!r}); pass --model")
    if not models:
        raise ValueError("the server lists no models; pass --model")
    return models[0]["id"]


async def _initial_test(config: RunConfig, request) -> str | None:
    """None if one short request succeeds, else what went wrong, on one line."""
    probe = replace(request, max_tokens=min(request.max_tokens, 4))
    async with make_client(config, 1) as client:
        result = await send_request(client, -1, probe, config.options, time.perf_counter(), config.request_timeout_s)
    if result.success:
        return None
    where = f"POST {ENDPOINT_PATHS[config.options.endpoint]}"
    if not result.http_status:  # no answer at all: the address is what to check
        return f"{where}: {_one_line(result.error)}"
    if result.server_message is not None:
        # An OpenAI-compatible server that refused the request: its reason, and the flag behind it.
        said = result.error if result.http_status == 200 else f"HTTP {result.http_status}: {result.server_message}"
        return f"{where}: {_one_line(said)}{_hint(result.http_status, result.server_message)}"
    # An answer, but not OpenAI's (a web page, say): its first characters, not all of it.
    return (f"{where}: {_one_line(result.error)}; expected an OpenAI-compatible streamed answer "
            "(HTTP 200, server-sent events 'data: {...}' ending with 'data: [DONE]'): check --base-url and --endpoint")


def _hint(status: int, refusal: str) -> str:
    """The flag behind an OpenAI-compatible server's refusal, where one is."""
    if status in (401, 403):
        return "; check --api-key"
    if status == 404 and "model" in refusal.lower():
        return "; check --model"
    return ""


def _progress(total: int, disabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=disabled, file=sys.stderr)


async def _serve(args: argparse.Namespace) -> int:
    try:
        slos, percentiles = _check_args(args)
        rng = np.random.default_rng(args.seed)
        counter = TokenCounter(args.tokenizer)
        requests = build_requests(args, rng, counter)
        try:
            offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, rng)
        except ValueError as exc:  # each flag was checked alone; together they can still overflow
            raise ValueError(f"--request-rate and --burstiness together: {exc}") from None
    except (ValueError, OSError) as exc:
        print(f"oasiskv bench serve: {exc}", file=sys.stderr)
        return 2

    options = RequestOptions(endpoint=args.endpoint, model=args.model or "", temperature=args.temperature,
                             ignore_eos=args.ignore_eos, stream_usage=not args.no_stream_usage)
    config = RunConfig(base_url=args.base_url.rstrip("/"), api_key=args.api_key, options=options,
                       request_rate=args.request_rate, burstiness=args.burstiness,
                       max_concurrency=args.max_concurrency, request_timeout_s=args.request_timeout,
                       max_duration_s=args.max_duration)
    if not args.model:
        try:
            config = replace(config, options=replace(options, model=await _discover_model(config)))
        except (httpx.HTTPError, ValueError) as exc:
            print(f"oasiskv bench serve: cannot list models at {args.base_url}: {exc}", file=sys.stderr)
            return 1
    if not args.skip_initial_test:
        error = await _initial_test(config, requests[0])
        if error:
            print(f"oasiskv bench serve: the initial test request failed: {error}", file=sys.stderr)
            return 1

    interrupted = False
    with _progress(len(requests), args.disable_tqdm) as bar:
        try:
            results, duration = await run_requests(requests, offsets, config, on_done=lambda _: bar.update(1))
        except RunInterrupted as stop:  # Ctrl-C: asyncio.run cancelled this task; report what finished
            asyncio.current_task().uncancel()
            results, duration, interrupted = stop.results, stop.duration, True
    if counter.exact:  # after the run: tokenizing between chunks would delay other requests' timestamps
        count_unreported_output_tokens(results, counter.count)

    summary = summarize(results, duration, slos, percentiles)
    if interrupted:
        cut = summary["errors"].get("cancelled", 0)
        print(f"oasiskv bench serve: interrupted after {duration:.1f} s: "
              f"{summary['completed'] + summary['failed'] - cut} of {len(results)} requests ended, {cut} cancelled in "
              f"flight, {summary['not_sent']} not sent; the results are partial"
              + (" (saved below, marked partial)" if args.save_result else ""), file=sys.stderr)
    run_config = {
        "base_url": config.base_url, "endpoint": args.endpoint, "model": config.options.model,
        "dataset": args.dataset, "num_prompts": args.num_prompts, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
        "temperature": args.temperature, "ignore_eos": args.ignore_eos,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "metadata": dict(item.split("=", 1) for item in args.metadata),
    }
    print(format_report(summary, run_config, partial=interrupted))

    saved = True
    if args.save_result:
        series = timeline(results, duration)
        wanted = _result_path(args, time.strftime("%Y%m%d-%H%M%S"))
        path = _save_record(result_record(summary, run_config, series, results, partial=interrupted), wanted)
        saved = path == wanted
        if path is not None:
            print(f"result: {path}")
        if path is not None and not args.no_plot:
            from .plot import save_plot

            title = f"{config.options.model} @ {config.base_url} ({args.dataset}, rate {args.request_rate:g}/s)"
            try:
                print(f"plot:   {save_plot(results, series, title, path.with_suffix('.png'))}")
            except OSError as exc:
                print(f"oasiskv bench serve: cannot write the plot to {path.with_suffix('.png')}: {exc}",
                      file=sys.stderr)
    if interrupted:
        return 130  # as a shell reports a command ended by Ctrl-C
    # requests left unsent by --max-duration are not failures; results not where --save-result
    # was asked to put them are
    return 0 if summary["failed"] == 0 and saved else 1


def _save_record(record: dict, path: Path) -> Path | None:
    """Writes the JSON record to `path`, checked before the run; should that still fail (the
    disk filled, the folder went), a whole run's results are not thrown away: they go to a new
    file in the temporary folder, or, failing that too, to stdout (None is returned)."""
    try:
        return save_json(record, path)
    except OSError as exc:
        print(f"oasiskv bench serve: cannot write the results to {path}: {exc}", file=sys.stderr)
    fallback = None
    try:
        with tempfile.NamedTemporaryFile("w", prefix=f"{path.stem}-", suffix=".json", delete=False) as file:
            fallback = Path(file.name)
            file.write(record_json(record))
    except OSError as exc:
        if fallback is not None:
            with contextlib.suppress(OSError):
                fallback.unlink()  # half written
        print(f"oasiskv bench serve: nor to the temporary folder ({exc}); the JSON record follows on stdout",
              file=sys.stderr)
        print(record_json(record), end="")
        return None
    print(f"oasiskv bench serve: the results are in {fallback} instead", file=sys.stderr)
    return fallback


def run_serve(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:  # before the run began (during the run it is reported), or a second Ctrl-C
        print("oasiskv bench serve: interrupted", file=sys.stderr)
        return 130
