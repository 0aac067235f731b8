"""All of the decode engine's store calls on I/O threads: one per store.

With UCX's CMA transport NIXL copies inside `transfer()`, so a READ returns already complete and
the caller has spent the copy time. Submitting from a thread of its own lets the copy run while
the model computes (torch releases the GIL in its kernels). Each store's calls run on one
thread, so its client is never used from two threads at once; a client that routes requests to
several stores (`route(request_id)`, a `StoreDirectory`) gets a thread per store, so that one
store that stops answering holds up the transfers of its own requests only.

Two lanes per thread. Reads and control calls run first in first out. A write-back (`extend`
the request, then `write_blocks`, as one job) goes in an urgent lane that the thread drains
first: the model thread waits for it before the ring row it reads from is reused, while
prefetches may queue for a whole step behind a slow link. Overtaking queued reads is safe: they
read blocks before the local window, and the block written back is still in the window, so any
read of it is queued after its write, and the urgent lane runs first. The model thread never
waits for the `extend` itself: a store that does not answer held up every request's step for
the timeout, at each block a request completed.

Every wait is bounded: a transfer or control call not done in time raises `StoreTimeout`, and
`ended()` tells whether a transfer can still write into the caller's memory (a timed-out one
may: the caller must not reuse that memory until it has ended). A transfer is due a timeout
after it was submitted (`FetchHandle.deadline`), not a timeout after someone starts waiting for
it: the transfers of a store that stops answering, issued together, time out together, and the
model thread, waiting for one after another, is held up once and not once per transfer.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from concurrent.futures import Future

from ..kvstore import KVStoreError, StoreTimeout
from ..kvstore.nixl_agents import stop_polling_at_exit

# Control calls whose first argument is a request id: they run on that request's store thread.
ROUTED_CALLS = frozenset({"extend", "free", "read_summaries"})


def transfer_ended(handle) -> bool:
    """Whether a transfer handle can no longer write into memory: finished, failed or cancelled."""
    ended = getattr(handle, "ended", None)
    if ended is not None:
        return ended()
    try:
        return handle.done()
    except Exception:  # a failed transfer has ended
        return True


class FetchHandle:
    """The TransferHandle interface (done / wait / ended) over a transfer submitted to an I/O
    thread; `index`: this read's entry in a `read_many` job, which fails only if this read did."""

    def __init__(self, future: Future, timeout_s: float, index: int | None = None, underlying: list | None = None):
        self.future = future
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.index = index
        # [the store client's handle], set by the job once it has started the transfer.
        self.underlying = underlying if underlying is not None else [None]

    def done(self) -> bool:
        if not self.future.done():
            return False
        self._result(None)  # re-raise a failed transfer here
        return True

    def wait(self, timeout: float | None = None) -> None:
        self._result(timeout)

    def wait_due(self) -> None:
        """Wait until it has landed, at most until its deadline; `StoreTimeout` once that has passed."""
        try:
            self.wait(max(0.0, self.deadline - time.monotonic()))
        except StoreTimeout:
            if self.future.done():
                raise  # the job's own wait for the store timed out
            raise StoreTimeout(f"transfer not done {self.timeout_s:.1f}s after it was issued "
                               "(its store's I/O thread is held up)") from None

    def ended(self) -> bool:
        if not self.future.done():
            return False  # queued or running: it may still write
        try:
            self._result(None)
        except StoreTimeout:
            pass  # the job stopped waiting for it; the client's transfer may go on
        except BaseException:
            return True  # it failed
        else:
            return True  # it landed
        underlying = self.underlying[0]
        return underlying is None or transfer_ended(underlying)

    def _result(self, timeout: float | None) -> None:
        result = _result_within(self.future, timeout, "transfer")
        if self.index is not None and result[self.index] is not None:
            raise result[self.index]


def _result_within(future: Future, timeout: float | None, what: str):
    """The future's result; `StoreTimeout` when it is not done within `timeout`."""
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        raise StoreTimeout(f"{what} not done after {timeout:.1f}s (its store's I/O thread is held up)") from None
    except concurrent.futures.CancelledError:
        raise StoreTimeout(f"{what} cancelled before it ran") from None


class _IOThread:
    """One thread, its urgent and its first-in-first-out lane."""

    def __init__(self, name: str):
        self._urgent: deque = deque()
        self._queued: deque = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        stop_polling_at_exit(self)  # its jobs call into NIXL

    def submit(self, fn, urgent: bool = False) -> Future:
        future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the decode engine's I/O thread is closed")
            (self._urgent if urgent else self._queued).append((future, fn))
            self._wake.notify()
        return future

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._urgent or self._queued or self._closed):
                    self._wake.wait()
                if not (self._urgent or self._queued):
                    return  # closed, and everything queued has run
                future, fn = (self._urgent or self._queued).popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to whoever waits on the future
                future.set_exception(error)

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop (waiting at most `timeout`; from a job on this thread,
        not waiting)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stop_polling(self, wait_s: float) -> None:
        """At interpreter exit: drop what is queued and let the job running end (at most
        `wait_s`). A daemon thread still inside a NIXL call as Python finalized aborted the process."""
        with self._wake:
            dropped = list(self._urgent) + list(self._queued)
            self._urgent.clear()
            self._queued.clear()
        for future, _ in dropped:
            future.cancel()
        self.close(wait_s)


class IOThreadClient:
    def __init__(self, client, timeout_s: float = 30.0):
        self.client = client
        self.timeout_s = timeout_s
        self._route = getattr(client, "route", None)
        self._threads: dict[object, _IOThread] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _thread_for(self, request_id: str | None = None) -> _IOThread:
        key = self._route(request_id) if self._route is not None and request_id is not None else None
        with self._lock:
            if self._closed:
                raise RuntimeError("the decode engine's I/O thread is closed")
            thread = self._threads.get(key)
            if thread is None:
                thread = self._threads[key] = _IOThread(f"kv-io-{len(self._threads)}")
        return thread

    def _transfer(self, request_id: str, start, urgent: bool = False) -> FetchHandle:
        """A job on the request's store thread: `start()` starts the client's transfer, which
        the job then waits for."""
        underlying = [None]

        def run():
            underlying[0] = start()
            underlying[0].wait(self.timeout_s)

        return FetchHandle(self._thread_for(request_id).submit(run, urgent), self.timeout_s, underlying=underlying)

    def read_blocks(self, request_id: str, *args, **kwargs) -> FetchHandle:
        return self._transfer(request_id, lambda: self.client.read_blocks(request_id, *args, **kwargs))

    def read_many(self, reads: list[tuple]) -> list[FetchHandle]:
        """Several `read_blocks(*args)` (e.g. one per request for a layer) as one job per store,
        with one handle per read: every job hands the GIL to a thread and back, which cost the
        model thread more than the reads themselves when it was one job per request. A job
        waits for every read, and a read that fails (its store died) fails only its own handle:
        a shared failure ended every request of the job, then broke the worker when it could
        not confirm their transfers had ended."""
        by_thread: dict[int, tuple[_IOThread, list[int]]] = {}
        for index, args in enumerate(reads):
            thread = self._thread_for(args[0])
            by_thread.setdefault(id(thread), (thread, []))[1].append(index)
        handles: list[FetchHandle | None] = [None] * len(reads)
        for thread, indices in by_thread.values():
            underlying = [[None] for _ in indices]  # each read's client handle, set by the job

            def run(indices=indices, underlying=underlying) -> list[KVStoreError | None]:
                errors: list[KVStoreError | None] = []
                for index, slot in zip(indices, underlying):
                    try:
                        slot[0] = self.client.read_blocks(*reads[index])
                        errors.append(None)
                    except KVStoreError as error:
                        errors.append(error)
                for position, slot in enumerate(underlying):
                    if errors[position] is None:
                        try:
                            slot[0].wait(self.timeout_s)
                        except KVStoreError as error:
                            errors[position] = error
                return errors

            future = thread.submit(run)
            for position, index in enumerate(indices):
                handles[index] = FetchHandle(future, self.timeout_s, position, underlying[position])
        return handles

    def write_back(self, request_id: str, num_tokens: int, *args, **kwargs) -> FetchHandle:
        """`extend(request_id, num_tokens)`, then `write_blocks(request_id, *args)`, in the
        urgent lane; a refused extend fails the handle, and nothing is written."""

        def start():
            self.client.extend(request_id, num_tokens)
            return self.client.write_blocks(request_id, *args, **kwargs)

        return self._transfer(request_id, start, urgent=True)

    def call_later(self, name: str, *args, **kwargs) -> Future:
        """Queue a control call without waiting for it (a free that its store may be too slow to
        answer); its future holds the result or the error."""
        method = getattr(self.client, name)
        thread = self._thread_for(args[0] if name in ROUTED_CALLS and args else None)
        return thread.submit(lambda: method(*args, **kwargs))

    def __getattr__(self, name: str):
        """Control calls (extend, free, read_summaries, register...) run on an I/O thread too
        (a request's store's, for those naming a request), after the transfers queued before
        them; the caller waits for their result, at most the timeout."""
        attribute = getattr(self.client, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            return _result_within(self.call_later(name, *args, **kwargs), self.timeout_s, repr(name))

        return call

    def forget_route(self, key) -> None:
        """Stop the thread of a store client that is gone (`StoreDirectory.retire`) once what is
        queued on it has run, without waiting for it."""
        with self._lock:
            thread = self._threads.pop(key, None)
        if thread is not None:
            thread.close(timeout=0)

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop the threads (a thread held up by a store that does not
        answer is left behind after `timeout`, a daemon)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads.values())
        for thread in threads:
            thread.close(timeout)
