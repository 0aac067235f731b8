"""Wire format shared by the TCP and NIXL transports (control plane; data too for TCP).

One frame:

    prefix   16 bytes   b"OKV1", u32 header length, u64 payload length (big-endian)
    header   JSON object, UTF-8 ("op" on requests, "ok" on replies, "error" on failures)
    payload  raw bytes: index arrays (little-endian int32) and KV / summary data

No pickle: a peer can only make the other side parse JSON and copy bytes into ranges it has
already validated. Lengths are checked before anything is read, a frame that stops midway is a
ProtocolError (the connection is dropped), and errors travel as {"ok": false, "error": {...}}
and are re-raised as the same KVStoreError subclass on the other side.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any, Sequence

import numpy as np

from .errors import BlockOutOfRange, KVStoreError, ProtocolError

MAGIC = b"OKV1"
PREFIX = struct.Struct("!4sIQ")
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 40
# Buffers for payloads that are not received in place start at most this big and grow as the
# bytes arrive: a frame that only claims a big payload must not make the receiver commit it.
RECV_CHUNK_BYTES = 1 << 20
VERSION = 2


class ConnectionClosed(Exception):
    """The peer closed the connection between frames (a normal end, not an error)."""


class FrameTimeout(TimeoutError):
    """A frame was not complete by its deadline."""


class Deadline:
    """The time by which a whole frame must be through the socket.

    A timeout per recv let a peer that sent one byte every 10 s keep a 30 s frame open forever,
    and with it the request it pinned. Each blocking call now waits at most for the time left.
    The socket's timeout is set again only when it could overshoot the deadline by more than
    `slack` (settimeout is a syscall, and a write lands in the arena run by run)."""

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock = sock
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self._slack = min(1.0, seconds / 10)
        self._armed_at = -float("inf")

    def arm(self, what: str) -> None:
        now = time.monotonic()
        left = self.at - now
        if left <= 0:
            raise FrameTimeout(f"{what} not complete within the frame timeout of {self.seconds:g} s")
        if now - self._armed_at >= self._slack:
            self.sock.settimeout(left)
            self._armed_at = now


def encode_header(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def send_frame(sock: socket.socket, header: dict[str, Any], payloads: Sequence[Any] = (),
               timeout: float | None = None) -> None:
    """timeout: for the whole frame (else the socket's own, per send call)."""
    views = [memoryview(p).cast("B") for p in payloads]
    head = encode_header(header)
    total = sum(v.nbytes for v in views)
    deadline = None if timeout is None else Deadline(sock, timeout)
    send_views(sock, [memoryview(PREFIX.pack(MAGIC, len(head), total) + head)] + views, deadline)


_IOV_BATCH = 512  # below IOV_MAX (1024) on Linux


def send_views(sock: socket.socket, views: list[memoryview], deadline: Deadline | None = None) -> None:
    """sendall for many buffers: gathered sendmsg calls instead of one syscall per buffer."""
    views = [v for v in views if v.nbytes]
    i = 0
    try:
        while i < len(views):
            batch = views[i:i + _IOV_BATCH]
            if deadline is not None:
                deadline.arm("sending a frame")
            sent = sock.sendmsg(batch)
            # Partial send: skip the fully sent buffers, finish the cut one with sendall.
            for view in batch:
                if sent >= view.nbytes:
                    sent -= view.nbytes
                    i += 1
                    continue
                if deadline is not None:
                    deadline.arm("sending a frame")
                sock.sendall(view[sent:])
                i += 1
                break
    except FrameTimeout:
        raise
    except TimeoutError:
        if deadline is None:
            raise
        raise FrameTimeout(f"sending a frame not complete within the frame timeout of {deadline.seconds:g} s "
                           "(the peer does not read)") from None


def send_error(sock: socket.socket, error: KVStoreError, request_seq: int | None = None,
               timeout: float | None = None) -> None:
    header: dict[str, Any] = {"ok": False, "error": error.to_wire()}
    if request_seq is not None:
        header["seq"] = request_seq
    send_frame(sock, header, timeout=timeout)


def recv_into(sock: socket.socket, view: memoryview, what: str = "frame", deadline: Deadline | None = None) -> None:
    """Fill view completely; a peer that stops early makes a ProtocolError, one that is not done
    by the deadline a FrameTimeout."""
    got = 0
    total = view.nbytes
    while got < total:
        if deadline is None:
            n = sock.recv_into(view[got:], total - got)
        else:
            deadline.arm(what)
            try:
                n = sock.recv_into(view[got:], total - got)
            except FrameTimeout:
                raise
            except TimeoutError:
                raise FrameTimeout(f"{what} not complete within the frame timeout of {deadline.seconds:g} s") from None
        if n == 0:
            raise ProtocolError(f"truncated {what}: connection closed after {got} of {total} bytes", received=got, expected=total)
        got += n


class Payload:
    """The payload of one received frame, consumed in order."""

    def __init__(self, sock: socket.socket, length: int, deadline: Deadline | None = None):
        self.sock = sock
        self.length = length
        self.remaining = length
        self.deadline = deadline
        self._what = f"payload of {length} bytes"

    def read_bytes(self, n: int) -> bytearray:
        self._take(n)
        # Grown geometrically as data arrives (a bytearray(n) up front let a 16-byte frame that
        # claimed 1 GiB add 1 GiB to the store's RSS), so at most about twice what was received.
        buf = bytearray(min(n, RECV_CHUNK_BYTES))
        got = 0
        while True:
            try:
                recv_into(self.sock, memoryview(buf)[got:], self._what, self.deadline)
            except ProtocolError as exc:
                received = got + int(exc.fields.get("received", 0))
                raise ProtocolError(f"truncated payload: connection closed after {received} of {n} bytes",
                                    received=received, expected=n) from None
            got = len(buf)
            if got == n:
                return buf
            buf += bytes(min(n - got, got))

    def read_into(self, view: memoryview) -> None:
        self._take(view.nbytes)
        recv_into(self.sock, view, self._what, self.deadline)

    def read_indices(self, n: int, count: int = 3) -> list[np.ndarray]:
        """`count` little-endian int32 arrays of length n."""
        raw = self.read_bytes(4 * n * count)
        data = np.frombuffer(raw, dtype="<i4").astype(np.int64)
        return [data[i * n:(i + 1) * n] for i in range(count)]

    def drain(self) -> None:
        """Discard what is left (keeps the stream in step after a refused request)."""
        scratch = bytearray(min(self.remaining, 1 << 20) or 1)
        while self.remaining:
            n = min(self.remaining, len(scratch))
            self.remaining -= n
            recv_into(self.sock, memoryview(scratch)[:n], self._what, self.deadline)

    def _take(self, n: int) -> None:
        if n > self.remaining:
            raise ProtocolError(f"payload too short: need {n} more bytes, frame has {self.remaining}")
        self.remaining -= n


def recv_frame_header(sock: socket.socket, frame_timeout: float | None,
                      whole_frame: bool = False) -> tuple[dict[str, Any], Payload]:
    """Read prefix + header. Waits indefinitely (or the socket's timeout) for the first byte,
    then at most frame_timeout for the rest of the header, per recv call; with whole_frame, the
    rest of the frame (payload included) must arrive within frame_timeout of its first byte."""
    prefix = bytearray(PREFIX.size)
    first = sock.recv_into(prefix, PREFIX.size)
    if first == 0:
        raise ConnectionClosed()
    saved_timeout = sock.gettimeout()
    deadline = None
    if frame_timeout is not None:
        sock.settimeout(frame_timeout)
        if whole_frame:
            deadline = Deadline(sock, frame_timeout)
    try:
        if first < PREFIX.size:
            recv_into(sock, memoryview(prefix)[first:], "frame prefix", deadline)
        magic, header_len, payload_len = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r} (not an OasisKV peer?)")
        if header_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
            raise ProtocolError(f"oversized frame: header {header_len} B, payload {payload_len} B")
        raw = bytearray(header_len)
        recv_into(sock, memoryview(raw), "frame header", deadline)
        try:
            header = json.loads(raw)
        except ValueError as exc:  # not JSON, not UTF-8, or an integer past Python's 4,300 digits
            raise ProtocolError(f"frame header is not JSON: {exc}") from None
        except RecursionError:  # it escaped as no error frame at all, and ended the connection's thread
            raise ProtocolError("frame header is JSON nested too deeply") from None
        if not isinstance(header, dict):
            raise ProtocolError("frame header must be a JSON object")
    except BaseException:
        sock.settimeout(saved_timeout)
        raise
    # The payload that follows is read under frame_timeout too; the caller restores the idle
    # timeout once the whole frame is consumed.
    return header, Payload(sock, payload_len, deadline)


def index_payload(layers: np.ndarray, heads: np.ndarray, blocks: np.ndarray) -> bytes:
    """Unit indices as one little-endian int32 buffer (the inverse of Payload.read_indices)."""
    for name, array in (("layer", layers), ("kv_head", heads), ("block", blocks)):
        # Narrowing to int32 must not wrap a huge index onto a valid one.
        wide = (array < -(1 << 31)) | (array >= (1 << 31))
        if wide.any():
            first = int(array[np.argmax(wide)])
            raise BlockOutOfRange(f"{name} index {first} out of range", index_kind=name, index=first)
    return np.concatenate((layers, heads, blocks)).astype("<i4").tobytes()
