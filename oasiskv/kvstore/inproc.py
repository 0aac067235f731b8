"""In-process transport: the client calls the store directly; data is one memmove per run.

For single-process runs and unit tests. Transfers complete before the call returns.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import InvalidArgument
from .layout import KVLayout
from .store import KVStore, RequestInfo
from .summary import QuantizedSummaries
from .transport import CompletedHandle, TransferHandle, Transport


class InprocTransport(Transport):
    name = "inproc"

    def __init__(self, store: KVStore, timeout: float = 30.0):
        self.store = store
        self.timeout = timeout

    def allocate(self, request_id: str, layout: KVLayout, num_tokens: int) -> RequestInfo:
        return self.store.allocate(request_id, layout, num_tokens)

    def extend(self, request_id: str, num_tokens: int) -> RequestInfo:
        return self.store.extend(request_id, num_tokens)

    def describe(self, request_id: str) -> RequestInfo:  # in process, no table is held
        return self.store.describe(request_id)[0]

    def free(self, request_id: str) -> None:
        self.store.free(request_id)

    def touch(self, request_ids: list[str]) -> list[str]:
        return self.store.touch(request_ids)

    def read(self, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray,
             buffer: torch.Tensor, offsets: np.ndarray) -> TransferHandle:
        _host_only(buffer)
        nbytes = self.store.read_into(request_id, layers, heads, blocks, buffer.data_ptr(), offsets, layout.unit_bytes)
        return CompletedHandle(layers.size, nbytes)

    def write(self, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray,
              buffer: torch.Tensor, offsets: np.ndarray) -> TransferHandle:
        _host_only(buffer)
        nbytes = self.store.write_from(request_id, layers, heads, blocks, buffer.data_ptr(), offsets, layout.unit_bytes)
        return CompletedHandle(layers.size, nbytes)

    def read_summaries(self, request_id: str, first_block: int, num_blocks: int | None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor | QuantizedSummaries:
        return self.store.read_summaries(request_id, first_block, num_blocks, dtype)

    def stats(self) -> dict[str, Any]:
        return {**self.store.stats().to_wire(), "nixl": False}

    def metrics_text(self) -> str:
        return self.store.metrics.text()


def _host_only(buffer: torch.Tensor) -> None:
    if buffer.device.type != "cpu":
        raise InvalidArgument(f"the {buffer.device.type} buffer needs the nixl transport; inproc and tcp copy host memory only")
