"""Prefills whose client hung up: a prefill worker checks between chunks and stops.

The API asks the worker to cancel a request whose client went away while it was queued for, or
running, its prefill. Without it a prefill ran to its end (a 7,000-token prompt for most of a
minute on a CPU), and every prefill queued behind it waited. A call may also still wait in Ray's
queue, outside the worker (an actor runs 8 calls at once): its cancel is remembered, and its
prefill stops before it starts. Before, 20 clients that hung up together left the worker busy
for a minute, and the next request's first token took 20 s instead of 2.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator


class PrefillCancelled(RuntimeError):
    """The request was cancelled before its prefill finished; the store holds none of its KV."""


class Cancellations:
    def __init__(self, remember_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._cancelled: set[str] = set()
        self.remember_s = remember_s
        self._clock = clock
        self._before_arrival: dict[str, float] = {}  # request id -> until when its cancel holds

    @contextmanager
    def tracking(self, request_id: str) -> Iterator[Callable[[], bool]]:
        """For the prefill of `request_id`, queued or running: yields whether it was cancelled."""
        with self._lock:
            self._pending.add(request_id)
            if self._before_arrival.pop(request_id, 0.0) > self._clock():
                self._cancelled.add(request_id)
        try:
            yield lambda: request_id in self._cancelled
        finally:
            with self._lock:
                self._pending.discard(request_id)
                self._cancelled.discard(request_id)

    def cancel(self, request_id: str) -> bool:
        """False: no prefill of that request is queued or running here yet (or any more). The
        cancel is then remembered for `remember_s`, in case its call has not arrived."""
        with self._lock:
            if request_id in self._pending:
                self._cancelled.add(request_id)
                return True
            now = self._clock()
            self._before_arrival = {r: until for r, until in self._before_arrival.items() if until > now}
            self._before_arrival[request_id] = now + self.remember_s
            return False


def raise_if(cancelled: Callable[[], bool] | None, request_id: str) -> None:
    if cancelled is not None and cancelled():
        raise PrefillCancelled(f"the prefill of {request_id} was cancelled (its client went away)")
