"""All of the decode engine's store calls on one I/O thread.

With UCX's CMA transport NIXL copies inside `transfer()`, so a READ returns already complete and
the caller has spent the copy time. Submitting from a thread of its own lets the copy run while
the model computes (torch releases the GIL in its kernels). One thread, so the client is never
used from two threads at once.

Two lanes. Reads and control calls run first in first out. A write-back (`write_blocks`, and
the `extend` before it) goes in an urgent lane that the thread drains first: the model thread
waits for it (`extend` at once, the write before its ring row is reused), while prefetches may
queue for a whole step behind a slow link. Overtaking queued reads is safe: they read blocks
before the local window, and the block written back is still in the window, so any read of it
is queued after its write, and the urgent lane runs first.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future

from ..kvstore import KVStoreError

# Control calls that belong to a write-back.
URGENT_CALLS = frozenset({"extend"})


class FetchHandle:
    """The TransferHandle interface (done / wait) over a transfer submitted to the I/O thread."""

    def __init__(self, future: Future):
        self.future = future

    def done(self) -> bool:
        if not self.future.done():
            return False
        self.future.result()  # re-raise a failed transfer here
        return True

    def wait(self, timeout: float | None = None) -> None:
        self.future.result(timeout)


class ReadOfJob(FetchHandle):
    """One read of a `read_many` job: done when the job is, failed only if this read failed."""

    def __init__(self, future: Future, index: int):
        super().__init__(future)
        self.index = index

    def done(self) -> bool:
        if not self.future.done():
            return False
        self._raise_own(self.future.result())
        return True

    def wait(self, timeout: float | None = None) -> None:
        self._raise_own(self.future.result(timeout))

    def _raise_own(self, errors: list) -> None:
        if errors[self.index] is not None:
            raise errors[self.index]


class IOThreadClient:
    def __init__(self, client, timeout_s: float = 30.0):
        self.client = client
        self.timeout_s = timeout_s
        self._urgent: deque = deque()
        self._queued: deque = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kv-io", daemon=True)
        self._thread.start()

    def _submit(self, fn, urgent: bool = False) -> Future:
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

    def _transfer(self, method: str, *args, urgent: bool = False, **kwargs) -> FetchHandle:
        def run():
            getattr(self.client, method)(*args, **kwargs).wait(self.timeout_s)

        return FetchHandle(self._submit(run, urgent))

    def read_blocks(self, *args, **kwargs) -> FetchHandle:
        return self._transfer("read_blocks", *args, **kwargs)

    def read_many(self, reads: list[tuple]) -> list["ReadOfJob"]:
        """Several `read_blocks(*args)` (e.g. one per request for a layer) as ONE job, with one
        handle per read: every job hands the GIL to this thread and back, which cost the model
        thread more than the reads themselves when it was one job per request. The job waits
        for every read, and a read that fails (its store died) fails only its own handle: the
        requests beside it in the job read from other stores, and a shared failure ended them
        all, then broke the worker when it could not confirm their transfers had ended."""

        def run() -> list[KVStoreError | None]:
            submitted = []
            for args in reads:
                try:
                    submitted.append(self.client.read_blocks(*args))
                except KVStoreError as error:
                    submitted.append(error)
            errors = []
            for handle in submitted:
                if isinstance(handle, KVStoreError):
                    errors.append(handle)
                    continue
                try:
                    handle.wait(self.timeout_s)
                    errors.append(None)
                except KVStoreError as error:
                    errors.append(error)
            return errors

        future = self._submit(run)
        return [ReadOfJob(future, index) for index in range(len(reads))]

    def write_blocks(self, *args, **kwargs) -> FetchHandle:
        return self._transfer("write_blocks", *args, urgent=True, **kwargs)

    def __getattr__(self, name: str):
        """Control calls (extend, free, read_summaries, register...) run on the I/O thread too,
        after the transfers queued before them (`extend`: after the write-backs only); the
        caller waits for their result."""
        attribute = getattr(self.client, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            return self._submit(lambda: attribute(*args, **kwargs), name in URGENT_CALLS).result()

        return call

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
