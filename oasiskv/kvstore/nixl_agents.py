"""NIXL agents: the store's target (exposes the arena) and a client's initiator.

The store registers its whole arena once. A client learns the store's agent metadata, arena
base address and, per request, the block table (over the TCP control plane), then computes
the remote address of every unit itself and moves a whole batch with one NIXL READ/WRITE.

Measured facts this relies on (nixl-cu12 1.5.1 on CPU, host memory):
- The target side must be progressed or READs never complete. NIXL's progress thread
  busy-polls a core, which halved read bandwidth on a 2-core machine, so the store instead
  polls its agent every millisecond.
- Between processes UCX picks `cma` (process_vm_readv): a zero-copy kernel copy, done by the
  initiator inside transfer() once connected (the handle is usually DONE on return).
- A transfer that carries a notification is not complete until the *target* next progresses
  (single-unit reads took 1.1 ms instead of 64 us), so data transfers carry none. The client
  instead reports what it read (units, bytes per request) every ~second over the control
  plane; the store counts it and refreshes those requests' TTL.
- When a request is freed or expires the store notifies every connected client
  ("F<serial>:<request id>") so it drops the cached block table; the client then says so
  (with the serial), and only then may the memory be reused (store.py: holds).
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np
import torch

from .errors import InvalidArgument, TransferError
from .store import KVStore

log = logging.getLogger(__name__)

# Objects whose daemon threads call into NIXL on their own (`stop_polling`), stopped before the
# interpreter finalizes: a thread inside a NIXL call then (the binding lets go of the GIL) cannot
# take the GIL back, and pybind11 aborted the process as Python ended the thread (a CI run whose
# tests had all passed ended with SIGABRT).
_POLLERS: weakref.WeakSet = weakref.WeakSet()


def stop_polling_at_exit(poller) -> None:
    _POLLERS.add(poller)


@atexit.register
def _stop_pollers() -> None:
    for poller in list(_POLLERS):
        try:
            poller.stop_polling(wait_s=2.0)
        except Exception as exc:  # exiting: nothing else to do about it
            log.debug("stopping %r at exit: %s", poller, exc)


def nixl_available() -> bool:
    try:
        return importlib.util.find_spec("nixl") is not None and _import_nixl() is not None
    except Exception:
        return False


def _import_nixl():
    from nixl._api import nixl_agent, nixl_agent_config

    if "NIXL_LOG_LEVEL" not in os.environ:
        # NIXL logs every agent creation at INFO to *stdout*, which would mix into the
        # output of our commands (the store's READY line); keep its warnings and errors.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def nixl_errors() -> tuple[type[BaseException], ...]:
    """NIXL's exception classes (they share no base class besides Exception)."""
    from nixl import _bindings

    return tuple(
        value for name, value in vars(_bindings).items()
        if name.startswith("nixl") and name.endswith("Error") and isinstance(value, type)
    )


def make_agent(name: str):
    nixl_agent, nixl_agent_config = _import_nixl()
    # No progress thread: whoever waits on a transfer progresses it (see module docstring).
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def release_notice(request_id: str, serial: int) -> bytes:
    return b"F%d:%s" % (serial, request_id.encode())


def parse_release_notice(message: bytes) -> tuple[int, str] | None:
    if not message.startswith(b"F"):
        return None
    serial, sep, request_id = message[1:].partition(b":")
    if not sep or not serial.isdigit():
        return None
    return int(serial), request_id.decode()


class NixlTarget:
    """Store side: owns the agent that exposes the arena."""

    def __init__(self, store: KVStore, name: str, poll_interval_s: float):
        self.store = store
        self.name = name
        self.agent = make_agent(name)
        self.lock = threading.Lock()  # agent calls are not thread-safe in the default sync mode
        self.registration = self.agent.register_memory(store.arena)
        self.metadata: bytes = self.agent.get_agent_metadata()
        self.peers: dict[str, int] = {}  # client agent name -> open connections using it
        # Free notices are sent by the poll thread, so free() never waits on the network.
        self._released: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._poll_interval = poll_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="kvstore-nixl", daemon=True)
        self._thread.start()
        stop_polling_at_exit(self)
        store.release_listeners.append(self._on_release)

    def add_peer(self, metadata: bytes) -> str:
        """Load a client agent's metadata (so free notices reach it); one count per connection."""
        with self.lock:
            try:
                name = self.agent.add_remote_agent(metadata)  # loading a known agent again is fine
            except nixl_errors() as exc:
                if "NOT_ALLOWED" not in str(exc):
                    raise InvalidArgument(f"the NIXL agent metadata in this hello cannot be loaded: {exc}") from None
                # Another agent already has this name: the holds and free notices of the two
                # clients could not be told apart.
                raise InvalidArgument(
                    "a NIXL client with this name is already connected to this store; give each client "
                    "its own name (connect(..., name=...)) or leave it unset"
                ) from None
            name = name.decode() if isinstance(name, bytes) else name
            self.peers[name] = self.peers.get(name, 0) + 1
            return name

    def remove_peer(self, name: str, on_last: Callable[[], None] | None = None) -> None:
        """One connection of this client closed; `on_last` runs, under the lock, if it was its
        last: a hello of the same client (add_peer) cannot slip in between."""
        with self.lock:
            count = self.peers.get(name, 0) - 1
            if count > 0:
                self.peers[name] = count
                return
            self.peers.pop(name, None)
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:
                log.debug("remove_remote_agent(%s): %s", name, exc)
            if on_last is not None:
                on_last()

    def stop_polling(self, wait_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout=wait_s)

    def close(self) -> None:
        self.stop_polling()
        try:
            self.store.release_listeners.remove(self._on_release)
        except ValueError:
            pass
        with self.lock:
            try:
                self.agent.deregister_memory(self.registration)
            except Exception as exc:
                log.debug("deregister_memory: %s", exc)

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._poll_interval):
            try:
                self._send_release_notices()
                with self.lock:
                    self.agent.get_new_notifs()  # progresses the agent; clients send no notices
            except Exception:
                log.exception("NIXL progress failed")
                self.store.metrics.errors.labels("NixlProgress").inc()
                time.sleep(0.1)

    def _on_release(self, request_id: str, serial: int) -> None:
        self._released.put(release_notice(request_id, serial))

    def _send_release_notices(self) -> None:
        while True:
            try:
                message = self._released.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                for peer in list(self.peers):
                    try:
                        self.agent.send_notif(peer, message)
                    except Exception as exc:  # the peer is gone; its TCP connection will close too
                        log.debug("send_notif to %s: %s", peer, exc)


class StaleConnection(Exception):
    """The client reconnected (to the same store or a restarted one) after a transfer looked up
    its block table: the table may be stale, so the transfer must look it up again."""


class NixlInitiator:
    """Client side: one agent, registered local buffers, transfers to one store."""

    def __init__(self, name: str):
        self.name = name
        self.agent = make_agent(name)
        self.lock = threading.Lock()
        self.remote: str | None = None
        self.generation = 0  # one more at each connect: a table looked up before it may be stale
        self.arena_base = 0
        self.arena_bytes = 0
        # (start, end, tensor, registration): tensors stay referenced while registered.
        self._regions: list[tuple[int, int, torch.Tensor, Any]] = []

    @property
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def connect(self, store_metadata: bytes, arena_base: int, arena_bytes: int) -> None:
        with self.lock:
            if self.remote is not None:
                try:
                    self.agent.remove_remote_agent(self.remote)
                except Exception:
                    pass
            name = self.agent.add_remote_agent(store_metadata)
            self.remote = name.decode() if isinstance(name, bytes) else name
            self.generation += 1
            self.arena_base = arena_base
            self.arena_bytes = arena_bytes

    def register(self, tensor: torch.Tensor) -> None:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if self._covering(start, end) is not None:
            return
        if not tensor.is_contiguous():
            raise InvalidArgument("NIXL buffers must be contiguous tensors")
        with self.lock:
            registration = self.agent.register_memory(tensor)
            self._regions.append((start, end, tensor, registration))

    def unregister(self, tensor: torch.Tensor) -> None:
        start = tensor.data_ptr()
        with self.lock:
            for i, (s, _e, _t, registration) in enumerate(self._regions):
                if s == start:
                    self.agent.deregister_memory(registration)
                    del self._regions[i]
                    return

    def _covering(self, start: int, end: int):
        for region in self._regions:
            if region[0] <= start and end <= region[1]:
                return region
        return None

    def close(self) -> None:
        with self.lock:
            for _s, _e, _t, registration in self._regions:
                try:
                    self.agent.deregister_memory(registration)
                except Exception as exc:
                    log.debug("deregister_memory: %s", exc)
            self._regions.clear()
            if self.remote is not None:
                try:
                    self.agent.remove_remote_agent(self.remote)
                except Exception as exc:
                    log.debug("remove_remote_agent: %s", exc)
                self.remote = None

    def drain_notifications(self) -> list[tuple[int, str]]:
        """(serial, request id) of the allocations the store says were freed."""
        with self.lock:
            notifs = self.agent.get_new_notifs()
        freed = []
        for messages in notifs.values():
            for message in messages:
                notice = parse_release_notice(message)
                if notice is not None:
                    freed.append(notice)
        return freed

    def post(self, op: str, local: torch.Tensor, local_offsets: np.ndarray, remote_offsets: np.ndarray,
             lengths: np.ndarray, generation: int | None = None) -> tuple[Any, str, Any]:
        """Start one batched transfer of runs (local_offsets[i] <-> arena remote_offsets[i]).

        Returns (transfer handle, state, transient registration). A buffer not registered with
        register() is registered just for this transfer (a few microseconds): the caller
        releases it with release() once the transfer is over, so temporaries do not pile up.
        """
        if not local.is_contiguous():
            raise InvalidArgument("NIXL buffers must be contiguous tensors")
        start = local.data_ptr()
        transient = None
        if self._covering(start, start + local.numel() * local.element_size()) is None:
            with self.lock:
                transient = self.agent.register_memory(local)
        mem = "VRAM" if local.is_cuda else "DRAM"
        device = local.get_device() if local.is_cuda else 0
        n = lengths.size
        local_descs = np.empty((n, 3), dtype=np.uint64)
        local_descs[:, 0] = local_offsets + start
        local_descs[:, 1] = lengths
        local_descs[:, 2] = device
        remote_descs = np.empty((n, 3), dtype=np.uint64)
        remote_descs[:, 0] = remote_offsets + self.arena_base
        remote_descs[:, 1] = lengths
        remote_descs[:, 2] = 0
        try:
            with self.lock:
                if generation is not None and generation != self.generation:
                    raise StaleConnection(f"connection {self.generation}, table of connection {generation}")
                handle = self.agent.initialize_xfer(
                    op,
                    self.agent.get_xfer_descs(local_descs, mem),
                    self.agent.get_xfer_descs(remote_descs, "DRAM"),
                    self.remote,
                )
                state = self.agent.transfer(handle)
        except BaseException:
            self.release(None, transient)
            raise
        if state == "ERR":
            self.release(handle, transient)
            raise TransferError(f"NIXL {op} of {n} runs failed to start")
        return handle, state, transient

    def state(self, handle: Any) -> str:
        with self.lock:
            return self.agent.check_xfer_state(handle)

    def release(self, handle: Any, transient: Any = None) -> bool:
        """Free a finished (or abandoned: NIXL cancels it) transfer and its transient registration.
        False: NIXL refused (a transfer still running may); both are kept, to be released later."""
        with self.lock:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception as exc:  # an unfinished transfer may refuse to be released
                    log.debug("release_xfer_handle: %s", exc)
                    return False
            if transient is not None:
                try:
                    self.agent.deregister_memory(transient)
                except Exception as exc:
                    log.debug("deregister_memory: %s", exc)
        return True
