"""One decode engine, several stores: store calls are routed by request id.

The engine talks to a single client object; in a cluster each request's KV lives in the store
the router chose, so the worker binds the request to that store's client on arrival. A store
that Ray restarted comes back at a new address; the client of the old one is retired, and
closed once the last request bound to it has been freed (each restart left a client, its NIXL
agent and an I/O thread behind in every decode worker).
"""

from __future__ import annotations

import logging
import threading

from ..kvstore import KVStoreError, connect

log = logging.getLogger("oasiskv.decode")


class StoreDirectory:
    def __init__(self, transport: str = "auto", timeout: float = 30.0):
        self.transport = transport
        self.timeout = timeout
        self._clients: dict[str, object] = {}
        self._by_request: dict[str, object] = {}
        self._buffers = []
        self._connecting: dict[str, threading.Lock] = {}
        self._connecting_guard = threading.Lock()
        self._retired: list = []  # clients of stores that moved, still bound to some request
        # Bumped by each retire of an address: a connect that began before it must not become
        # the address's client (it would be left behind for good).
        self._generations: dict[str, int] = {}
        # Called with each retired client once it is closed (the engine stops its I/O thread).
        self.closed_listeners: list = []

    def client_for(self, address: str):
        """The client of the store at `address`, connected on first use. Safe from several
        threads: the decode worker connects off its decode loop, since a store that does not
        answer keeps a connect waiting for the timeout; one lock per address, so that such a
        store holds up only the connects to itself."""
        client = self._clients.get(address)
        if client is None:
            with self._connecting_guard:
                lock = self._connecting.setdefault(address, threading.Lock())
            with lock:
                client = self._clients.get(address)
                if client is None:
                    generation = self._generations.get(address, 0)
                    client = connect(address, transport=self.transport, timeout=self.timeout)
                    for buffer in self._buffers:
                        client.register(buffer)
                    with self._connecting_guard:
                        if self._generations.get(address, 0) == generation:
                            self._clients[address] = client
                        else:  # the store moved while this connected: it serves the caller's request, then closes
                            self._retired.append(client)
        return client

    def bind(self, request_id: str, address: str) -> None:
        self._by_request[request_id] = self.client_for(address)

    def route(self, request_id: str):
        """The client of the store a request is bound to (None: none), so that the engine's I/O
        runs on one thread per store and a store that stops answering holds up only its own
        requests."""
        return self._by_request.get(request_id)

    def _client(self, request_id: str):
        try:
            return self._by_request[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is bound to no store") from None

    def register(self, tensor) -> None:
        self._buffers.append(tensor)
        for client in self._clients.values():
            client.register(tensor)

    def read_blocks(self, request_id, *args, **kwargs):
        return self._client(request_id).read_blocks(request_id, *args, **kwargs)

    def write_blocks(self, request_id, *args, **kwargs):
        return self._client(request_id).write_blocks(request_id, *args, **kwargs)

    def extend(self, request_id, num_tokens):
        return self._client(request_id).extend(request_id, num_tokens)

    def read_summaries(self, request_id, *args, **kwargs):
        return self._client(request_id).read_summaries(request_id, *args, **kwargs)

    def keep_alive(self) -> list[str]:
        """Refresh the store TTL of every bound request; returns those a store no longer holds.
        Safe beside the I/O thread: the bindings are copied first and each client serializes
        its own calls."""
        by_client: dict[int, tuple[object, list[str]]] = {}
        for request_id, client in list(self._by_request.items()):
            by_client.setdefault(id(client), (client, []))[1].append(request_id)
        unknown = []
        for client, request_ids in by_client.values():
            try:
                unknown.extend(client.touch(request_ids))
            except KVStoreError as error:  # its requests fail when they next use it, not here
                log.warning("could not keep %d request(s) alive in their store: %s", len(request_ids), error)
        return unknown

    def free(self, request_id) -> None:
        client = self._by_request.pop(request_id, None)
        if client is not None:
            try:
                client.free(request_id)
            finally:
                if self._retired:
                    self._close_unbound()

    def retire(self, address: str) -> bool:
        """The store at `address` is gone (Ray restarted it elsewhere): no new request goes to
        its client, which is closed now if no request is bound to it, else once the last is
        freed. False: no client for that address."""
        with self._connecting_guard:
            self._generations[address] = self._generations.get(address, 0) + 1
            client = self._clients.pop(address, None)
            self._connecting.pop(address, None)
            if client is None:
                return False
            self._retired.append(client)
        self._close_unbound()
        return True

    @property
    def connected(self) -> int:
        """Clients of the stores in use."""
        return len(self._clients)

    @property
    def retired(self) -> int:
        """Clients of stores that moved that wait for their last requests to be freed."""
        return len(self._retired)

    def _close_unbound(self) -> None:
        """Close the retired clients no request is bound to. Runs on any thread (a queued free
        runs on its store's I/O thread); each client is taken out of the list under the guard,
        so it is closed once."""
        bound = {id(client) for client in list(self._by_request.values())}
        with self._connecting_guard:
            unbound = [client for client in self._retired if id(client) not in bound]
            self._retired = [client for client in self._retired if id(client) in bound]
        for client in unbound:
            try:
                client.close()
            except Exception as error:  # it is gone either way
                log.warning("closing the client of a store that moved: %s", error)
            for listener in self.closed_listeners:
                listener(client)

    def close(self) -> None:
        for client in [*self._clients.values(), *self._retired]:
            client.close()
        self._clients.clear()
        self._retired.clear()
