"""Prometheus metrics of one store.

Each store gets its own CollectorRegistry, so several stores in one process (tests, benches)
do not collide. Names are `oasiskv_kvstore_*` without colons (prometheus_client rewrites
colons under OpenMetrics).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server


class StoreMetrics:
    def __init__(self, capacity_bytes: int):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.capacity_bytes = Gauge("oasiskv_kvstore_capacity_bytes", "Arena size", registry=r)
        self.used_bytes = Gauge("oasiskv_kvstore_used_bytes", "Arena bytes in use: live requests, and freed ones a NIXL client may still touch", registry=r)
        self.free_bytes = Gauge("oasiskv_kvstore_free_bytes", "Arena bytes free", registry=r)
        self.live_requests = Gauge("oasiskv_kvstore_requests", "Live requests", registry=r)
        self.requests = Counter(
            "oasiskv_kvstore_requests_events", "Request lifecycle events", ["event"], registry=r
        )  # event: allocated, freed, expired, refused, held (freed while a NIXL client held its table), hold_expired
        self.held_requests = Gauge(
            "oasiskv_kvstore_held_requests", "Freed requests whose memory waits for NIXL clients to drop their block table",
            registry=r,
        )
        self.blocks_read = Counter(
            "oasiskv_kvstore_blocks_read", "Block units read", ["transport"], registry=r
        )
        self.blocks_written = Counter(
            "oasiskv_kvstore_blocks_written", "Block units written", ["transport"], registry=r
        )
        self.bytes_served = Counter(
            "oasiskv_kvstore_bytes_served", "KV bytes read from the store", ["transport"], registry=r
        )
        self.bytes_written = Counter(
            "oasiskv_kvstore_bytes_written", "KV bytes written to the store", ["transport"], registry=r
        )
        self.errors = Counter("oasiskv_kvstore_errors", "Errors returned or seen", ["type"], registry=r)
        self.connections = Gauge("oasiskv_kvstore_connections", "Open client connections", registry=r)
        self.capacity_bytes.set(capacity_bytes)
        self.free_bytes.set(capacity_bytes)

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def serve_http(self, port: int, host: str = "0.0.0.0"):
        """Expose /metrics on a port (standalone store); returns the server, or None if unsupported."""
        return start_http_server(port, addr=host, registry=self.registry)
