"""The store as a Ray actor.

The actor runs the same KVStoreServer as the standalone command and returns its address, so
clients in other actors or processes connect the same way (NIXL or TCP); Ray only places and
supervises the process. Ray is imported only when an actor is launched.
"""

from __future__ import annotations

from typing import Any

from .config import KVStoreConfig
from .errors import UnknownRequest
from .server import KVStoreServer


class KVStoreActor:
    def __init__(self, config: dict[str, Any] | None = None):
        config_model = KVStoreConfig.model_validate(config or {})
        if config_model.advertise_host is None and config_model.host in ("0.0.0.0", ""):
            import ray

            config_model = config_model.model_copy(update={"advertise_host": ray.util.get_node_ip_address()})
        self.server = KVStoreServer(config_model)
        self.server.start()

    def address(self) -> str:
        return self.server.address

    def stats(self) -> dict[str, Any]:
        # The address too: a store that Ray restarted (on another node, or on a new port) is only
        # found again through it.
        return {**self.server.store.stats().__dict__, "store_id": self.server.store_id, "nixl": self.server.serves_nixl,
                "address": self.server.address, "metrics_text": self.server.metrics.text()}

    def free(self, request_id: str) -> bool:
        """Drop a request's KV; False when the store does not hold it (never allocated, freed
        already, or lost with a restart). The API process cleans up through this after a worker
        died holding the request: the dead worker can free nothing, and a prefill worker that
        Ray is restarting refuses calls."""
        try:
            self.server.store.free(request_id)
        except UnknownRequest:
            return False
        return True

    def metrics_text(self) -> str:
        return self.server.metrics_text()

    def shutdown(self) -> None:
        self.server.stop()


def launch_store_actor(config: KVStoreConfig | dict[str, Any] | None = None, timeout_s: float = 120.0,
                       **actor_options: Any) -> tuple[Any, str]:
    """Start a store actor; returns (actor handle, "host:port").

    actor_options go to .options() (name, lifetime, resources...). num_cpus defaults to 0:
    with NIXL the store's data path is one-sided and the actor is mostly idle.
    """
    import ray

    if isinstance(config, KVStoreConfig):
        config = config.model_dump()
    actor_options.setdefault("num_cpus", 0)
    handle = ray.remote(KVStoreActor).options(**actor_options).remote(config)
    address = ray.get(handle.address.remote(), timeout=timeout_s)
    return handle, address
