"""What every transport provides, and the handle a transfer returns.

The client (client.py) validates and normalizes arguments; a transport only moves bytes and
forwards control calls. Three exist: in-process (direct copies), TCP (frames on one socket) and
NIXL (TCP control + one-sided NIXL READ/WRITE for data).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from abc import ABC, abstractmethod
from typing import Any, Generator

import numpy as np
import torch

from .errors import KVStoreError, StoreTimeout, StoreUnavailable
from .layout import KVLayout
from .store import RequestInfo
from .summary import QuantizedSummaries


class TransferHandle:
    """A batched transfer in flight. Poll with done(), block with wait(), or await it.

    Errors (unknown request, out-of-range index, store gone...) are raised by the call that
    submits the transfer when the client can tell at once, otherwise by done()/wait().
    Buffers must stay untouched until the transfer is complete.
    """

    def __init__(self, num_units: int, nbytes: int, timeout: float):
        self.num_units = num_units
        self.nbytes = nbytes
        self.timeout = timeout
        self.started = time.monotonic()

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        delay = 0.0
        while not self.done():
            if time.monotonic() > deadline:
                raise StoreTimeout(f"transfer of {self.num_units} units not done after {time.monotonic() - self.started:.1f}s")
            time.sleep(delay)
            delay = min(0.001, delay + 0.00002)

    def __await__(self) -> Generator[Any, None, None]:
        return self._await().__await__()

    async def _await(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.done():
            if time.monotonic() > deadline:
                raise StoreTimeout(f"transfer of {self.num_units} units not done after {self.timeout:.1f}s")
            await asyncio.sleep(0.0002)


class CompletedHandle(TransferHandle):
    """A transfer that finished (or failed) while it was submitted."""

    def __init__(self, num_units: int, nbytes: int, error: KVStoreError | None = None):
        super().__init__(num_units, nbytes, 0.0)
        self.error = error

    def done(self) -> bool:
        if self.error is not None:
            raise self.error
        return True

    def wait(self, timeout: float | None = None) -> None:
        self.done()


class FutureHandle(TransferHandle):
    """A transfer run by a transport's worker thread."""

    def __init__(self, future: concurrent.futures.Future, num_units: int, nbytes: int, timeout: float,
                 keepalive: Any = None):
        super().__init__(num_units, nbytes, timeout)
        self.future = future
        self._keepalive = keepalive  # the user's tensor must outlive the transfer

    def done(self) -> bool:
        if not self.future.done():
            return False
        self._result(0)
        return True

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._result(self.timeout if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            raise StoreTimeout(f"transfer of {self.num_units} units not done after {time.monotonic() - self.started:.1f}s") from None

    def _result(self, timeout: float) -> None:
        try:
            self.future.result(timeout)
        except concurrent.futures.CancelledError:  # a store error, as every other failure of a transfer
            raise StoreUnavailable(f"the client was closed before this transfer of {self.num_units} units ran") from None


class Transport(ABC):
    name: str
    timeout: float

    @abstractmethod
    def allocate(self, request_id: str, layout: KVLayout, num_tokens: int) -> RequestInfo: ...

    @abstractmethod
    def extend(self, request_id: str, num_tokens: int) -> RequestInfo: ...

    @abstractmethod
    def describe(self, request_id: str) -> RequestInfo: ...

    @abstractmethod
    def free(self, request_id: str) -> None: ...

    @abstractmethod
    def touch(self, request_ids: list[str]) -> list[str]: ...

    @abstractmethod
    def read(self, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray,
             buffer: torch.Tensor, offsets: np.ndarray) -> TransferHandle:
        """Units (layers[i], heads[i], blocks[i]) -> buffer bytes [offsets[i], offsets[i] + unit_bytes)."""

    @abstractmethod
    def write(self, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray,
              buffer: torch.Tensor, offsets: np.ndarray) -> TransferHandle:
        """buffer bytes [offsets[i], offsets[i] + unit_bytes) -> units; summaries recomputed."""

    @abstractmethod
    def read_summaries(self, request_id: str, first_block: int, num_blocks: int | None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor | QuantizedSummaries:
        """[layers, kv_heads, blocks, 2, head_dim] as dtype (float32 or bfloat16, rounded outward),
        or for uint8 a `QuantizedSummaries` of that shape."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def metrics_text(self) -> str: ...

    def register(self, tensor: torch.Tensor) -> None:
        """Make a buffer usable for transfers (NIXL registers it; others need nothing)."""

    def unregister(self, tensor: torch.Tensor) -> None:
        pass

    def release(self, request_id: str) -> None:
        """This client is done with the request (others may still use it). Only NIXL clients
        hold anything: the block table the store must not reuse memory under."""

    def close(self) -> None:
        pass
