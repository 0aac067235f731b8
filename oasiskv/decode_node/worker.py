"""The decode worker as a Ray actor: the decode engine's continuous-batching loop on a thread of
its own, with one async stream of outputs per request.

Requests and aborts reach the loop through a queue (the engine is single-threaded); outputs go
back to the actor's event loop with call_soon_threadsafe, where `generate` yields them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

import torch

from ..models.cpus import worker_threads
from ..models.device import require_device
from ..models.loader import load_model_dir
from ..models.pull import resolve_model
from ..models.sampling import SamplingParams
from ..models.tokenizer import load_tokenizer
from .config import DecodeConfig
from .engine import DecodeEngine
from .draft_model import build_drafter
from .store_directory import StoreDirectory

log = logging.getLogger(__name__)


class DecodeWorker:
    # A step that fails once took its requests with it; failing again and again means the engine is broken.
    MAX_CONSECUTIVE_FAILURES = 3

    def __init__(self, model: str, config: dict | None = None, dtype: str = "float32", threads: int | None = None,
                 transport: str = "auto", role_resource: str | None = None):
        chosen = worker_threads(threads, role_resource)
        if chosen:
            torch.set_num_threads(chosen)
        self.config = DecodeConfig(**(config or {}))
        require_device(self.config.device)  # before minutes of model loading
        model_dir = resolve_model(model, progress=False)
        torch_dtype = getattr(torch, dtype)
        self.model = load_model_dir(model_dir, dtype=torch_dtype, device=self.config.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.stores = StoreDirectory(transport, timeout=self.config.fetch_timeout_s)
        drafter = build_drafter(self.config, self.model, self.tokenizer, torch_dtype)
        self.engine = DecodeEngine(self.model, self.tokenizer, self.stores, self.config, drafter=drafter)
        self.stores.closed_listeners.append(self.engine.client.forget_route)  # its I/O thread goes with it
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Event loop only. Aborts of requests that have no stream yet (monotonic time): the API
        # aborts a request whose client hung up as soon as it has asked for the stream, which may
        # be while `generate` still connects to the store; an abort the engine does not know yet
        # was lost, so the request then decoded to max_tokens for nobody, its rows held.
        self._early_aborts: dict[str, float] = {}
        self._text_sent: dict[str, int] = {}  # per running request, characters its stream has had (loop thread)
        self._error: str | None = None  # set when the engine is broken for good
        self._step_failures = 0  # steps that raised and ended their requests, since start
        self._consecutive_failures = 0
        self._closed = False  # shutdown() was called
        self._stopped = False  # the loop has closed the engine and ended
        self._next_keep_alive = 0.0  # monotonic time of the next store TTL refresh
        self._keep_alive_thread: threading.Thread | None = None
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self._thread.start()

    # -- control -------------------------------------------------------------------------
    def ready(self) -> dict:
        return {"pool_rows": self.engine.pool.num_rows, "row_bytes": self.engine.pool.row_bytes}

    def row_plan(self, prompt_tokens: int, max_tokens: int, mode: str | None, budget_tokens: int | None) -> int:
        return self.engine.row_plan(prompt_tokens, max_tokens, mode, budget_tokens).total

    def stats(self) -> dict:
        counters = self.engine.counters.snapshot()
        pool = self.engine.pool
        quarantined = sum(len(rows) for rows, _ in list(self.engine.quarantine))  # in use, held for transfers
        return {
            **counters,
            "pool_rows": pool.num_rows,
            "pool_rows_used": pool.rows_used,
            "pool_rows_quarantined": quarantined,
            "pool_quarantined": quarantined / pool.num_rows,
            "pool_usage": pool.rows_used / pool.num_rows,
            "running": len(self.engine.running),
            "admitting": len(self.engine.admitting),  # their first working set still being read
            "waiting": len(self.engine.waiting),
            "healthy": self._error is None and self._thread.is_alive(),
            "error": self._error,
            "closed": self._closed,  # shut down on purpose: stopped, not broken
            "step_failures": self._step_failures,
            "store_clients": self.stores.connected,
            "store_clients_retired": self.stores.retired,  # of stores that moved, closed once their requests end
        }

    async def forget_store(self, address: str) -> bool:
        """The store that was at `address` is gone (the API's health poll saw Ray restart it at a
        new one): retire its client and I/O thread, at once or when its last request ends.
        Off the actor's event loop: closing a client waits for the call it may be in."""
        return await asyncio.get_running_loop().run_in_executor(None, self.stores.retire, address)

    EARLY_ABORT_MEMORY_S = 600.0  # an abort of a request never seen is forgotten after this

    def abort(self, request_id: str) -> None:
        if request_id not in self._streams:
            now = time.monotonic()
            self._early_aborts = {r: t for r, t in self._early_aborts.items() if now - t < self.EARLY_ABORT_MEMORY_S}
            self._early_aborts[request_id] = now
        self._commands.put(("abort", request_id, None))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the loop; the engine aborts every request (pool rows and store memory given
        back), unregisters its pool and stops its I/O thread; the store clients close. Open
        streams end with finish_reason "abort". Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(("shutdown", None, None))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("decode loop did not stop within %.0f s; the engine was not closed", timeout_s)

    def __ray_shutdown__(self) -> None:
        """Ray calls this when the actor exits gracefully."""
        self.shutdown()

    async def generate(self, prefill, params: dict, store_address: str, mode: str | None = None,
                       budget_tokens: int | None = None):
        """Stream DecodeOutput dicts for one request until it finishes (or is aborted)."""
        if self._error:
            raise RuntimeError(f"decode worker failed: {self._error}")
        if self._closed:
            raise RuntimeError("decode worker is shut down")
        loop = asyncio.get_running_loop()
        # A store this worker has not used yet is connected to here, off the decode loop: one
        # that does not answer holds up only this request (for the timeout), not every request
        # decoding meanwhile.
        await loop.run_in_executor(None, self.stores.client_for, store_address)
        request_id = prefill.request_id
        if request_id in self._streams:
            # Refused here, before its "add": the engine's refusal freed the live request's store
            # memory under the shared id, and its stream got the other's error.
            raise ValueError(f"request {request_id!r} is already decoding on this worker; request ids must be unique")
        if self._early_aborts.pop(request_id, None) is not None:
            # Aborted before it had a stream: its store memory is still to be given back.
            self._commands.put(("discard", request_id, store_address))
            yield self._abort_output(request_id)
            return
        # The stream and the "add" with no await between: a later abort finds the stream, and its
        # command follows the "add".
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        self._commands.put(("add", request_id, (prefill, SamplingParams(**params), store_address, mode, budget_tokens)))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine let the request go with its error
                    raise item
                finished = item["finished"]
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the stream was dropped (its caller cancelled it): the request goes too
                self._commands.put(("abort", request_id, None))

    # -- the engine thread ---------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _deliver_output(self, out) -> None:
        if out.error is not None:
            self._text_sent.pop(out.request_id, None)
            self._deliver(out.request_id, RuntimeError(f"request {out.request_id}: {out.error}"))
        else:
            self._deliver(out.request_id, self._stream_item(out))

    def _abort_output(self, request_id: str) -> dict:
        self._text_sent.pop(request_id, None)
        return {"request_id": request_id, "new_token_ids": [], "num_tokens": 0, "text_delta": "",
                "finished": True, "finish_reason": "abort"}

    def _stream_item(self, out) -> dict:
        """What one step sends a stream: the new tokens and the new text, not the whole output again
        (whole outputs made a long request's stream carry quadratically many bytes). A running
        request's text only grows (models.engine.stopping.visible_text), so the new text is what
        follows the characters already sent."""
        sent = self._text_sent.get(out.request_id, 0)
        if out.finished:
            self._text_sent.pop(out.request_id, None)
        else:
            self._text_sent[out.request_id] = len(out.text)
        return {"request_id": out.request_id, "new_token_ids": out.new_token_ids, "num_tokens": len(out.token_ids),
                "text_delta": out.text[sent:], "finished": out.finished, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, "logprobs": out.logprobs}

    def _close(self) -> None:
        """On the loop thread (the engine is single-threaded): close everything, end every stream."""
        self._stopped = True
        try:
            self.engine.close()
        except Exception as error:
            log.warning("closing the decode engine: %s", error)
        try:
            self.stores.close()
        except Exception as error:
            log.warning("closing the store clients: %s", error)
        for request_id in list(self._streams):
            self._deliver(request_id, self._abort_output(request_id))

    def _apply(self, command) -> None:
        kind, request_id, payload = command
        if self._stopped:  # a request that raced shutdown: end its stream
            if request_id is not None:
                self._deliver(request_id, self._abort_output(request_id))
            return
        if kind == "shutdown":
            self._close()
            return
        if kind == "abort":
            self.engine.abort(request_id)
            self._deliver(request_id, self._abort_output(request_id))
            return
        # The frees below are queued on the store's I/O thread: done here, on the decode loop,
        # a store that does not answer held up every request of the worker for the timeout.
        if kind == "discard":
            try:
                self.stores.bind(request_id, payload)
                self.engine.free_in_store(request_id)
            except Exception as error:  # its store's TTL frees it in the end; the loop goes on
                log.warning("freeing aborted request %s in its store: %s", request_id, error)
            return
        prefill, params, store_address, mode, budget = payload
        try:
            self.stores.bind(request_id, store_address)
            self.engine.add(prefill, params, mode=mode, budget_tokens=budget)
        except Exception as error:  # refuse this request only
            self.engine.free_in_store(request_id)
            self._deliver(request_id, error)

    def _loop(self) -> None:
        while not self._stopped:
            try:
                # Idle with rows in quarantine: wake now and then to give them back.
                timeout = 0 if self.engine.has_unfinished else 0.5 if self.engine.quarantine else None
                try:
                    self._apply(self._commands.get_nowait() if timeout == 0 else self._commands.get(timeout=timeout))
                    while True:
                        self._apply(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if self._stopped:
                    break
                if not self.engine.has_unfinished:
                    self.engine.release_ended_rows()  # a step does it first thing otherwise
                else:
                    self._keep_alive_in_stores()
                    for out in self.engine.step():
                        self._deliver_output(out)
                    self._consecutive_failures = 0
            except Exception as error:
                self._recover(error)
                if self._error is not None:
                    time.sleep(0.5)

    def _keep_alive_in_stores(self) -> None:
        """Every store_keep_alive_s, refresh the store TTL of the requests this worker holds, so
        that a store does not free one that waits long in the queue or decodes densely (a
        request the store had expired failed at admission, or its free failed at the end)."""
        now = time.monotonic()
        if now < self._next_keep_alive:
            return
        if self._keep_alive_thread is not None and self._keep_alive_thread.is_alive():
            return  # the last round still waits for a store that does not answer
        self._next_keep_alive = now + self.config.store_keep_alive_s
        # Off the decode loop: a store that stopped answering holds this up for its timeout.
        self._keep_alive_thread = threading.Thread(target=self._keep_alive_round, name="store-keep-alive", daemon=True)
        self._keep_alive_thread.start()

    def _keep_alive_round(self) -> None:
        lost = self.stores.keep_alive()
        if lost:
            log.warning("%d request(s) had already left their store: %s", len(lost), ", ".join(lost[:8]))

    def _recover(self, error: Exception) -> None:
        """A step raised: the requests in the engine then are in an unknown state, so they end with
        the error and leave the engine, and the worker goes on with the next ones. Only when the
        engine cannot give them back, or steps keep failing with nothing between, is the worker
        broken: it then fails every stream and reports unhealthy, to stay inspectable."""
        message = f"{type(error).__name__}: {error}"
        self._step_failures += 1
        self._consecutive_failures += 1
        for out in self.engine.take_ended_before_failure():  # they left the engine before it raised
            self._deliver_output(out)
        try:
            aborted = self.engine.abort_all()
            # Transfers the step left in flight land in a moment; a store that does not answer
            # keeps its requests' rows in quarantine, and the loop gives them back later.
            self.engine.settle(1.0)
        except Exception as abort_error:
            log.exception("the decode loop failed (%s) and its requests could not be given back", message)
            self._error = f"{message}; then, aborting its requests: {abort_error}"
            aborted = []  # every stream gets the error below
        else:
            log.exception("a decode step failed; its %d request(s) end with the error", len(aborted))
            if self._consecutive_failures >= self.MAX_CONSECUTIVE_FAILURES:
                self._error = f"{self._consecutive_failures} decode steps in a row failed, the last: {message}"
        for request_id in aborted:
            self._text_sent.pop(request_id, None)
            self._deliver(request_id, RuntimeError(f"decode step failed: {message}"))
        if self._error is not None:
            self._text_sent.clear()
            for request_id in list(self._streams):
                self._deliver(request_id, RuntimeError(self._error))
