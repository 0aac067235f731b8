"""The serving side of one request: route it, prefill it, stream its decode, clean up.

`ClusterService` owns the router, the metrics and the actor handles; the HTTP layer (api.py)
only turns requests into `generate()` calls and events into OpenAI-shaped bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import AsyncIterator, Callable

from ..decode_node.working_set import plan_rows
from ..models.engine.stopping import OutputText, finish_reason, visible_text
from ..models.sampling import SamplingParams, TokenLogprob
from .config import ServeConfig
from .launcher import HEALTH_GROUP, ClusterHandles
from .metrics import ServingMetrics
from .prefix_affinity import PrefixAffinity
from .router import Overloaded, Router, StoresFull

log = logging.getLogger("oasiskv.cluster")

# How long an ended request's room in the router waits for its KV to leave (the decode worker's
# abort, the store's free): as long as the abort may take to answer.
FREE_WAIT_S = 60.0


@dataclass
class Event:
    """A piece of a streamed answer: the text added since the last event."""

    delta: str
    num_tokens: int  # generated so far
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens added since the last event
    stop_reason: str | int | None = None  # of a "stop" finish: the stop token id or string; None for EOS
    cached_tokens: int = 0  # of the prompt, taken from the prefill worker's prefix cache (every event the same)
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1..; on a request's first event only


class ShuttingDown(RuntimeError):
    """The server stops: a request still in flight when its shutdown grace ends gets this."""


class ClusterService:
    def __init__(self, config: ServeConfig, handles: ClusterHandles, tokenizer, kv_bytes_per_token: int,
                 max_model_len: int, eos_token_ids=()):
        self.config = config
        self.handles = handles
        self.tokenizer = tokenizer
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_model_len = max_model_len
        self.metrics = ServingMetrics()
        self.router = Router(handles.prefill, handles.decode, handles.stores, config.max_queued_requests)
        # With several prefill workers each has its own prefix cache: a prompt goes, load allowing,
        # to the one that prefilled its beginning.
        self.prefix_caching = config.prefix_cache_gb > 0 and config.prefill_engine == "oasiskv"
        self.prefix_affinity = (PrefixAffinity(block_tokens=config.decode.block_size)
                                if self.prefix_caching and len(handles.prefill) > 1 else None)
        # The decode engine's set (the model's and the tokenizer's), so that the prefill's token is
        # shown as the decode worker will show it (`_first_token_text`).
        self.eos_token_ids = set(eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()))
        self._poller: asyncio.Task | None = None
        self._last_bytes: dict[str, tuple[float, float]] = {}
        self._tasks: set[asyncio.Task] = set()  # started by the poll and not awaited there
        # Requests waiting for room in a store, first come first served; set at every release.
        self._store_waiters: list[object] = []
        self._store_room = asyncio.Event()
        self._stopping: asyncio.Future | None = None  # done once the server stops (`begin_shutdown`)
        self.cluster_down = False  # set before the cluster is shut down
        self.restart_actor = _restart_ray_actor  # a unit test of the poll puts a stand-in here
        # Read at each scrape: set by the health poll, it showed requests long gone (2 while none ran).
        self.metrics.queue_length.set_function(lambda: self.queued)
        for slot in handles.decode:  # each worker's series from 0, so a first restart is an increase
            self.metrics.worker_restarts.labels("decode", slot.name)

    def begin_shutdown(self) -> None:
        """End every request in flight now (call on the event loop): each gets ShuttingDown,
        which the API sends as an error, while the workers are still there to free its KV."""
        signal = self._stop_signal()
        if not signal.done():
            signal.set_result(None)

    def _stop_signal(self) -> asyncio.Future:
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        return self._stopping

    # -- background health and stats -----------------------------------------------------
    def start_polling(self, interval_s: float = 2.0) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever(interval_s))

    async def stop_polling(self, timeout_s: float = 10.0) -> None:
        """Stop the health poll, cancelling it again until it stops: Python 3.11's
        asyncio.wait_for drops a cancel that comes with a worker's answer, and the poll then went
        on for good, so the server's shutdown waited on it forever (CI saw it). After
        `timeout_s`, shutdown goes on without it."""
        poller, self._poller = self._poller, None
        if poller is None:
            return
        deadline = time.monotonic() + timeout_s
        while not poller.done() and time.monotonic() < deadline:
            poller.cancel()
            await asyncio.wait({poller}, timeout=0.5)
        if not poller.done():
            log.warning("the health poll did not stop within %.0f s; going on without it", timeout_s)
        elif not poller.cancelled() and poller.exception() is not None:
            log.warning("the health poll had stopped on an error: %r", poller.exception())

    async def _poll_forever(self, interval_s: float) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(interval_s)

    async def poll_once(self) -> None:
        m = self.metrics
        for slot in self.handles.decode:
            stats = await self._poll(slot, slot.handle.stats)
            self._answered(slot.name, stats is not None)
            if stats is None:
                m.nixl_rate.pop(slot.name, None)
                self._last_bytes.pop(slot.name, None)
            if stats is not None:
                slot.healthy = bool(stats["healthy"])  # the worker's own word: its engine is broken
                if slot.healthy:
                    slot.restart_requested = False
                elif (self.config.restart_broken_decode_workers and not slot.restart_requested
                      and not stats.get("closed")):
                    self._restart(slot, "decode", stats.get("error") or "its decode loop has stopped")
                m.worker_stats[slot.name] = stats
                # Every read from the stores: dense moves all of its KV at admission.
                now = time.monotonic()
                total = float(sum(stats.get(key) or 0 for key in
                                  ("bytes_fetched", "admission_bytes_fetched", "summary_bytes_fetched")))
                if slot.name in self._last_bytes:
                    then, before = self._last_bytes[slot.name]
                    if total < before:  # the worker restarted: its counters began again at 0
                        before = 0.0
                    m.nixl_rate[slot.name] = (total - before) / max(1e-6, now - then)
                self._last_bytes[slot.name] = (now, total)
            m.health[("decode", slot.name)] = slot.healthy
        for slot in self.handles.stores:
            stats = await self._poll(slot, slot.handle.stats, group=None)
            self._answered(slot.name, stats is not None)
            if stats is not None:
                m.store_stats[slot.name] = stats
                address = stats.get("address")
                if address and address != slot.address:
                    log.warning("%s is back at %s (it was at %s): Ray restarted it, empty", slot.name, address, slot.address)
                    if slot.address:
                        self._background(self._retire_store(slot.address))
                    slot.address = address
            m.health[("store", slot.name)] = slot.healthy
        for slot in self.handles.prefill:
            await self._poll(slot, slot.handle.ready)
            m.health[("prefill", slot.name)] = slot.healthy

    def _answered(self, name: str, answered: bool) -> None:
        (self.metrics.unanswered.discard if answered else self.metrics.unanswered.add)(name)

    def _background(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # a task nobody references may be collected before it runs
        task.add_done_callback(self._tasks.discard)

    async def _retire_store(self, address: str) -> None:
        """Every decode worker drops its client of the store that was at `address`."""
        for slot in self.handles.decode:
            try:
                await asyncio.wait_for(_await(slot.handle.forget_store.remote(address)), timeout=60)
            except Exception as error:  # a dead worker lost its clients anyway
                log.warning("%s could not retire its client of the store at %s: %r", slot.name, address, error)

    def _restart(self, slot, role: str, reason: str) -> None:
        """A worker broken for good refuses every request until it is restarted; nothing else
        restarts it (its actor is alive, and the head's liveness probe only checks the port).
        Once per breakage: the old actor may answer a poll or two more before it goes."""
        slot.restart_requested = True
        log.error("%s is broken (%s): asking Ray to restart it", slot.name, reason)
        try:
            self.restart_actor(slot.handle)
        except Exception:
            log.exception("%s could not be restarted; it stays out of routing", slot.name)
            return
        self.metrics.worker_restarts.labels(role, slot.name).inc()

    async def _poll(self, slot, method, group: str | None = HEALTH_GROUP):
        """Call a worker's health method; its answer, or None. A worker that raised (its actor
        died, say) is unhealthy at once; one that is only slow to answer, after
        `missed_polls_unhealthy` polls in a row, so a busy moment does not take it out of routing."""
        try:
            call = method.options(concurrency_group=group) if group else method
            answer = await asyncio.wait_for(_await(call.remote()), timeout=self.config.health_timeout_s)
        except asyncio.TimeoutError:
            slot.missed_polls += 1
            if slot.missed_polls >= self.config.missed_polls_unhealthy:
                slot.healthy = False
            return None
        except Exception:
            slot.healthy = False
            return None
        slot.missed_polls = 0
        slot.healthy = True
        return answer

    # -- one request ---------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Requests waiting for a decode pool or for room in a store."""
        return self.router.queued + len(self._store_waiters)

    async def _assign(self, request_id: str, prompt_tokens: int, rows: int, store_bytes: int, deadline: "_Deadline",
                      on_accepted: Callable[[], None] = lambda: None, prefix_keys: list | None = None):
        """The router's assignment; a request that finds every store full waits for room (the
        stores free a request's KV when it ends), first come first served, within the queue's
        limit and the request's timeout, as one that finds every decode pool full waits in a
        decode queue. Before, it was refused (503) at once: a burst of long prompts, each a
        large share of a store, was refused while the decode queue had room. `on_accepted` is
        called once the request is assigned or begins to wait for room: past the refusals a
        request meets on arrival. A waiting one may still time out, be cancelled, meet a server
        that stops, or be refused at the head of the line (every decode pool full and the decode
        queue at its limit, or a role left without a healthy worker). `prefix_keys` (the prompt's
        beginnings, `PrefixAffinity.keys`) are looked up and remembered at each assignment, so a
        sibling choice assigned while this one waited is seen."""
        if not self._store_waiters:
            try:
                assignment = self._route(request_id, prompt_tokens, rows, store_bytes, prefix_keys)
            except StoresFull:
                pass
            else:
                try:
                    on_accepted()
                except BaseException:
                    self._release(assignment)
                    raise
                return assignment
        else:  # behind others, refused now rather than after a wait that could never end in room
            self.router.check_servable(rows, store_bytes)
        if self.queued >= self.config.max_queued_requests:
            raise Overloaded("every KV store is full and the queue is at its limit", retry_after_s=2, status=503)
        ticket = object()
        self._store_waiters.append(ticket)
        try:
            on_accepted()
            while True:
                if self._store_waiters[0] is ticket:
                    try:
                        return self._route(request_id, prompt_tokens, rows, store_bytes, prefix_keys)
                    except StoresFull:
                        pass
                left = deadline.at - time.monotonic()
                if left <= 0:
                    deadline.expired = True
                    raise TimeoutError("every KV store stayed full until the request timed out")
                self._store_room.clear()
                # A release sets it; a store that comes back healthy does not, hence the bound.
                with contextlib.suppress(TimeoutError):
                    await deadline.wait(self._store_room.wait(), at_most=1.0)
        finally:
            self._store_waiters.remove(ticket)
            self._store_room.set()  # the next in line may fit now

    def _route(self, request_id: str, prompt_tokens: int, rows: int, store_bytes: int, prefix_keys: list | None):
        """The router's assignment, sent where the prompt's beginning was prefilled where that pays."""
        affinity = self.prefix_affinity
        if affinity is None or not prefix_keys:
            return self.router.assign(request_id, prompt_tokens, rows, store_bytes)
        assignment = self.router.assign(request_id, prompt_tokens, rows, store_bytes, affinity.worker_for(prefix_keys))
        affinity.remember(prefix_keys, assignment.prefill.name)
        return assignment

    def _release(self, assignment) -> None:
        self.router.release(assignment)
        self._store_room.set()

    def rows_needed(self, prompt_tokens: int, max_tokens: int, mode: str | None, budget: int | None) -> int:
        return plan_rows(self.config.decode, prompt_tokens, max_tokens, mode, budget,
                         kv_itemsize=self.config.kv_itemsize).total

    def store_bytes_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        """What a request may take in its store: its KV grows to prompt + max_tokens tokens (one
        block of slack covers the last block's rounding)."""
        return (prompt_tokens + max_tokens + self.config.decode.block_size) * self.kv_bytes_per_token

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       mode: str | None = None, budget_tokens: int | None = None,
                       on_accepted: Callable[[], None] = lambda: None) -> AsyncIterator[Event]:
        """Raises Overloaded / TooLarge before anything is started; then yields Events.
        `on_accepted` is called when the request is past the refusals it meets on arrival, which
        may be long before its first event: it may wait for room in a store, and be refused at the
        head of that line still (`_assign`)."""
        c = self.config.decode
        rows = self.rows_needed(len(prompt_ids), params.max_tokens, mode, budget_tokens)
        store_bytes = self.store_bytes_needed(len(prompt_ids), params.max_tokens)
        # A deadline checked at every await, not asyncio.timeout(): that binds to the task that
        # enters it, and later events are pulled by other tasks (the response's, a hang-up watch).
        deadline = _Deadline(self.config.request_timeout_s, self._stop_signal())
        started = time.perf_counter()  # TTFT and E2E count a wait for room in a store, as a client sees it
        m = self.metrics
        affinity = self.prefix_affinity
        prefix_keys = affinity.keys(prompt_ids) if affinity is not None else None
        try:
            assignment = await self._assign(request_id, len(prompt_ids), rows, store_bytes, deadline, on_accepted,
                                            prefix_keys)
        except TimeoutError:  # waited for store room until the deadline: an error, as a later timeout is
            m.requests.labels(status="error").inc()
            raise
        except (asyncio.CancelledError, GeneratorExit, ShuttingDown):  # the client hung up, or the server stops
            m.requests.labels(status="abort").inc()
            raise
        # Running: being prefilled or decoded. A queued request (every pool or seat was full)
        # joins it when its decode engine takes it in; it was counted as running and queued at once.
        running = not assignment.queued
        if running:
            m.running.inc()
        m.prompt_tokens.inc(len(prompt_ids))
        status = "error"
        decode_started = prefilled = False
        prefill_ref = None
        worker_failed = False
        token_count = 0
        last_token_time = None
        first_token_time = None
        try:
            try:
                prefill_ref = assignment.prefill.handle.prefill.remote(
                    request_id, prompt_ids, asdict(params), assignment.store_address,
                    (budget_tokens or c.budget_tokens) // c.block_size, c.sink_blocks, c.window_blocks,
                )
                result = await deadline.wait(_await(prefill_ref))
            except BaseException:
                if prefix_keys:  # its cache may not hold the prompt: no later prompt is sent there for it
                    affinity.forget(prefix_keys, assignment.prefill.name)
                raise
            prefilled = True
            self.router.prefill_done(assignment)
            if self.prefix_caching:
                m.prefix_cache_queries.inc(len(prompt_ids))
                m.prefix_cache_hits.inc(result.cached_tokens)
            # The decode worker has no use for the prompt's logprobs: megabytes for a long prompt.
            handed = result if result.prompt_logprobs is None else replace(result, prompt_logprobs=None)
            stream = assignment.decode.handle.generate.options(num_returns="streaming").remote(
                handed, asdict(params), assignment.store_address, mode, budget_tokens
            )
            decode_started = True
            # The prefill's token goes out now, while the decode worker admits the request; it
            # went out with the first decode step, so TTFT counted the working set's transfer and
            # a whole step. The worker's stream repeats its text first: that many characters are cut.
            repeated = self._first_token_text(result.first_token, params)
            prompt_logprobs = result.prompt_logprobs  # on the first event
            # Token i's logprobs go out with the event that counts token i.
            logprobs = [] if result.first_logprob is None else [result.first_logprob]
            if repeated:
                first_token_time = last_token_time = time.perf_counter()
                m.ttft.observe(first_token_time - started)
                token_count = 1
                yield Event(repeated, 1, logprobs=logprobs[:1], cached_tokens=result.cached_tokens,
                            prompt_logprobs=prompt_logprobs)
                prompt_logprobs = None
            repeated = len(repeated)
            while True:
                try:
                    ref = await deadline.wait(anext(stream))
                except StopAsyncIteration:
                    break
                out = await deadline.wait(_await(ref))
                if self.router.admitted(assignment):
                    running = True
                    m.running.inc()
                now = time.perf_counter()
                sent_tokens = token_count
                logprobs += out.get("logprobs") or []
                new_tokens = out["num_tokens"] - token_count
                if new_tokens > 0:
                    if first_token_time is None:
                        first_token_time = now
                        m.ttft.observe(now - started)
                    elif last_token_time is not None:
                        for _ in range(new_tokens):  # tokens of one speculative step share the gap
                            m.itl.observe((now - last_token_time) / new_tokens)
                    last_token_time = now
                    token_count = out["num_tokens"]
                delta = out["text_delta"]  # the worker sends only what follows the text already sent
                if repeated:
                    cut = min(repeated, len(delta))
                    delta, repeated = delta[cut:], repeated - cut
                if out["finished"]:  # before the yield: the consumer may close us after it
                    status = "abort" if out["finish_reason"] == "abort" else "success"
                new_logprobs = logprobs[sent_tokens:token_count]  # empty unless the request asked for them
                if delta or new_logprobs or out["finished"]:
                    yield Event(delta, token_count, out["finished"], out["finish_reason"], new_logprobs,
                                out.get("stop_reason"), result.cached_tokens, prompt_logprobs)
                    prompt_logprobs = None
                if out["finished"]:
                    break
        except (asyncio.CancelledError, GeneratorExit):
            if status != "success":  # closed after the final event is a normal end
                status = "abort"
            raise
        except ShuttingDown:
            status = "abort"
            raise
        except Exception as exc:
            # A worker that raised is not asked to abort; one that is only late still holds the request.
            worker_failed = not deadline.expired
            if _actor_died(exc):
                # No more requests go to it until it answers a health poll again: until the next
                # poll (2 s) the router kept choosing it, and each such request failed.
                (assignment.decode if decode_started else assignment.prefill).healthy = False
            raise
        finally:
            freed = None
            if status != "success":
                freed = await self._cancel(assignment, prefill_ref, prefilled, decode_started and not worker_failed)
            if freed is None:
                self._release(assignment)
            else:  # its store memory and decode rows are counted until they are given back
                self._background(self._release_after(freed, assignment))
            if running:
                m.running.dec()
            m.requests.labels(status=status).inc()
            # Every token that reached the service counts, whatever the end: a bytes-per-token
            # panel divides the workers' bytes (every request's) by this.
            m.generation_tokens.inc(token_count)
            end = time.perf_counter()
            if status == "success":
                m.e2e.observe(end - started)
                if token_count > 1 and first_token_time is not None:
                    m.tpot.observe((end - first_token_time) / (token_count - 1))

    def _first_token_text(self, token: int, params: SamplingParams) -> str:
        """The text the decode worker will show for the prefill's token: "" when that token ends
        the request or its text is not settled yet (part of a character, or of a stop string)."""
        if finish_reason(token, 1, params, self.eos_token_ids, False):
            return ""
        text, reason = visible_text(OutputText(self.tokenizer, params.skip_special_tokens), [token], params, None,
                                    self.eos_token_ids)
        return "" if reason else text

    async def _cancel(self, assignment, prefill_ref, prefilled: bool, decode_started: bool) -> asyncio.Future | None:
        """Free the request's KV wherever it is (decode pool and store, or store only). The store
        is told directly, not through the prefill worker: that one may have died with the request.
        Returns what ends when it is freed (None: nothing to wait for). The router counted it
        as gone at once, and let the next request into a store that still held it (StoreFull)."""
        if self.cluster_down:  # nothing left to free, and an actor call would start a new local Ray
            return None
        try:
            if decode_started:
                return asyncio.ensure_future(self._abort_or_free(assignment))
            if prefilled:
                return asyncio.ensure_future(_await(assignment.store.handle.free.remote(assignment.request_id)))
            if prefill_ref is not None:
                # Still prefilling, or queued for it: stopped at its next chunk (on the health
                # group's thread, not behind the prefills), and freed once the worker lets go.
                freed = asyncio.ensure_future(self._free_after(prefill_ref, assignment))
                assignment.prefill.handle.cancel.options(concurrency_group=HEALTH_GROUP).remote(assignment.request_id)
                return freed
        except Exception:
            pass
        return None

    async def _release_after(self, freed: asyncio.Future, assignment) -> None:
        """The assignment's room goes back once its KV has left (at most FREE_WAIT_S: a worker or
        store that does not answer gets it back then, as its TTL frees it in the end)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(freed), FREE_WAIT_S)
        self._release(assignment)

    async def _abort_or_free(self, assignment) -> None:
        """Abort the request in its decode worker, which frees its KV there and in its store; a
        worker that died meanwhile frees nothing, so the store is told here. A request cut short
        because a sibling choice's worker died (the same worker) kept its store memory until the
        store's TTL."""
        try:
            await asyncio.wait_for(_await(assignment.decode.handle.abort.remote(assignment.request_id)), timeout=60)
            return
        except Exception as error:
            if not _actor_died(error):
                return  # alive but slow to answer: its engine still frees the request
        with contextlib.suppress(Exception):
            assignment.store.handle.free.remote(assignment.request_id)

    async def _free_after(self, prefill_ref, assignment) -> None:
        with contextlib.suppress(Exception):
            await prefill_ref
        with contextlib.suppress(Exception):
            await assignment.store.handle.free.remote(assignment.request_id)


async def _await(ref):
    return await ref


class _Deadline:
    """Awaits under one overall time limit, and until the server stops; `expired` tells a
    timeout of ours from a worker's."""

    def __init__(self, seconds: float, stopping: asyncio.Future | None = None):
        self.at = time.monotonic() + seconds
        self.expired = False
        self.stopping = stopping

    async def wait(self, awaitable, at_most: float | None = None):
        left = max(0.0, self.at - time.monotonic())
        task = asyncio.ensure_future(awaitable)
        waiters = {task} if self.stopping is None else {task, self.stopping}
        try:
            done, _ = await asyncio.wait(waiters, timeout=left if at_most is None else min(left, at_most),
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        # Waited on, not awaited: awaiting it, a cancel of our own (the client hung up) in the
        # turns it takes to end was taken for its and swallowed, and the request waited on.
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: its late end is not ours
        if self.stopping is not None and self.stopping.done():
            raise ShuttingDown("the server is shutting down")
        self.expired = time.monotonic() >= self.at
        raise TimeoutError


def _actor_died(error: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(error, RayActorError)


def _restart_ray_actor(handle) -> None:
    """Kill the actor so that Ray starts it again (the launcher gives workers max_restarts=-1)."""
    import ray

    ray.kill(handle, no_restart=False)
