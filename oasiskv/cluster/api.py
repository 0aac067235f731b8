"""OpenAI-compatible REST API (FastAPI): completions and chat, streaming or not, models,
vLLM's tokenize and detokenize, health and metrics. Errors use OpenAI's error JSON with the
matching HTTP status."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import re
import secrets
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..models.sampling import (
    SamplingParams,
    TokenLogprob,
    require_known_allowed_tokens,
    require_known_bias_tokens,
    require_known_stop_tokens,
    require_tokenized_bad_words,
    stream_seed,
    tokenize_bad_words,
)
from ..models.structured_output import COMPILE_LIMIT_S, compile_spec
from ..prefill_node.vllm_worker import vllm_prefill_refusal
from .logprobs import EchoLogprobsGate, LogprobFormatter, PromptLogprobs
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UnsupportedFeature,
    error_body,
    new_id,
    now,
)
from .router import Overloaded, TooLarge
from .service import ClusterService, ShuttingDown
from .tool_calls import ToolCallStream, ToolChoice, finish_reason, parse_reply, template_messages

log = logging.getLogger("oasiskv.api")

MAX_BODY_BYTES = 8 * 2**20
DEFAULT_MAX_TOKENS = 16
# vLLM serves these at the root, not under /v1; they tokenize as much as a completion does, so
# the API key and the body limit cover them too.
TOKENIZER_PATHS = ("/tokenize", "/detokenize")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers or {}


class _BodyLimit:
    """Counts the bytes of a request body as they arrive: a chunked body has no Content-Length for
    the middleware to check, and one of 9 MB was read and tokenized for 13 s before it was refused."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # FastAPI passes an HTTPException raised while reading on
                    raise StarletteHTTPException(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, counted, send)


def create_app(service: ClusterService, lifespan=None) -> FastAPI:
    app = FastAPI(title="OasisKV", version="0.1.0", lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
    config = service.config

    @app.middleware("http")
    async def _auth_and_size(request: Request, call_next):
        if request.url.path.startswith("/v1/") or request.url.path in TOKENIZER_PATHS:
            if config.api_key:
                supplied = request.headers.get("authorization", "")
                if not secrets.compare_digest(supplied, f"Bearer {config.api_key}"):
                    return _error(ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                           "authentication_error"))
            length = request.headers.get("content-length")
            if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
                return _error(ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request_error"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            return _error(ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}",
                                   "invalid_request_error"))
        # 400, as vLLM and OpenAI answer a field that fails validation (the openai client's
        # BadRequestError); it was FastAPI's 422 (UnprocessableEntityError). A check of the whole
        # body (no field) is named by its own message.
        message = str(first.get("msg", "validation failed")).removeprefix("Value error, ")
        return _error(ApiError(400, f"invalid request: {message}" + (f" ({param})" if param else ""),
                               "invalid_request_error", param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(ApiError(exc.status_code, str(exc.detail), kind))

    @app.get("/health")
    async def health():
        """200 `ok`; 200 `degraded` while some workers are unhealthy but every role still has a
        healthy one, so the router serves (a readiness probe keeps the API in its Service);
        503 `unavailable` when a role has none, so every request would be refused."""
        roles = {"prefill": service.handles.prefill, "decode": service.handles.decode, "store": service.handles.stores}
        unhealthy = [slot.name for slots in roles.values() for slot in slots if not slot.healthy]
        if not unhealthy:
            return {"status": "ok"}
        missing = [role for role, slots in roles.items() if not any(slot.healthy for slot in slots)]
        if missing:
            return JSONResponse({"status": "unavailable", "unhealthy": unhealthy,
                                 "message": f"no healthy {' or '.join(missing)} worker"}, status_code=503)
        return {"status": "degraded", "unhealthy": unhealthy}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(config.model_name, config.model, service.max_model_len)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(config.model_name, model_id)
        return _model_card(model_id, config.model, service.max_model_len)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check(body, config.model_name)
        # Several prompts are served as vLLM serves them: n choices for each, prompt after prompt.
        prompts = body.prompts()
        token_ids = []
        for one in prompts:
            if isinstance(one, str):
                # Off the event loop: a long prompt takes seconds, and every stream and probe waited.
                token_ids.append(await asyncio.to_thread(service.tokenizer.encode, one))
            else:
                token_ids.append(list(one))
        return await _serve(service, request, body, token_ids, "text_completion",
                            texts=[one if isinstance(one, str) else None for one in prompts])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check(body, config.model_name)
        ids = await _chat_prompt_ids(service.tokenizer, body)
        return await _serve(service, request, body, [ids], "chat.completion")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: the prompt's token ids (the chat endpoint's, for messages) and max_model_len; a
        prompt over max_model_len is counted, not refused, so a client can see by how much."""
        _check(body, config.model_name)
        tokenizer = service.tokenizer
        if body.messages is not None:
            ids = await _chat_prompt_ids(tokenizer, body, bool(body.add_special_tokens))
        else:
            special = body.add_special_tokens is not False
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, special)

        def answer() -> bytes:
            strings = [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
            return _json({"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids,
                          "token_strs": strings})

        # Off the event loop, as the encoding is: a 2M-token answer took FastAPI's encoder 2 s.
        return Response(await asyncio.to_thread(answer), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check(body, config.model_name)
        vocab = service.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"tokens must be in [0, {vocab})", "invalid_request_error", "tokens")
        answer = await asyncio.to_thread(lambda: _json({"prompt": service.tokenizer.decode(body.tokens)}))
        return Response(answer, media_type="application/json")

    return app


def _json(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode()


async def _chat_prompt_ids(tokenizer, body, add_special_tokens: bool = False) -> list[int]:
    """The messages rendered by the chat template, as token ids. The template writes any BOS
    itself; `add_special_tokens` adds the tokenizer's own on top, as vLLM's /tokenize may."""
    messages = template_messages([m.model_dump(exclude_none=True) for m in body.messages])
    try:
        text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tokenize=False,
                                       **body.template_variables())
        # In the try too: a tool's text, rendered, may be a lone surrogate that cannot be encoded.
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)
    except Exception as exc:  # a template that refuses the conversation (roles out of order...)
        raise ApiError(400, f"chat template failed: {exc}", "invalid_request_error", "messages") from exc


def _model_card(name: str, root: str, max_model_len: int) -> dict:
    # vLLM's fields beside OpenAI's: clients size prompts from max_model_len.
    return {"id": name, "object": "model", "created": now(), "owned_by": "oasiskv", "root": root, "parent": None,
            "max_model_len": max_model_len, "permission": []}


def _check_model(served: str, asked: str) -> None:
    if asked != served:
        raise ApiError(404, f"model {asked!r} does not exist; this server serves {served!r}", "not_found_error", "model")


def _check(body, served: str) -> None:
    if body.model is None:  # optional, as in vLLM: the one model served
        body.model = served
    _check_model(served, body.model)
    if body.ignored_fields:  # as vLLM does: served, with a warning naming what it did not use
        log.warning("request fields ignored (unknown to this server): %s", ", ".join(body.ignored_fields))
    try:
        body.check_supported()
    except UnsupportedFeature as exc:
        raise ApiError(400, str(exc), "invalid_request_error", _field_named(str(exc), body)) from exc


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.status, exc.param), status_code=exc.status, headers=exc.headers)


def _sampling(body, prompt_tokens: int, max_model_len: int) -> SamplingParams:
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if getattr(body, "echo_only", False):
        max_tokens = 1  # as vLLM: one token is made, and only the prompt shown
    if prompt_tokens == 0:
        raise ApiError(400, "the prompt is empty", "invalid_request_error", "prompt")
    room = max_model_len - prompt_tokens
    if room < 1:
        # 400, as vLLM answers it (the openai client's BadRequestError); it was 413.
        raise ApiError(400, f"the prompt ({prompt_tokens} tokens) leaves no room in the model's context of "
                            f"{max_model_len} tokens", "invalid_request_error", "prompt")
    if max_tokens is not None and max_tokens > max_model_len:
        raise ApiError(400, f"max_tokens ({max_tokens}) exceeds the model's context of {max_model_len} tokens",
                       "invalid_request_error", "max_tokens")
    if body.min_tokens > room:
        raise ApiError(400, f"min_tokens ({body.min_tokens}) exceeds the {room} tokens left in the model's "
                            f"context of {max_model_len} after the prompt ({prompt_tokens} tokens)",
                       "invalid_request_error", "min_tokens")
    if max_tokens is None:
        # A default below min_tokens would refuse a request that never named a max_tokens. Chat's
        # is 512, not vLLM's whole rest of the context: a decode worker reserves pool rows (and a
        # store its memory) for max_tokens when it admits a request.
        max_tokens = max(DEFAULT_MAX_TOKENS if isinstance(body, CompletionRequest) else 512, body.min_tokens)
    # As vLLM: a max_tokens past the context's end is cut to the room left (the output then ends
    # with "length" there); it was refused.
    max_tokens = min(max_tokens, room)
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=max(0, body.top_k), stop=body.stop_list, seed=body.seed,
                              ignore_eos=body.ignore_eos, stop_token_ids=list(body.stop_token_ids or []),
                              # As vLLM's hermes parser: a model may mark its tool-call tags special.
                              skip_special_tokens=body.skip_special_tokens and not _tool_choice(body).parses_reply,
                              include_stop_str_in_output=body.include_stop_str_in_output,
                              logprobs=body.logprobs_requested(), presence_penalty=body.presence_penalty,
                              frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                              min_p=body.min_p, min_tokens=body.min_tokens, logit_bias=body.logit_bias,
                              allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
                              prompt_logprobs=body.prompt_logprobs_requested(),
                              structured_outputs=body.structured_outputs_requested())
    except (ValueError, ValidationError) as exc:
        raise ApiError(400, str(exc), "invalid_request_error", _field_named(str(exc), body)) from exc


# Structured output's checks run here, not on the default executor that tokenizes prompts: a
# spec that compiles slowly would hold up other requests' tokenizing.
_GRAMMAR_CHECKS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar-check")
# Specs refused for compiling too slowly (digests, the latest kept): a compile that ran over goes on
# in its thread and then caches its grammar, and the same spec sent again passed at once, for each
# worker to spend the time on.
_TOO_SLOW: collections.OrderedDict[str, None] = collections.OrderedDict()
_TOO_SLOW_KEPT = 1024


async def _require_compilable(service: ClusterService, spec: dict, field: str) -> None:
    """Parse and compile the spec off the event loop, as the workers will: one that does not
    parse, allows no output, or takes over COMPILE_LIMIT_S (it goes on in its thread, and its
    result is dropped) is a 400 naming `field`."""
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    too_slow = ApiError(400, f"{field} takes over {COMPILE_LIMIT_S:g} s to compile; make its bounds (maxLength, "
                             "minItems, {m,n} counts) smaller", "invalid_request_error", field)
    if digest in _TOO_SLOW:
        raise too_slow
    loop = asyncio.get_running_loop()
    started = loop.create_future()

    def check() -> None:
        loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))
        compile_spec(spec, service.tokenizer, service.tokenizer.vocab_size, field)

    done = loop.run_in_executor(_GRAMMAR_CHECKS, check)
    try:
        # The limit counts from when the compile starts: time queued behind others is not the
        # spec's. The queue has its own limit: compiles that ran over go on in their threads.
        await asyncio.wait({started, done}, timeout=COMPILE_LIMIT_S, return_when=asyncio.FIRST_COMPLETED)
        if not started.done() and not done.done():
            done.cancel()
            raise ApiError(503, "the structured output checks are busy with other specs; retry the request",
                           "service_unavailable", field, headers={"Retry-After": "10"})
        await asyncio.wait_for(done, COMPILE_LIMIT_S)
    except (TimeoutError, asyncio.TimeoutError):
        _TOO_SLOW[digest] = None
        while len(_TOO_SLOW) > _TOO_SLOW_KEPT:
            _TOO_SLOW.popitem(last=False)
        raise too_slow from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_request_error", field) from exc


def _tool_choice(body) -> ToolChoice:
    return body.tool_choice_resolved() if isinstance(body, ChatCompletionRequest) else ToolChoice("none")


def _field_named(message: str, body) -> str | None:
    """The request field a refusal names first, as the error's `param` (SamplingParams' and
    check_supported's messages begin with it, or with an entry of it: "tools[2].function")."""
    named = re.split(r"[ \[.]", message, maxsplit=1)[0]
    return named if named in type(body).model_fields else None


async def _serve(service: ClusterService, request: Request, body, prompts: list[list[int]], kind: str,
                 texts: list[str | None] | None = None):
    """Serve `body.n` choices for each of `prompts` (token ids), as one response or one stream.
    `texts`: the prompts as the client wrote them (None for token ids), which completions' echo
    shows."""
    config = service.config
    untruncated = prompts
    # Token ids are checked as truncated: what was cut off is not served (vLLM checks them so too).
    prompts = [_truncated(ids, body.truncate_prompt_tokens, service.max_model_len) for ids in prompts]
    vocab = service.tokenizer.vocab_size
    if any(not 0 <= t < vocab for ids in prompts for t in ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "invalid_request_error", "prompt")
    prompt_params = [_sampling(body, len(ids), service.max_model_len) for ids in prompts]
    params = prompt_params[0]  # the same but for max_tokens, cut to each prompt's room
    if config.prefill_engine == "vllm":
        for ids, one in zip(prompts, prompt_params):
            refusal = vllm_prefill_refusal(len(ids), one, config.prefill_chunk_tokens, config.vllm_max_model_len,
                                           config.device)
            if refusal:
                raise ApiError(400, refusal, "invalid_request_error", "prompt")
    try:
        require_known_stop_tokens(params, service.tokenizer.vocab_size)
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_request_error", "stop_token_ids") from exc
    if params.structured_outputs is not None:
        await _require_compilable(service, params.structured_outputs, body.structured_outputs_field())
    try:
        require_known_bias_tokens(params, service.tokenizer.vocab_size)
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_request_error", "logit_bias") from exc
    if params.bad_words:
        tokenizer = service.tokenizer
        try:  # off the event loop, as prompts are: a word may be megabytes long
            sequences = await asyncio.to_thread(tokenize_bad_words, params.bad_words,
                                                lambda text: tokenizer.encode(text, False))
            prompt_params = [dataclasses.replace(one, bad_words_token_ids=sequences) for one in prompt_params]
            params = prompt_params[0]
            require_tokenized_bad_words(params, vocab)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_request_error", "bad_words") from exc
    if params.allowed_token_ids is not None:
        try:
            require_known_allowed_tokens(params, service.tokenizer.vocab_size, service.eos_token_ids)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_request_error", "allowed_token_ids") from exc
    block = service.config.decode.block_size
    if body.oasiskv_budget_tokens is not None and body.oasiskv_budget_tokens % block:
        raise ApiError(400, f"oasiskv_budget_tokens must be a multiple of the block size ({block}), got "
                            f"{body.oasiskv_budget_tokens}", "invalid_request_error", "oasiskv_budget_tokens")
    request_id = new_id("chatcmpl" if kind == "chat.completion" else "cmpl")
    # Each choice is a request to the cluster (prefilled, decoded and counted on its own); choice
    # j > 0 of a prompt samples from a seed derived from the request's, so the choices differ and
    # the response is reproducible. Choice index: prompt after prompt, n each, as in vLLM. Choice
    # 0 alone computes the prompt's logprobs, which skip the prefix cache: its siblings need not.
    choices = [(ids, one if j == 0 else dataclasses.replace(
                    one, seed=None if one.seed is None else stream_seed(one.seed, f"choice-{j}"), prompt_logprobs=None))
               for ids, one in zip(prompts, prompt_params) for j in range(body.n)]
    prompt_tokens = sum(len(ids) for ids in prompts)
    # Every choice is pulled from now on, each as fast as it comes: a choice that waits for room
    # in a store gets it when a sibling ends (they waited for each other's first token, and a
    # request whose choices fit the store only in turns waited out its timeout).
    merged = _Merged([functools.partial(service.generate, request_id if len(choices) == 1 else f"{request_id}-{i}",
                                        ids, p, body.oasiskv_mode, body.oasiskv_budget_tokens)
                      for i, (ids, p) in enumerate(choices)])
    try:
        # The router's refusals of any choice, and any error before the first token, are the
        # response's status; a long prefill comes first too, so a client that hangs up during it
        # must end the request here.
        await _unless_disconnected(request, merged.started())
    except ClientDisconnected:
        await merged.shut()
        return _hung_up()
    except Exception as exc:
        await merged.shut()
        raise _request_failed(service, exc) from exc
    except BaseException:  # cancelled (the server stops, say): the choices end as on a hang-up
        await merged.shut()
        raise
    formatters = [None if params.logprobs is None else LogprobFormatter(service.tokenizer, params.skip_special_tokens)
                  for _ in choices]
    echoes = None
    if kind == "text_completion" and body.echo:
        echoes = await asyncio.to_thread(_echo_texts, service.tokenizer, prompts, untruncated,
                                         texts or [None] * len(prompts))
    shown = None if params.prompt_logprobs is None else PromptLogprobs(
        service.tokenizer, prompts, params.logprobs if echoes is not None else None, params.prompt_logprobs)
    if body.stream:
        return _ChoicesStream(_sse(service, request_id, kind, body, prompt_tokens, merged, formatters, echoes, shown),
                              shut=merged.shut, media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache"})
    try:
        outcomes = await _unless_disconnected(request, _collect(merged))
    except ClientDisconnected:
        return _hung_up()
    except Exception as exc:
        raise _request_failed(service, exc) from exc
    finally:
        await merged.shut()  # after a hang-up this aborts the requests and frees their KV

    def response() -> dict:
        choices = []
        for index, (outcome, formatter) in enumerate(zip(outcomes, formatters)):
            common = {"index": index, "finish_reason": outcome.finish_reason, "stop_reason": outcome.stop_reason}
            if kind == "chat.completion":
                tools = _tool_choice(body)
                content, calls = parse_reply(tools, outcome.text, body.parallel_tool_calls is not False)
                echoed = body.echoed()
                message = {"role": "assistant",
                           "content": (echoed + (content or "") if echoed else content) if calls else echoed + outcome.text}
                if calls:  # as vLLM: no field without calls
                    message["tool_calls"] = [call.to_openai() for call in calls]
                common["finish_reason"] = finish_reason(tools, calls, outcome.finish_reason)
                choices.append({**common, "message": message, "logprobs": formatter and formatter.chat(outcome.logprobs)})
                continue
            prompt = index // body.n
            entries = outcomes[prompt * body.n].prompt_logprobs or []  # its first choice's
            text, logprobs = outcome.text, None
            if echoes is not None:
                text = echoes[prompt] + ("" if body.echo_only else text)
            if formatter is not None and echoes is not None:
                before, formatter.text_offset = shown.echoed(prompt, entries)
                after = formatter.completion([] if body.echo_only else outcome.logprobs)
                logprobs = {key: before[key] + after[key] for key in after}
            elif formatter is not None:
                logprobs = formatter.completion(outcome.logprobs)
            # As vLLM: each choice its prompt's, or null.
            choices.append({**common, "text": text, "logprobs": logprobs,
                            "prompt_logprobs": None if shown is None else shown.shown(prompt, entries)})
        usage = _usage(prompt_tokens, sum(outcome.num_tokens for outcome in outcomes),
                       _cached_prompt_tokens([outcome.cached_tokens for outcome in outcomes], body.n))
        answer = {"id": request_id, "object": kind, "created": now(), "model": body.model, "choices": choices,
                  "usage": usage}
        if kind == "chat.completion":  # as vLLM: the response's, of its one prompt, or null
            answer["prompt_logprobs"] = None if shown is None else shown.shown(0, outcomes[0].prompt_logprobs or [])
        return answer

    if shown is None:
        return response()
    # Off the event loop: a long prompt's logprobs are megabytes of JSON, seconds of work.
    return Response(await asyncio.to_thread(lambda: _json(response())), media_type="application/json")


def _echo_texts(tokenizer, prompts: list[list[int]], untruncated: list[list[int]],
                texts: list[str | None]) -> list[str]:
    """What completions' echo shows of each prompt: the text the client sent, or the decoded
    token ids when it sent ids or its prompt was truncated (special tokens shown, as sent)."""
    return [text if text is not None and len(ids) == len(whole) else tokenizer.decode(ids)
            for ids, whole, text in zip(prompts, untruncated, texts)]


def _request_failed(service: ClusterService, exc: Exception) -> ApiError:
    """The API's answer to a request one of whose choices failed: the response's status, or the
    error event of a stream already begun."""
    if isinstance(exc, Overloaded):
        # Counted here, where it is refused: the OasisKVRequestsRejected alert and the outcome
        # panels read status="rejected", which nothing counted.
        service.metrics.requests.labels(status="rejected").inc()
        return ApiError(exc.status, str(exc), "server_overloaded" if exc.status == 429 else "service_unavailable",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, TooLarge):
        return ApiError(400, str(exc), "invalid_request_error")
    if isinstance(exc, TimeoutError):
        return ApiError(504, "the request timed out", "timeout")
    return _failed(exc)  # a worker died mid-request: the request is lost, the server is not


def _truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len's worth);
    of a chat, the rendered template's, as vLLM cuts it."""
    if keep is None:
        return ids
    if keep > max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({max_model_len}); "
                            "give a smaller one", "invalid_request_error", "truncate_prompt_tokens")
    return ids[-(max_model_len if keep == -1 else keep):]


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    # prompt_tokens_details as OpenAI's (vLLM's with --enable-prompt-tokens-details)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _cached_prompt_tokens(cached_by_choice: list[int], n: int) -> int:
    """The usage's cached tokens: for each prompt (counted once in prompt_tokens, however many its
    choices), the tokens every one of its n choices found in a prefix cache. A choice's hit on
    what a sibling choice of the same prompt just computed does not count: the prompt is counted
    once, as if prefilled once."""
    return sum(min(cached_by_choice[start : start + n]) for start in range(0, len(cached_by_choice), n))


# Cleanups still running after their request's task was cancelled (kept referenced until done).
_CLEANUPS: set[asyncio.Task] = set()


def _failed(exc: Exception) -> ApiError:
    """A request that failed after it was accepted: 503, to be retried (here or elsewhere)."""
    if isinstance(exc, ShuttingDown):
        message = "the server is shutting down; retry the request"
    else:
        message = f"the request failed in a worker ({type(exc).__name__}); retry it"
    return ApiError(503, message, "service_unavailable", headers={"Retry-After": "5"})


class ClientDisconnected(Exception):
    """The client hung up before its response was ready."""


def _hung_up() -> Response:
    # Nobody reads it: the connection is gone. 499 is what proxies log for "client closed request".
    return Response(status_code=499)


@dataclasses.dataclass
class _Outcome:
    """One choice of a non-streamed response."""

    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None


async def _collect(merged: "_Merged") -> list[_Outcome]:
    """Every choice's whole output, from the same merged events a stream sends."""
    outcomes = [_Outcome() for _ in range(merged.choices)]
    async for index, event in merged:
        outcome = outcomes[index]
        outcome.text += event.delta
        outcome.logprobs += event.logprobs
        outcome.num_tokens = event.num_tokens
        outcome.cached_tokens = event.cached_tokens
        if event.prompt_logprobs is not None:
            outcome.prompt_logprobs = event.prompt_logprobs
        outcome.finish_reason = event.finish_reason or outcome.finish_reason
        if event.stop_reason is not None:
            outcome.stop_reason = event.stop_reason
    return outcomes


async def _wait_for_hang_up(request: Request) -> None:
    # Awaits receive() rather than polling request.is_disconnected(): behind an
    # @app.middleware("http") middleware that poll never sees the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work):
    """`work`'s result, or ClientDisconnected once the client hangs up first (`work` is then
    cancelled, which aborts the request wherever it is: prefill, decode queue or decode)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_hang_up(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _sse(service: ClusterService, request_id: str, kind: str, body, prompt_tokens: int, merged: "_Merged",
               formatters: list[LogprobFormatter | None], echoes: list[str] | None = None,
               shown: PromptLogprobs | None = None) -> AsyncIterator[bytes]:
    """The response's server-sent events; the response that sends them shuts the choices
    (`_ChoicesStream`), however it ends. With completions' echo, each choice's prompt text (and
    its tokens' logprobs) comes in a chunk of its own before the choice's first output; the
    logprobs are the prompt's first choice's, so a sibling's events wait for them."""
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    created = now()
    completion_tokens = [0] * merged.choices
    cached_tokens = [0] * merged.choices

    def usage() -> dict:
        return _usage(prompt_tokens, sum(completion_tokens), _cached_prompt_tokens(cached_tokens, body.n))

    def chunk(index: int, delta_text: str | None, reason: str | None, role: bool = False,
              logprobs: list[TokenLogprob] | None = None, stop: str | int | None = None,
              shown_logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> bytes:
        formatter = formatters[index]
        if chunk_kind == "chat.completion.chunk":
            delta = {"role": "assistant", "content": ""} if role else ({"content": delta_text} if delta_text else {})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "finish_reason": reason, "stop_reason": stop,
                      "logprobs": formatter.chat(logprobs) if formatter and logprobs else None}
        else:
            if shown_logprobs is None and formatter and logprobs:
                shown_logprobs = formatter.completion(logprobs)
            choice = {"index": index, "text": delta_text or "", "finish_reason": reason, "stop_reason": stop,
                      "logprobs": shown_logprobs}
        payload = {"id": request_id, "object": chunk_kind, "created": created, "model": body.model, "choices": [choice]}
        if body.continuous_usage:  # as vLLM: every chunk carries the usage so far
            payload["usage"] = usage()
        elif body.include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload)}\n\n".encode()

    try:
        if chunk_kind == "chat.completion.chunk":
            for index in range(merged.choices):
                yield chunk(index, None, None, role=True)
                if body.echoed():
                    yield chunk(index, body.echoed(), None)
        echoed = [echoes is None] * merged.choices
        tools = _tool_choice(body)
        parallel = getattr(body, "parallel_tool_calls", None) is not False
        tool_streams = [ToolCallStream(tools, parallel) if tools.parses_reply else None for _ in range(merged.choices)]
        gate = EchoLogprobsGate([not done and f is not None for done, f in zip(echoed, formatters)], body.n)

        def echo_chunk(index: int) -> bytes:
            before = None
            if formatters[index] is not None:  # the output's offsets continue from the prompt's tokens
                before, formatters[index].text_offset = shown.echoed(index // body.n, gate.found[index // body.n])
            return chunk(index, echoes[index // body.n], None, shown_logprobs=before)

        async for arrived in merged:
            for index, event in gate.passed(*arrived):
                if not echoed[index]:
                    echoed[index] = True
                    # Off the event loop: a long prompt's tokens and logprobs take a second to write.
                    yield await asyncio.to_thread(echo_chunk, index)
                completion_tokens[index] = event.num_tokens
                cached_tokens[index] = event.cached_tokens
                if echoes is not None and body.echo_only:  # the prompt alone: only the end is told
                    event = dataclasses.replace(event, delta="", logprobs=[])
                delta, calls, reason = event.delta, [], event.finish_reason if event.finished else None
                if tool_streams[index] is not None:  # content until a call begins, then the calls
                    delta, calls = tool_streams[index].feed(event.delta or "")
                    if event.finished:
                        rest, more = tool_streams[index].finish()
                        delta, calls = delta + rest, calls + more
                        reason = finish_reason(tools, tool_streams[index].calls, reason)
                if delta or calls or event.logprobs or event.finished:
                    yield chunk(index, delta, reason, logprobs=event.logprobs,
                                stop=event.stop_reason if event.finished else None, tool_calls=calls)
        if body.include_usage:
            payload = {"id": request_id, "object": chunk_kind, "created": created, "model": body.model,
                       "choices": [], "usage": usage()}
            yield f"data: {json.dumps(payload)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        pass
    except Exception as exc:  # after the 200 header an error can only travel in the stream
        failure = _request_failed(service, exc)
        yield f"data: {json.dumps(error_body(failure.message, failure.type, failure.status))}\n\n".encode()
        yield b"data: [DONE]\n\n"  # as vLLM: a client reading to [DONE] is not left waiting for it


class _ChoicesStream(StreamingResponse):
    """A stream that shuts its choices when the response ends, however it ends: a client gone
    before the body began left the body's generator unstarted, so its cleanup never ran, and the
    choices went on decoding for nobody."""

    def __init__(self, content, shut, **kwargs):
        super().__init__(content, **kwargs)
        self._shut_choices = shut

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._shut_choices()


class _Merged:
    """The events of a request's choices, as (choice index, event) in the order they come, until
    every choice has finished; the first error of any choice is raised. Each choice is pulled
    from the start, whoever reads (or not yet). `starts` make the choices' event streams, each
    given the callback that says its choice is accepted (`ClusterService.generate`'s
    `on_accepted`)."""

    def __init__(self, starts: list[Callable[..., AsyncIterator]]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self.choices = self._left = len(starts)
        self._not_accepted = set(range(self.choices))
        self._any_event_seen = False
        self._started = asyncio.get_running_loop().create_future()
        # Read here too: a non-streamed response never awaits it, and asyncio would log its error.
        self._started.add_done_callback(lambda done: done.cancelled() or done.exception())
        if not starts:
            self._started.set_result(None)
        self._shutting: asyncio.Task | None = None
        self._streams = [start(on_accepted=functools.partial(self.accepted, i)) for i, start in enumerate(starts)]
        self._pumps = [asyncio.ensure_future(self._pump(i, events)) for i, events in enumerate(self._streams)]

    async def started(self) -> None:
        """Every choice is accepted (assigned or waiting for room in a store; a choice's first
        event or end counts too) and some choice has its first event, or every choice has ended;
        raises the first error before that. The response's status is known then: a choice that
        waits for room in a store does not hold back its siblings' first bytes (vLLM streams each
        choice as it comes), and an error of a choice after this travels in the stream."""
        await asyncio.shield(self._started)

    def accepted(self, index: int) -> None:
        self._not_accepted.discard(index)
        if not self._started.done() and not self._not_accepted and self._any_event_seen:
            self._started.set_result(None)

    def _event_seen(self, index: int) -> None:
        if index in self._not_accepted or not self._any_event_seen:
            self._any_event_seen = True
            self.accepted(index)

    async def _pump(self, index: int, events) -> None:
        try:
            async for event in events:
                self._event_seen(index)
                await self._queue.put((index, event, None))
                if event.finished:
                    break
            # A finished choice gives back its decode seat and store memory now, not when the
            # slowest of its siblings ends.
            await events.aclose()
        except Exception as exc:
            if not self._started.done():
                self._started.set_exception(exc)
            await self._queue.put((index, None, exc))
            return
        self._event_seen(index)  # an end counts as a first event (a stream of none)
        await self._queue.put((index, None, None))

    def __aiter__(self):
        return self

    async def __anext__(self):
        while self._left:
            index, event, error = await self._queue.get()
            if error is not None:
                raise error
            if event is not None:
                return index, event
            self._left -= 1
        raise StopAsyncIteration

    async def shut(self) -> None:
        """Stop pulling the choices and close their streams, which aborts the unfinished ones and
        frees their KV, to the end even if the caller is cancelled meanwhile: Starlette cancels a
        disconnected stream's task again at each await, and a cleanup cut short there left a
        finished choice holding its decode seat and store memory until garbage collection. Once:
        a second shut while the first runs waits for it (cancelling the pumps again would cut
        their requests' own cleanup short)."""
        if self._shutting is None:
            self._shutting = asyncio.ensure_future(self._shut_once())
            _CLEANUPS.add(self._shutting)
            self._shutting.add_done_callback(_CLEANUPS.discard)
        await asyncio.shield(self._shutting)

    async def _shut_once(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for events in self._streams:
            await events.aclose()
