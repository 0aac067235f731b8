"""Prefills whose client hung up: a prefill worker checks between chunks and stops.

The API asks the worker to cancel a request whose client went away while it was queued for, or
running, its prefill. Without it a prefill ran to its end (a 7,000-token prompt for most of a
minute on a CPU), and every prefill queued behind it waited.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator


class PrefillCancelled(RuntimeError):
    """The request was cancelled before its prefill finished; the store holds none of its KV."""


class Cancellations:
    def __init__(self):
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._cancelled: set[str] = set()

    @contextmanager
    def tracking(self, request_id: str) -> Iterator[Callable[[], bool]]:
        """For the prefill of `request_id`, queued or running: yields whether it was cancelled."""
        with self._lock:
            self._pending.add(request_id)
        try:
            yield lambda: request_id in self._cancelled
        finally:
            with self._lock:
                self._pending.discard(request_id)
                self._cancelled.discard(request_id)

    def cancel(self, request_id: str) -> bool:
        """False: no prefill of that request is queued or running here (it has finished, say), so
        nothing is remembered for it."""
        with self._lock:
            if request_id not in self._pending:
                return False
            self._cancelled.add(request_id)
            return True


def raise_if(cancelled: Callable[[], bool] | None, request_id: str) -> None:
    if cancelled is not None and cancelled():
        raise PrefillCancelled(f"the prefill of {request_id} was cancelled (its client went away)")
