"""A stand-in for the API's /metrics: every series the serving contract names, with moving values.

Dashboards and alert rules are written against the contract before the API exists; serving these
series from a real prometheus_client registry checks the names as the client library really
exposes them (`_total`, `_bucket`, ...), and a real Prometheus scraping it checks every query.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

WORKERS = ("decode-0", "decode-1")
STORES = ("store-0",)
ROLES = {"prefill": ("prefill-0",), "decode": WORKERS, "store": STORES}

# Base names of the contract, as prometheus_client exposes them.
COUNTERS = [
    "oasiskv_requests_total", "oasiskv_prompt_tokens_total", "oasiskv_generation_tokens_total",
    "oasiskv_prefix_cache_hits_total",
    "oasiskv_decode_blocks_fetched_total", "oasiskv_decode_bytes_fetched_total",
    "oasiskv_decode_admission_bytes_fetched_total", "oasiskv_decode_summary_bytes_fetched_total",
    "oasiskv_prefetch_hits_total", "oasiskv_prefetch_misses_total", "oasiskv_prefetch_waits_total",
    "oasiskv_prefetch_skips_total", "oasiskv_decode_fetch_wait_seconds_total", "oasiskv_decode_on_demand_waits_total",
    "oasiskv_drafts_proposed_total", "oasiskv_drafts_accepted_total", "oasiskv_decode_step_failures_total",
    "oasiskv_decode_store_free_failures_total", "oasiskv_worker_restarts_total",
]
HISTOGRAMS = ["oasiskv_request_ttft_seconds", "oasiskv_request_itl_seconds",
              "oasiskv_request_tpot_seconds", "oasiskv_request_e2e_seconds"]
GAUGES = [
    "oasiskv_queue_length", "oasiskv_running_requests", "oasiskv_decode_kv_pool_usage_ratio",
    "oasiskv_decode_kv_pool_quarantined_ratio",
    "oasiskv_store_used_bytes", "oasiskv_store_capacity_bytes", "oasiskv_prediction_recall",
    "oasiskv_draft_acceptance_rate", "oasiskv_nixl_bytes_per_second", "oasiskv_worker_healthy",
]


def exposed_names() -> set[str]:
    """Every series name a scrape can return (histograms expand to _bucket/_sum/_count)."""
    names = set(COUNTERS) | set(GAUGES)
    for base in HISTOGRAMS:
        names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return names


class ContractExporter:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("oasiskv_requests", "Finished requests", ["status"], registry=r)
        self.prompt_tokens = Counter("oasiskv_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("oasiskv_generation_tokens", "Generated tokens", registry=r)
        self.prefix_cache_hits = Counter("oasiskv_prefix_cache_hits", "Prompt tokens from prefix caches", registry=r)
        per_worker = {
            name: Counter(name.removesuffix("_total"), name, ["worker"], registry=r)
            for name in COUNTERS[4:]
        }
        self.per_worker = per_worker
        self.latency = {name: Histogram(name, name, registry=r) for name in HISTOGRAMS}
        self.queue = Gauge("oasiskv_queue_length", "Queued requests", registry=r)
        self.running = Gauge("oasiskv_running_requests", "Running requests", registry=r)
        self.pool = Gauge("oasiskv_decode_kv_pool_usage_ratio", "KV pool usage", ["worker"], registry=r)
        self.quarantined = Gauge("oasiskv_decode_kv_pool_quarantined_ratio", "KV pool quarantined", ["worker"],
                                 registry=r)
        self.store_used = Gauge("oasiskv_store_used_bytes", "Store bytes used", ["store"], registry=r)
        self.store_capacity = Gauge("oasiskv_store_capacity_bytes", "Store capacity", ["store"], registry=r)
        self.recall = Gauge("oasiskv_prediction_recall", "Recall", ["worker"], registry=r)
        self.acceptance = Gauge("oasiskv_draft_acceptance_rate", "Acceptance", ["worker"], registry=r)
        self.nixl = Gauge("oasiskv_nixl_bytes_per_second", "NIXL rate", ["worker"], registry=r)
        self.healthy = Gauge("oasiskv_worker_healthy", "Worker health", ["role", "worker"], registry=r)
        self._stop = threading.Event()
        self._server = None

    def tick(self) -> None:
        """One step of fake traffic: every counter and histogram moves, so rates are non-zero."""
        for status, n in (("success", 8), ("error", 1), ("abort", 1), ("rejected", 1)):
            self.requests.labels(status).inc(n)
        self.prompt_tokens.inc(4096)
        self.generation_tokens.inc(256)
        self.prefix_cache_hits.inc(2048)
        for worker in WORKERS:
            for counter in self.per_worker.values():
                counter.labels(worker).inc(10)
            self.pool.labels(worker).set(0.5)
            self.quarantined.labels(worker).set(0.01)
            self.recall.labels(worker).set(0.98)
            self.acceptance.labels(worker).set(0.7)
            self.nixl.labels(worker).set(2e9)
        for i, histogram in enumerate(self.latency.values()):
            histogram.observe(0.01 * (i + 1))
            histogram.observe(0.3 * (i + 1))
        self.queue.set(2)
        self.running.set(5)
        for store in STORES:
            self.store_used.labels(store).set(3 << 30)
            self.store_capacity.labels(store).set(8 << 30)
        for role, workers in ROLES.items():
            for worker in workers:
                self.healthy.labels(role, worker).set(1)

    def start(self, tick_s: float = 0.2) -> str:
        self.tick()
        self._server, _ = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        threading.Thread(target=self._run, args=(tick_s,), daemon=True).start()
        return f"127.0.0.1:{self._server.server_port}"

    def _run(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
