"""Picks the workers and the store for each request, and refuses work it cannot take.

Load is accounted here, at the only place that sees every request: queued prefill tokens per
prefill worker, reserved pool rows per decode worker, reserved bytes per store. A request that
can never fit is a client error; one that cannot fit *now* is refused with Retry-After (the
service makes one that finds every store full wait for room instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class Overloaded(Exception):
    """Every pool is full right now; retry later."""

    def __init__(self, message: str, retry_after_s: int = 1, status: int = 429):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status


class StoresFull(Overloaded):
    """Every healthy store is too full for the request right now; the service waits for room."""

    def __init__(self, message: str = "every KV store is full"):
        super().__init__(message, retry_after_s=2, status=503)


class TooLarge(ValueError):
    """The request can never fit, whatever the load."""


@dataclass
class WorkerSlot:
    name: str
    handle: object
    capacity: int = 0  # decode: pool rows; store: bytes; prefill: unused
    seats: int = 0  # decode: requests its engine runs at once (max_num_seqs); 0: no limit
    load: int = 0  # prefill: queued tokens; decode: reserved rows; store: reserved bytes
    active: int = 0
    healthy: bool = True
    address: str = ""
    missed_polls: int = 0  # health polls in a row that got no answer in time
    restart_requested: bool = False  # decode: asked Ray to restart it; cleared when it answers healthy


@dataclass
class Assignment:
    request_id: str
    prefill: WorkerSlot
    decode: WorkerSlot
    store: WorkerSlot
    prompt_tokens: int  # what the prefill worker is charged: the prompt, less what its prefix cache likely holds
    rows: int
    store_bytes: int
    queued: bool = False
    released: bool = field(default=False)
    # Where the store was when the request was assigned: prefill, decode and the clean-up all
    # use this one, though a restarted store moves.
    store_address: str = ""
    prefill_pending: bool = True  # its prefill worker still counts it


class Router:
    def __init__(self, prefill: list[WorkerSlot], decode: list[WorkerSlot], stores: list[WorkerSlot],
                 max_queued_requests: int = 64):
        self.prefill = prefill
        self.decode = decode
        self.stores = stores
        self.max_queued_requests = max_queued_requests

        self.queued = 0  # requests admitted while every pool was full (they wait in a decode queue)

    def check_servable(self, rows: int, store_bytes: int) -> None:
        """Raises what would refuse the request however long it waited: no healthy worker for a
        role (Overloaded, 503), or a request larger than any decode pool or store (TooLarge)."""
        healthy_decode = [w for w in self.decode if w.healthy]
        if not healthy_decode or not any(w.healthy for w in self.prefill) or not any(s.healthy for s in self.stores):
            raise Overloaded("no healthy worker for some role", retry_after_s=5, status=503)
        if rows > max(w.capacity for w in healthy_decode):
            raise TooLarge(
                f"the request needs {rows} rows of a decode KV pool; the largest pool has {max(w.capacity for w in healthy_decode)}"
            )
        if store_bytes > max(s.capacity for s in self.stores):
            raise TooLarge(f"the request needs {store_bytes} bytes of KV store; the largest store holds {max(s.capacity for s in self.stores)}")

    def assign(self, request_id: str, prompt_tokens: int, rows: int, store_bytes: int,
               prefill_hint: tuple[str, int] | None = None) -> Assignment:
        """`prefill_hint`: (prefill worker, tokens) whose prefix cache likely holds that many of the
        prompt's first tokens."""
        self.check_servable(rows, store_bytes)
        healthy_decode = [w for w in self.decode if w.healthy]
        # A worker whose engine runs max_num_seqs requests already makes a new one wait as a full
        # pool does: it counts as queued, so the queue limit and gauge see it.
        fitting = [w for w in healthy_decode if w.load + rows <= w.capacity and (not w.seats or w.active < w.seats)]
        queued = False
        if fitting:
            decode = min(fitting, key=lambda w: (w.load / w.capacity, w.active))
        else:
            if self.queued >= self.max_queued_requests:
                raise Overloaded("every decode KV pool (or every decode worker's max_num_seqs) is full and the queue "
                                 "is at its limit", retry_after_s=2)
            decode = min(healthy_decode, key=lambda w: (w.load - w.capacity, w.active))
            queued = True
        stores = [s for s in self.stores if s.healthy and s.load + store_bytes <= s.capacity]
        if not stores:
            raise StoresFull()
        store = min(stores, key=lambda s: s.load)
        prefill, prefill_tokens = self._pick_prefill(prompt_tokens, prefill_hint)
        for slot, load in ((prefill, prefill_tokens), (decode, rows), (store, store_bytes)):
            slot.load += load
            slot.active += 1
        self.queued += queued
        return Assignment(request_id, prefill, decode, store, prefill_tokens, rows, store_bytes, queued,
                          store_address=store.address)

    def _pick_prefill(self, prompt_tokens: int, hint: tuple[str, int] | None) -> tuple[WorkerSlot, int]:
        """(worker, tokens it is charged): the least loaded healthy prefill worker, or the hinted
        one where that finishes no later: its queued tokens plus what the prompt costs there,
        against the least loaded one's plus the whole prompt. A cached token still costs about
        1/16 of a computed one (the whole prompt's store write and key summaries: 0.62-0.64 s of
        12.1-12.2 s at 4K, bench/prefix_cache.py)."""
        healthy = [w for w in self.prefill if w.healthy]
        least = min(healthy, key=lambda w: (w.load, w.active))
        if hint is not None:
            name, cached = hint
            cached = max(0, min(cached, prompt_tokens - 1))  # at least the last token is computed
            charge = prompt_tokens - cached + -(-cached // 16)
            preferred = next((w for w in healthy if w.name == name), None)
            if preferred is not None and preferred.load + charge <= least.load + prompt_tokens:
                return preferred, charge
        return least, prompt_tokens

    def prefill_done(self, a: Assignment) -> None:
        if not a.prefill_pending:
            return
        a.prefill_pending = False
        a.prefill.load -= a.prompt_tokens
        a.prefill.active -= 1

    def admitted(self, a: Assignment) -> bool:
        """A queued request's decode engine took it in (its first decode output came): it waits no
        more, so it leaves the queue's count and limit (it stayed counted until it ended). True
        when it was queued until now."""
        if not a.queued or a.released:
            return False
        a.queued = False
        self.queued -= 1
        return True

    def release(self, a: Assignment) -> None:
        if a.released:
            return
        a.released = True
        self.queued -= a.queued
        self.prefill_done(a)
        for slot, load in ((a.decode, a.rows), (a.store, a.store_bytes)):
            slot.load -= load
            slot.active -= 1
