"""All of the decode engine's store calls on one I/O thread.

With UCX's CMA transport NIXL copies inside `transfer()`, so a READ returns already complete and
the caller has spent the copy time. Submitting from a thread of its own lets the copy run while
the model computes (torch releases the GIL in its kernels). One thread, first in first out, so a
write-back lands before a later read of the same block, and the client is never used from two
threads at once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


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


class IOThreadClient:
    def __init__(self, client, timeout_s: float = 30.0):
        self.client = client
        self.timeout_s = timeout_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-io")

    def _transfer(self, method: str, *args, **kwargs) -> FetchHandle:
        def run():
            getattr(self.client, method)(*args, **kwargs).wait(self.timeout_s)

        return FetchHandle(self._thread.submit(run))

    def read_blocks(self, *args, **kwargs) -> FetchHandle:
        return self._transfer("read_blocks", *args, **kwargs)

    def read_many(self, reads: list[tuple]) -> FetchHandle:
        """Several `read_blocks(*args)` (e.g. one per request for a layer) as ONE job: every
        job hands the GIL to this thread and back, which cost the model thread more than the
        reads themselves when it was one job per request."""

        def run():
            handles = [self.client.read_blocks(*args) for args in reads]
            for handle in handles:
                handle.wait(self.timeout_s)

        return FetchHandle(self._thread.submit(run))

    def write_blocks(self, *args, **kwargs) -> FetchHandle:
        return self._transfer("write_blocks", *args, **kwargs)

    def __getattr__(self, name: str):
        """Control calls (extend, free, read_summaries, register...) run on the I/O thread too,
        after the transfers queued before them; the caller waits for their result."""
        attribute = getattr(self.client, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            return self._thread.submit(attribute, *args, **kwargs).result()

        return call

    def close(self) -> None:
        self._thread.shutdown(wait=True)
