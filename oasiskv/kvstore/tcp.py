"""TCP transport: every call is one request frame and one reply frame on a single socket.

A worker thread owns the socket, so calls run in submission order and data transfers return
a handle at once. Read data is received straight into the destination buffer and write data
sent straight from the source buffer (no staging copies).

Failure handling: every socket operation has the client's timeout; a timeout, reset or
truncated reply drops the connection (its stream can no longer be trusted) and raises
StoreTimeout / StoreUnavailable. The next call reconnects; if the store answering is a
different process (its store_id changed: it was restarted), cached request state is dropped
and calls about old requests fail with UnknownRequest.
"""

from __future__ import annotations

import concurrent.futures
import socket
import uuid
from typing import Any, Callable

import numpy as np
import torch

from .errors import InvalidArgument, KVStoreError, ProtocolError, StoreTimeout, StoreUnavailable
from .hostmem import byte_view, merge_runs
from .inproc import _host_only
from .layout import KVLayout
from .protocol import VERSION, ConnectionClosed, Payload, index_payload, recv_frame_header, send_frame
from .store import RequestInfo
from .summary import QuantizedSummaries, summary_read_dtype
from .transport import FutureHandle, TransferHandle, Transport

Land = Callable[[dict[str, Any], Payload], Any]
_IDEMPOTENT = frozenset({"ping", "describe", "stats", "metrics", "touch", "summaries", "read"})


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(address, tuple):
        host, port = str(address[0]), int(address[1])
    else:
        host, sep, digits = str(address).rpartition(":")
        if not sep or not digits.isdigit():
            raise InvalidArgument(f"store address must be 'host:port', got {address!r}")
        host, port = host or "127.0.0.1", int(digits)
    if not 0 < port <= 65535:  # the socket layer takes the port modulo 2**16: 99999 reached 34463
        raise InvalidArgument(f"store port must be in [1, 65535], got {port} in {address!r}")
    return host, port


def _read_all(reply: dict[str, Any], payload: Payload) -> tuple[dict[str, Any], bytes]:
    return reply, bytes(payload.read_bytes(payload.remaining))


def described(reply: dict[str, Any], data: bytes) -> tuple[RequestInfo, np.ndarray]:
    """A describe reply: the request's info and its block table."""
    return RequestInfo.from_wire(reply["info"]), np.frombuffer(data, dtype="<i8").astype(np.int64)


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, address: str | tuple[str, int], timeout: float = 30.0, client_name: str | None = None):
        self.host, self.port = parse_address(address)
        self.address = f"{self.host}:{self.port}"
        self.timeout = timeout
        self.client_name = client_name or f"oasiskv-client-{uuid.uuid4().hex[:12]}"
        self.store_id: str | None = None
        self.hello: dict[str, Any] = {}
        # Called (on the worker thread) when a reconnect finds a different store process.
        self.restart_listeners: list[Callable[[], None]] = []
        self._sock: socket.socket | None = None
        self._seq = 0
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-tcp")
        self._call({"op": "ping"})  # connect now: a wrong address fails here, not mid-request

    # --- control plane -------------------------------------------------------------------

    def allocate(self, request_id: str, layout: KVLayout, num_tokens: int) -> RequestInfo:
        reply, _ = self._call({"op": "allocate", "rid": request_id, "layout": layout.to_wire(), "num_tokens": int(num_tokens)})
        return RequestInfo.from_wire(reply["info"])

    def extend(self, request_id: str, num_tokens: int) -> RequestInfo:
        reply, _ = self._call({"op": "extend", "rid": request_id, "num_tokens": int(num_tokens)})
        return RequestInfo.from_wire(reply["info"])

    def describe(self, request_id: str) -> RequestInfo:
        return self.describe_table(request_id)[0]

    def describe_table(self, request_id: str) -> tuple[RequestInfo, np.ndarray]:
        return described(*self._call({"op": "describe", "rid": request_id}))

    def free(self, request_id: str) -> None:
        self._call({"op": "free", "rid": request_id})

    def touch(self, request_ids: list[str]) -> list[str]:
        reply, _ = self._call({"op": "touch", "rids": list(request_ids)})
        return list(reply["unknown"])

    def stats(self) -> dict[str, Any]:
        return self._call({"op": "stats"})[0]["stats"]

    def metrics_text(self) -> str:
        return self._call({"op": "metrics"})[0]["text"]

    def read_summaries(self, request_id: str, first_block: int, num_blocks: int | None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor | QuantizedSummaries:
        dtype = summary_read_dtype(dtype)

        def land(reply: dict[str, Any], payload: Payload) -> torch.Tensor | QuantizedSummaries:
            shape = [int(d) for d in reply["shape"]]
            parts = [torch.empty(shape, dtype=dtype)]
            if dtype == torch.uint8:  # the codes' per-channel offsets and steps follow them
                ranges = shape[:2] + shape[3:]
                parts += [torch.empty(ranges, dtype=torch.float32), torch.empty(ranges, dtype=torch.float32)]
            nbytes = sum(t.nbytes for t in parts)
            if payload.remaining != nbytes:
                raise ProtocolError(f"summary reply has {payload.remaining} bytes for {dtype} shape {reply['shape']}")
            for t in parts:
                payload.read_into(byte_view(t.data_ptr(), t.nbytes))
            return QuantizedSummaries(*parts) if dtype == torch.uint8 else parts[0]

        header = {"op": "summaries", "rid": request_id, "first_block": int(first_block), "num_blocks": num_blocks,
                  "dtype": str(dtype).removeprefix("torch.")}
        return self._call(header, land=land)

    # --- data plane ----------------------------------------------------------------------

    def read(self, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray,
             buffer: torch.Tensor, offsets: np.ndarray) -> TransferHandle:
        _host_only(buffer)
        n, unit = layers.size, layout.unit_bytes
        _, dst_starts, lengths = merge_runs(np.arange(n, dtype=np.int64) * unit, offsets, unit)
        dst_starts = dst_starts + buffer.data_ptr()

        def land(reply: dict[str, Any], payload: Payload) -> None:
            if payload.remaining != n * unit:
                raise ProtocolError(f"read reply carries {payload.remaining} bytes, expected {n * unit}")
            for start, length in zip(dst_starts.tolist(), lengths.tolist()):
                payload.read_into(byte_view(start, length))

        header = {"op": "read", "rid": request_id, "n": n, "unit_bytes": unit}
        future = self._submit(header, [index_payload(layers, heads, blocks)], land)
        return FutureHandle(future, n, n * unit, self.timeout, keepalive=buffer)

    def write(self, request_id: str, layout: KVLayout, layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray,
              buffer: torch.Tensor, offsets: np.ndarray) -> TransferHandle:
        _host_only(buffer)
        n, unit = layers.size, layout.unit_bytes
        src_starts, _, lengths = merge_runs(offsets, np.arange(n, dtype=np.int64) * unit, unit)
        base = buffer.data_ptr()
        views = [byte_view(base + s, l) for s, l in zip(src_starts.tolist(), lengths.tolist())]
        header = {"op": "write", "rid": request_id, "n": n, "unit_bytes": unit}
        future = self._submit(header, [index_payload(layers, heads, blocks), *views], None)
        return FutureHandle(future, n, n * unit, self.timeout, keepalive=buffer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The worker is gone after this, so the socket is ours to close here. A _drop queued
        # behind pending transfers was cancelled with them, leaving the socket open until GC.
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._drop()

    # --- plumbing ------------------------------------------------------------------------

    def _call(self, header: dict[str, Any], payloads: list[Any] = (), land: Land | None = _read_all) -> Any:
        return self._answer(self._submit(header, payloads, land), header["op"])

    def _answer(self, future: concurrent.futures.Future, op: str) -> Any:
        try:
            # Socket timeouts bound each step of the call; this bounds a call queued behind others.
            return future.result(2 * self.timeout)
        except concurrent.futures.TimeoutError:
            raise StoreTimeout(f"store at {self.address} did not answer {op!r} within {2 * self.timeout:.0f}s") from None

    def _submit(self, header: dict[str, Any], payloads: list[Any], land: Land | None) -> concurrent.futures.Future:
        if self._closed:
            raise StoreUnavailable("client is closed")
        try:
            return self._executor.submit(self._rpc, header, list(payloads), land)
        except RuntimeError:  # executor shut down
            raise StoreUnavailable("client is closed") from None

    def _rpc(self, header: dict[str, Any], payloads: list[Any], land: Land | None) -> Any:
        op = header.get("op")
        for attempt in (0, 1):
            reused = self._sock is not None
            try:
                if self._sock is None:
                    self._connect()
                return self._exchange(header, payloads, land)
            except KVStoreError as exc:
                if isinstance(exc, ProtocolError) and not getattr(exc, "from_store", False):
                    self._drop()
                    raise StoreUnavailable(f"store at {self.address}: {exc.message} (during {op!r})", address=self.address) from None
                raise
            except TimeoutError:
                self._drop()
                raise StoreTimeout(f"store at {self.address} did not answer {op!r} within {self.timeout:.1f}s", address=self.address) from None
            except (OSError, ConnectionClosed) as exc:
                self._drop()
                # A connection that died while idle (store restarted) is retried once on a fresh
                # one for calls that are safe to repeat, so the caller sees the real answer.
                if attempt == 0 and reused and op in _IDEMPOTENT:
                    continue
                reason = "closed the connection (stopped or restarted?)" if isinstance(exc, ConnectionClosed) else str(exc)
                raise StoreUnavailable(f"store at {self.address} {reason} during {op!r}", address=self.address) from None
        raise AssertionError("unreachable")

    def _exchange(self, header: dict[str, Any], payloads: list[Any], land: Land | None) -> Any:
        sock = self._sock
        assert sock is not None
        self._seq += 1
        send_frame(sock, {**header, "seq": self._seq}, payloads)
        reply, payload = recv_frame_header(sock, self.timeout)
        if reply.get("seq") not in (None, self._seq):
            raise ProtocolError(f"reply to request {reply.get('seq')} while waiting for {self._seq}")
        if not reply.get("ok"):
            error = KVStoreError.from_wire(reply.get("error") or {})
            error.from_store = True
            if isinstance(error, ProtocolError):
                self._drop()  # the store hangs up after a frame it could not parse
            else:
                payload.drain()
            raise error
        try:
            result = land(reply, payload) if land is not None else None
            payload.drain()
        except BaseException:
            self._drop()  # stopped mid-payload: the stream is out of step
            raise
        return result

    def _connect(self) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise StoreUnavailable(f"cannot connect to store at {self.address}: {exc}", address=self.address) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        self._sock = sock
        header, payloads = self._hello_request()
        try:
            reply, data = self._exchange(header, payloads, _read_all)
        except BaseException:
            self._drop()
            raise
        restarted = self.store_id is not None and reply["store_id"] != self.store_id
        self.store_id = reply["store_id"]
        self.hello = reply
        self._on_hello(reply, data)
        if restarted:
            for listener in list(self.restart_listeners):
                listener()

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    # Hooks for the NIXL transport, which piggybacks its agent metadata on the handshake.
    def _hello_request(self) -> tuple[dict[str, Any], list[Any]]:
        return {"op": "hello", "version": VERSION, "client": self.client_name}, []

    def _on_hello(self, reply: dict[str, Any], data: bytes) -> None:
        pass
