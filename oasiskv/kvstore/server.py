"""The store server: a KVStore behind a TCP control/data socket and, optionally, NIXL.

Threads, all daemons: one accepts connections, one per connection serves frames in order, one
expires requests past their TTL, and (with NIXL) one progresses the NIXL agent. A misbehaving
client only ever loses its own connection: every frame is length-checked before it is read, a
frame that stops midway times out, and handler errors go back as error frames.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import uuid
from typing import Any, Callable

import numpy as np
import torch

from .config import KVStoreConfig
from .errors import InvalidArgument, KVStoreError, ProtocolError, RemoteError, StoreUnavailable, UnknownRequest
from .hostmem import byte_view, merge_runs
from .layout import KVLayout
from .protocol import VERSION, ConnectionClosed, FrameTimeout, Payload, recv_frame_header, send_error, send_frame
from .store import KVStore, check_unit_bytes
from .summary import QuantizedSummaries

log = logging.getLogger(__name__)

Reply = tuple[dict[str, Any], list[Any]]
# A NIXL agent's metadata is a few hundred bytes (331 with UCX); a hello that claims more is not
# from a client of ours.
MAX_HELLO_METADATA_BYTES = 4 << 20


# TCP keepalive on clients' connections: one whose host died (a node lost, a pod killed) left a
# half-open connection that held its slot, and its NIXL holds, for ever. ~2 min to notice it.
_KEEPALIVE = {"TCP_KEEPIDLE": 60, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 6}


def _keep_alive(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE.items():
            if hasattr(socket, name):  # Linux names them all; others keep their defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError as exc:  # a peer already gone: its first read says so
        log.debug("keepalive on a new connection: %s", exc)


class _Connection:
    def __init__(self, sock: socket.socket, peer: str):
        _keep_alive(sock)
        self.sock = sock
        self.peer = peer
        self.nixl_peer: str | None = None  # remote NIXL agent name, if the client sent metadata


class KVStoreServer:
    def __init__(self, config: KVStoreConfig | None = None, **overrides: Any):
        if config is None:
            config = KVStoreConfig(**overrides)
        elif overrides:
            config = config.model_copy(update=overrides)
            config = KVStoreConfig.model_validate(config.model_dump())
        self.config = config
        self.store_id = uuid.uuid4().hex[:16]
        self.store = KVStore.from_config(config)
        self.metrics = self.store.metrics
        self.nixl = None  # NixlTarget when NIXL is served
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._connections: set[_Connection] = set()
        self._conn_lock = threading.Lock()
        self._refusals = threading.BoundedSemaphore(16)  # refused connections being told why
        self._threads: list[threading.Thread] = []
        self._metrics_http = None
        self._handlers: dict[str, Callable[[_Connection, dict[str, Any], Payload], Reply | None]] = {
            "hello": self._hello,
            "ping": lambda conn, h, p: ({}, []),
            "allocate": self._allocate,
            "extend": self._extend,
            "describe": self._describe,
            "free": self._free,
            "touch": self._touch,
            "read": self._read,
            "write": self._write,
            "commit": self._commit,
            "report": self._report,
            "summaries": self._summaries,
            "stats": self._stats,
            "metrics": lambda conn, h, p: ({"text": self.metrics.text()}, []),
        }

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> str:
        """Bind, start serving, return the address clients connect to ("host:port")."""
        try:
            return self._start()
        except BaseException:
            # A port in use left the NIXL agent and its poll thread running; at exit the command
            # sometimes aborted ("terminate called without an active exception", rc 134).
            self.stop()
            raise

    def _start(self) -> str:
        if self.config.transport == "nixl":
            from .nixl_agents import NixlTarget, nixl_available

            if nixl_available():
                self.nixl = NixlTarget(self.store, f"oasiskv-store-{self.store_id}", self.config.nixl_poll_interval_s)
            else:
                log.warning("NIXL is not importable; the store serves TCP only")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.config.host, self.config.port))
        listener.listen(128)
        listener.settimeout(0.2)  # lets the accept loop notice stop()
        self._listener = listener
        if self.config.metrics_port is not None:
            self._metrics_http = self.metrics.serve_http(self.config.metrics_port, self.config.host)
        self._spawn(self._accept_loop, "kvstore-accept")
        self._spawn(self._expire_loop, "kvstore-ttl")
        return self.address

    @property
    def port(self) -> int:
        assert self._listener is not None, "server not started"
        return self._listener.getsockname()[1]

    @property
    def address(self) -> str:
        host = self.config.advertise_host or self.config.host
        if host in ("0.0.0.0", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{self.port}"

    @property
    def serves_nixl(self) -> bool:
        return self.nixl is not None

    def metrics_text(self) -> str:
        return self.metrics.text()

    def serve_forever(self) -> None:
        """Block until stop() (from a signal handler or another thread)."""
        while not self._stopping.wait(0.5):
            pass
        self._stopped.wait(10)

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        with self._conn_lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()
        for thread in self._threads:
            thread.join(timeout=5)
        if self.nixl is not None:
            self.nixl.close()
        if self._metrics_http is not None:
            server, _thread = self._metrics_http
            server.shutdown()
            server.server_close()
        self._stopped.set()

    def __enter__(self) -> "KVStoreServer":
        if self._listener is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- loops ---------------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, args=args, daemon=True)
        thread.start()
        if not name.startswith("kvstore-conn"):
            self._threads.append(thread)
        return thread

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):  # the listener was closed
                    break
                # Out of file descriptors or buffers, for now: the thread ended on it, and the store
                # took no connection again while it looked healthy.
                self.metrics.errors.labels("AcceptFailed").inc()
                log.warning("accepting a connection failed (%s); retrying", exc)
                self._stopping.wait(0.1)
                continue
            try:
                with self._conn_lock:
                    if len(self._connections) >= self.config.max_connections:
                        self.metrics.errors.labels("TooManyConnections").inc()
                        self._refuse(sock)
                        continue
                    conn = _Connection(sock, f"{addr[0]}:{addr[1]}")
                    self._connections.add(conn)
                    self.metrics.connections.set(len(self._connections))
                self._spawn(self._serve_connection, f"kvstore-conn-{conn.peer}", conn)
            except Exception:  # no thread to be had, say: this connection is lost, not the store's accepting
                log.exception("serving a new connection failed")
                with self._conn_lock:
                    for lost in [c for c in self._connections if c.sock is sock]:
                        self._connections.discard(lost)
                    self.metrics.connections.set(len(self._connections))
                sock.close()

    def _refuse(self, sock: socket.socket) -> None:
        # Said, not just closed: a bare close read as "Connection reset by peer" on the client.
        if not self._refusals.acquire(blocking=False):  # a flood: no thread each
            sock.close()
            return
        self._spawn(self._send_refusal, "kvstore-conn-refused", sock)

    def _send_refusal(self, sock: socket.socket) -> None:
        error = StoreUnavailable(
            f"store has max_connections={self.config.max_connections} connections open and takes no more; "
            "close idle clients or start the store with a higher max_connections",
            max_connections=self.config.max_connections)
        try:
            sock.settimeout(1.0)
            send_error(sock, error, timeout=1.0)
            sock.shutdown(socket.SHUT_WR)
            # Until the client hangs up: closing with its hello unread resets the connection, and
            # the reset made the client lose the error frame before it read it.
            while sock.recv(4096):
                pass
        except OSError:
            pass
        finally:
            sock.close()
            self._refusals.release()

    def _expire_loop(self) -> None:
        # At least 10 ms: a tiny TTL (1e-6 s) made this loop spin, 30% of a core on an idle store.
        interval = max(0.01, min(1.0, self.config.ttl_s / 4))
        while not self._stopping.wait(interval):
            try:
                expired = self.store.expire()
            except Exception:  # the loop goes on: a store that stops expiring fills up for good
                log.exception("expiring idle requests failed; retrying")
                continue
            if expired:
                log.info("expired %d idle requests", len(expired))

    def _serve_connection(self, conn: _Connection) -> None:
        sock = conn.sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        first = True
        try:
            while not self._stopping.is_set():
                # Idle between frames: wait as long as the client likes, but not before its first
                # frame (a connection that never sent one held a slot of max_connections for good).
                sock.settimeout(self.config.frame_timeout_s if first else None)
                try:
                    header, payload = recv_frame_header(sock, self.config.frame_timeout_s, whole_frame=True)
                except ConnectionClosed:
                    return
                except FrameTimeout:
                    raise
                except TimeoutError:
                    raise FrameTimeout(f"no frame within the frame timeout of {self.config.frame_timeout_s:g} s "
                                       "of connecting") from None
                first = False
                if not self._serve_frame(conn, header, payload):
                    return
        except ProtocolError as exc:
            # Garbage or a frame that stopped midway: the stream cannot be trusted any more.
            self.metrics.errors.labels("ProtocolError").inc()
            log.info("dropping %s: %s", conn.peer, exc.message)
            self._send_last_error(sock, exc)
        except FrameTimeout as exc:
            # A peer that trickles a frame must not keep what the frame pinned (a request's memory).
            self.metrics.errors.labels("FrameTimeout").inc()
            log.info("dropping %s: %s", conn.peer, exc)
            self._send_last_error(sock, ProtocolError(str(exc), frame_timeout_s=self.config.frame_timeout_s))
        except OSError as exc:  # reset, timeout mid-frame, or our own stop()
            if not self._stopping.is_set():
                self.metrics.errors.labels("ConnectionLost").inc()
                log.info("connection %s lost: %s", conn.peer, exc)
        finally:
            self._close_connection(conn)

    def _serve_frame(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> bool:
        """Handle one request frame; False ends the connection."""
        seq = header.get("seq")
        try:
            handler = self._handlers.get(str(header.get("op")))
            if handler is None:
                raise InvalidArgument(f"unknown op {header.get('op')!r}")
            reply = handler(conn, header, payload)
            payload.drain()
            if reply is not None:
                reply_header, reply_payloads = reply
                send_frame(conn.sock, {"ok": True, "seq": seq, **reply_header}, reply_payloads,
                           timeout=self.config.frame_timeout_s)
        except ProtocolError:
            raise
        except KVStoreError as exc:
            if not _counted(exc):
                self.metrics.errors.labels(type(exc).__name__).inc()
            payload.drain()
            send_error(conn.sock, exc, seq, self.config.frame_timeout_s)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            self.metrics.errors.labels("InvalidArgument").inc()
            payload.drain()
            send_error(conn.sock, InvalidArgument(f"malformed {header.get('op')!r} request: {exc!r}"), seq,
                       self.config.frame_timeout_s)
        except OSError:
            raise
        except Exception as exc:  # a bug here must not take the store down
            log.exception("error serving %s", header.get("op"))
            self.metrics.errors.labels("RemoteError").inc()
            payload.drain()
            send_error(conn.sock, RemoteError(f"{type(exc).__name__}: {exc}"), seq, self.config.frame_timeout_s)
        return True

    def _send_last_error(self, sock: socket.socket, error: KVStoreError) -> None:
        try:
            # Bounded: the peer may not be reading at all.
            send_error(sock, error, timeout=min(1.0, self.config.frame_timeout_s))
        except OSError:
            pass

    def _close_connection(self, conn: _Connection) -> None:
        with self._conn_lock:
            self._connections.discard(conn)
            self.metrics.connections.set(len(self._connections))
        if conn.nixl_peer is not None and self.nixl is not None:
            peer = conn.nixl_peer
            self.nixl.remove_peer(peer, on_last=lambda: self.store.holder_gone(peer))
        try:
            conn.sock.close()
        except OSError:
            pass

    # --- handlers ------------------------------------------------------------------------

    def _hello(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        if header.get("version") != VERSION:
            raise InvalidArgument(f"protocol version {header.get('version')} not supported (store speaks {VERSION})")
        reply: dict[str, Any] = {
            "store_id": self.store_id,
            "version": VERSION,
            "capacity_bytes": self.store.capacity_bytes,
            "block_size": self.store.block_size,
            "ttl_s": self.store.ttl_s,
            "nixl": None,
        }
        payloads: list[Any] = []
        wants_nixl = bool(header.get("nixl"))
        if wants_nixl and self.nixl is not None:
            if payload.remaining > MAX_HELLO_METADATA_BYTES:
                raise ProtocolError(f"hello carries {payload.remaining} bytes of NIXL metadata, more than "
                                    f"{MAX_HELLO_METADATA_BYTES}")
            metadata = payload.read_bytes(payload.remaining)
            if metadata:
                if conn.nixl_peer is not None:  # a hello again on this connection: its peer counts once
                    earlier = conn.nixl_peer
                    conn.nixl_peer = None
                    self.nixl.remove_peer(earlier, on_last=lambda: self.store.holder_gone(earlier))
                conn.nixl_peer = self.nixl.add_peer(bytes(metadata))
                # A client forgets every block table before it says hello (again), but for those of
                # requests it still has transfers running on: it releases them when they end.
                self.store.release_holds(conn.nixl_peer, everything=True,
                                         keep=_strs(header, "keep"))
            reply["nixl"] = {
                "agent": self.nixl.name,
                "arena_base": self.store.base,
                "arena_bytes": self.store.capacity_bytes,
            }
            payloads = [self.nixl.metadata]
        return reply, payloads

    def _allocate(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        layout = header.get("layout")
        if not isinstance(layout, dict):
            raise InvalidArgument(f"'layout' must be an object, got {layout!r}", field="layout")
        info = self.store.allocate(_str(header, "rid"), KVLayout.from_wire(layout), _int(header, "num_tokens"))
        return {"info": info.to_wire()}, []

    def _extend(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        info = self.store.extend(_str(header, "rid"), _int(header, "num_tokens"))
        return {"info": info.to_wire()}, []

    def _describe(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        info, table = self.store.describe(_str(header, "rid"), conn.nixl_peer if header.get("hold") else None)
        return {"info": info.to_wire()}, [table.astype("<i8").tobytes()]

    def _free(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        # "forgotten": a NIXL client that frees a request it no longer touches needs no notice.
        self.store.free(_str(header, "rid"), conn.nixl_peer if header.get("forgotten") else None)
        return {}, []

    def _touch(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        return {"unknown": self.store.touch(_strs(header, "rids", required=True))}, []

    def _stats(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        stats = self.store.stats()
        return {"stats": {**stats.to_wire(), "store_id": self.store_id, "nixl": self.serves_nixl}}, []

    def _read(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> None:
        n = _count(header)
        layers, heads, blocks = payload.read_indices(n)
        with self.store.pinned(_str(header, "rid")) as request:
            check_unit_bytes(request, _int(header, "unit_bytes", None))
            _, _, _, offsets = self.store.unit_offsets(request, layers, heads, blocks)
            unit = request.layout.unit_bytes
            addresses, lengths = self.store.arena_runs(offsets, unit)
            # Sent straight from the arena while the request is pinned: no staging copy. A reader that
            # stops reading holds the pin for frame_timeout_s at most.
            views = [byte_view(a, l) for a, l in zip(addresses.tolist(), lengths.tolist())]
            send_frame(conn.sock, {"ok": True, "seq": header.get("seq"), "nbytes": n * unit}, views,
                       timeout=self.config.frame_timeout_s)
        self.store.record_read(n, n * unit, "tcp")
        return None

    def _write(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        n = _count(header)
        layers, heads, blocks = payload.read_indices(n)
        with self.store.pinned(_str(header, "rid")) as request:
            check_unit_bytes(request, _int(header, "unit_bytes", None))
            layers, heads, blocks, offsets = self.store.unit_offsets(request, layers, heads, blocks)
            unit = request.layout.unit_bytes
            if payload.remaining != n * unit:
                raise InvalidArgument(f"write of {n} units needs {n * unit} data bytes, frame has {payload.remaining}")
            # Received straight into the arena; duplicates would land twice, harmlessly.
            starts, _, lengths = merge_runs(offsets, np.arange(n, dtype=np.int64) * unit, unit)
            try:
                for start, length in zip((starts + self.store.base).tolist(), lengths.tolist()):
                    payload.read_into(byte_view(start, length))
            finally:  # a frame cut off midway changed some of the keys: their summaries must still bound them
                self.store.summarize(request, layers, heads, blocks)
        self.store.record_write(n, n * unit, "tcp")
        return {}, []

    def _commit(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        """After a client's NIXL WRITE landed: summarize the units and count them."""
        n = _count(header)
        layers, heads, blocks = payload.read_indices(n)
        serial = _int(header, "serial", None)
        with self.store.pinned(_str(header, "rid")) as request:
            if serial not in (None, request.serial):
                raise UnknownRequest(
                    f"request {request.request_id!r} was freed and allocated again: this write went to the freed "
                    "allocation (the writer's block table predates the new one)", request_id=request.request_id)
            layers, heads, blocks, _ = self.store.unit_offsets(request, layers, heads, blocks)
            self.store.summarize(request, layers, heads, blocks)
            unit = request.layout.unit_bytes
        self.store.record_write(n, n * unit, "nixl")
        return {}, []

    def _report(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        """A NIXL client's tally of one-sided reads (counted; the requests' TTL refreshed) and the
        block tables it dropped: those of freed allocations (serials) and of requests it is done with."""
        reads = header.get("reads") or {}
        if not isinstance(reads, dict) or not all(
                isinstance(v, list) and len(v) == 2 and all(_is_int(x) and x >= 0 for x in v) for v in reads.values()):
            raise InvalidArgument(f"'reads' must map request ids to [units, bytes], got {reads!r}"[:300], field="reads")
        released = header.get("released") or []
        if not isinstance(released, list) or not all(_is_int(x) for x in released):
            raise InvalidArgument(f"'released' must be a list of serials, got {released!r}"[:300], field="released")
        for units, nbytes in reads.values():
            self.store.record_read(units, nbytes, "nixl")
        self.store.touch(list(reads))
        if conn.nixl_peer is not None:
            self.store.release_holds(conn.nixl_peer, released, _strs(header, "done"), bool(header.get("closing")))
        return {}, []

    def _summaries(self, conn: _Connection, header: dict[str, Any], payload: Payload) -> Reply:
        dtype = header.get("dtype", "float32")
        if not isinstance(dtype, str):
            raise InvalidArgument(f"'dtype' must be a string, got {dtype!r}", field="dtype")
        summaries = self.store.read_summaries(
            _str(header, "rid"), _int(header, "first_block", 0), _int(header, "num_blocks", None), dtype)
        if isinstance(summaries, QuantizedSummaries):  # the codes, then their offsets and steps
            return {"shape": list(summaries.shape), "quantized": True}, [
                summaries.codes.reshape(-1).numpy(), summaries.offset.reshape(-1).numpy(),
                summaries.step.reshape(-1).numpy()]
        # numpy has no bfloat16, so the bytes go out as uint8.
        return {"shape": list(summaries.shape)}, [summaries.reshape(-1).view(torch.uint8).numpy()]


def _count(header: dict[str, Any]) -> int:
    n = _int(header, "n")
    if n < 0 or n > (1 << 31) - 1:
        raise InvalidArgument(f"bad unit count {n}")
    return n


# Header fields are checked by type here, not coerced: int() took 1.9 as 1, true as 1 and
# Infinity as an OverflowError (an internal error with a traceback); str() took {"x": 1} as an
# id; and a string of rids was touched letter by letter.
_REQUIRED: Any = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _present(header: dict[str, Any], name: str, default: Any) -> Any:
    value = header.get(name, default)
    if value is _REQUIRED:
        raise InvalidArgument(f"{header.get('op')!r} request has no {name!r}", field=name)
    return value


def _int(header: dict[str, Any], name: str, default: Any = _REQUIRED) -> Any:
    value = _present(header, name, default)
    if value is not default and not _is_int(value):
        raise InvalidArgument(f"{name!r} must be an integer, got {value!r}"[:300], field=name)
    return value


def _str(header: dict[str, Any], name: str) -> str:
    value = _present(header, name, _REQUIRED)
    if not isinstance(value, str):
        raise InvalidArgument(f"{name!r} must be a string, got {value!r}"[:300], field=name)
    return value


def _strs(header: dict[str, Any], name: str, required: bool = False) -> list[str]:
    value = _present(header, name, _REQUIRED if required else None)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{name!r} must be a list of strings, got {value!r}"[:300], field=name)
    return value


def _counted(exc: KVStoreError) -> bool:
    # Marked by the store when it counted the error itself (the type alone does not say: the
    # server raises an UnknownRequest of its own for a stale commit).
    return bool(exc.__dict__.get("counted"))
