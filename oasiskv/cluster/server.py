"""Wiring: pull the model, launch the actors, build the service and the app, run uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time

import torch
import uvicorn

from ..kvstore import KVLayout
from ..models.config import ModelConfig
from ..models.pull import resolve_model
from ..models.tokenizer import load_tokenizer
from .api import create_app
from .config import ServeConfig
from .launcher import check_local_gpus, launch, shutdown
from .service import ClusterService

log = logging.getLogger("oasiskv.cluster")


class PortUnavailable(RuntimeError):
    """The API's port cannot be listened on (in use, or not this host's address)."""


def require_free_port(host: str, port: int) -> None:
    """Listen on the API's port for a moment, as uvicorn will: a port in use was found only
    after Ray and every worker had started (30 s), and serve then exited 3."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn sets it
        try:
            probe.bind((host, port))
        except OSError as error:
            raise PortUnavailable(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def build_service(config: ServeConfig) -> ClusterService:
    model_dir = resolve_model(config.model)  # pulls on first use, with a progress bar
    if config.decode.drafter != "ngram":
        resolve_model(config.decode.drafter)  # a draft model that does not exist is named before Ray starts
    check_local_gpus(config)
    model_config = ModelConfig.from_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)  # a file it cannot read is named before Ray starts
    handles = launch(config)
    return ClusterService(config, handles, tokenizer, store_bytes_per_token(config, model_config),
                          model_config.max_position_embeddings, eos_token_ids=model_config.eos_token_ids)


def store_bytes_per_token(config: ServeConfig, model_config: ModelConfig) -> int:
    """A store's bytes per token of a request: its block's KV and fp32 key summaries, padded
    as the store pads them (`KVLayout.chunk_bytes`), over the block's tokens. Without the
    padding a store filled to its reservations refused a long request's last write-back."""
    layout = KVLayout(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                      config.decode.block_size, getattr(torch, config.dtype))
    return -(-layout.chunk_bytes // layout.block_size)


def make_app(service: ClusterService, shutdown_cluster: bool = True):
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await service.poll_once()
        service.start_polling()
        try:
            yield
        finally:
            await service.stop_polling()
            if shutdown_cluster:
                service.cluster_down = True
                log.info("shutting the cluster down")
                shutdown(service.handles)
                log.info("cluster shut down")

    return create_app(service, lifespan=lifespan)


class DrainingServer(uvicorn.Server):
    """uvicorn, ending the requests still in flight shortly before its shutdown grace runs out.

    uvicorn cancels what still runs when the grace ends, and only then runs the lifespan's
    shutdown: streams were cut with no error event and no [DONE], a non-streamed request got a
    bare-text 500, and the requests' aborts reached Ray after it was shut down (starting a new
    local Ray). Ended by the service instead, each gets a 503 'shutting down' while the workers
    are still there to free its KV.

    A second Ctrl-C ends them at once, the same way, rather than after the grace. It was
    uvicorn's force quit, which skips the lifespan: Ray's actors were left to asyncio's exit,
    which logged tracebacks and whose aborts started a new local Ray. A third is the force quit."""

    def __init__(self, config: uvicorn.Config, service: ClusterService):
        super().__init__(config)
        self.service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ending_now = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGINT and self.should_exit and not self._ending_now and self._loop is not None:
            self._ending_now = True
            # From a signal handler: the loop runs it (and its log line) between its callbacks.
            self._loop.call_soon_threadsafe(self._end_requests_now)
            return  # not captured: uvicorn re-raises what it captured once it has shut down
        super().handle_exit(sig, frame)

    def _end_requests_now(self) -> None:
        log.info("Ctrl-C again: ending the requests in flight now (once more to force quit)")
        self.service.begin_shutdown()

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown
        timer = None
        if grace is not None:
            # Leave the ended requests time to send their last event before uvicorn cancels them.
            end_at = max(0.0, grace - min(2.0, grace / 2))
            timer = asyncio.get_running_loop().call_later(end_at, self.service.begin_shutdown)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def run_server(config: ServeConfig) -> None:
    require_free_port(config.host, config.port)
    service = build_service(config)
    # Port 0 is a free port the system picks when uvicorn binds: uvicorn's own line names it.
    log.info("serving %s on http://%s:%s", config.model_name, config.host,
             config.port or "(a free port: see uvicorn's 'running on' line)")
    # Without a graceful-shutdown limit uvicorn waits for every open stream, and under Kubernetes
    # the pod is killed first: no request is aborted and the lifespan never shuts the cluster down.
    DrainingServer(uvicorn.Config(make_app(service), host=config.host, port=config.port, log_level="info",
                                  timeout_graceful_shutdown=config.shutdown_grace_s), service).run()


class BackgroundServer:
    """The whole server in this process (uvicorn on a thread): for tests and notebooks."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.service = build_service(config)
        app = make_app(self.service, shutdown_cluster=False)
        self._server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                                     timeout_graceful_shutdown=config.shutdown_grace_s), self.service)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.05)
        return self

    @property
    def url(self) -> str:
        sockets = self._server.servers[0].sockets
        return f"http://{self.config.host}:{sockets[0].getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=self.config.shutdown_grace_s + 30)
        self.service.cluster_down = True
        shutdown(self.service.handles)
