"""Prometheus metrics of the API process, and the workers' counters re-exported from polls.

Names are `oasiskv_*`: prometheus_client >= 0.23 rewrites ':' under OpenMetrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)

# Worker counters re-exported as counters (monotonic inside a worker's life).
DECODE_COUNTERS = {
    "blocks_fetched": ("oasiskv_decode_blocks_fetched", "KV blocks fetched from stores by decode workers"),
    "bytes_fetched": ("oasiskv_decode_bytes_fetched", "KV bytes fetched from stores by decode workers while decoding"),
    "admission_bytes_fetched": ("oasiskv_decode_admission_bytes_fetched",
                                "KV bytes fetched at admission (the first working set; the whole KV in dense)"),
    "summary_bytes_fetched": ("oasiskv_decode_summary_bytes_fetched",
                              "key-summary bytes read at admission by the sparse modes"),
    "prefetch_hits": ("oasiskv_prefetch_hits", "layers whose prefetch had landed when needed"),
    "prefetch_misses": ("oasiskv_prefetch_misses", "layers whose prefetch had not landed when needed"),
    "prefetch_waits": ("oasiskv_prefetch_waits", "waits for a look-ahead prefetch that had not landed"),
    "prefetch_skips": ("oasiskv_prefetch_skips",
                       "layers attended without a prefetch that had not landed (miss policy 'skip')"),
    "fetch_wait_s": ("oasiskv_decode_fetch_wait_seconds",
                     "seconds decode workers blocked waiting for KV transfers before attending"),
    "on_demand_waits": ("oasiskv_decode_on_demand_waits",
                        "waits for on-demand fetches before attending (sparse-current; lookahead's top-up)"),
    "drafts_proposed": ("oasiskv_drafts_proposed", "draft tokens proposed"),
    "drafts_accepted": ("oasiskv_drafts_accepted", "draft tokens accepted"),
    "store_free_failures": ("oasiskv_decode_store_free_failures",
                            "requests whose store could not be told to free them (a store that had died, say)"),
    "step_failures": ("oasiskv_decode_step_failures",
                      "decode steps that raised; the requests in them ended with the error, the worker went on"),
}


class ServingMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("oasiskv_requests", "requests by how they ended: success, abort, error, or rejected "
                                "(429/503: every pool or store full and the queue at its limit, or no healthy worker)",
                                ["status"], registry=r)
        self.ttft = Histogram("oasiskv_request_ttft_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("oasiskv_request_itl_seconds", "inter-token latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("oasiskv_request_tpot_seconds", "time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("oasiskv_request_e2e_seconds", "end-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_length = Gauge("oasiskv_queue_length", "requests waiting for a decode pool or for room in a KV store", registry=r)
        self.running = Gauge("oasiskv_running_requests", "requests being served", registry=r)
        self.worker_restarts = Counter("oasiskv_worker_restarts", "workers the API asked Ray to restart because "
                                       "they reported themselves broken", ["role", "worker"], registry=r)
        self.prompt_tokens = Counter("oasiskv_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("oasiskv_generation_tokens", "generated tokens", registry=r)
        # As vLLM's prefix_cache_queries / prefix_cache_hits: hits / queries is the share of prompt tokens not computed.
        self.prefix_cache_queries = Counter("oasiskv_prefix_cache_queries", "prompt tokens the prefill workers looked up "
                                            "in their prefix caches", registry=r)
        self.prefix_cache_hits = Counter("oasiskv_prefix_cache_hits", "prompt tokens the prefill workers found in their "
                                         "prefix caches (their KV copied, not computed)", registry=r)
        self.worker_stats: dict[str, dict] = {}  # decode worker name -> last stats()
        self.store_stats: dict[str, dict] = {}  # store name -> last stats()
        self.health: dict[tuple[str, str], bool] = {}  # (role, worker) -> healthy
        self.nixl_rate: dict[str, float] = {}
        # Workers and stores whose last poll went unanswered: their usage gauges are left out (a
        # dead worker's last rate and pool usage stood for ever); their counters stay.
        self.unanswered: set[str] = set()
        r.register(_PolledCollector(self))


class _PolledCollector:
    """Exposes the last polled worker and store stats at scrape time."""

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        for key, (name, doc) in DECODE_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["worker"])
            for worker, stats in m.worker_stats.items():
                family.add_metric([worker], float(stats.get(key) or 0))
            yield family
        gauges = {
            "oasiskv_decode_kv_pool_usage_ratio": ("device KV pool rows in use / rows", "pool_usage"),
            "oasiskv_decode_kv_pool_quarantined_ratio": ("device KV pool rows held for transfers that have not ended "
                                                         "(a store that does not answer) / rows", "pool_quarantined"),
            "oasiskv_prediction_recall": ("share of the current query's top-K blocks that were resident, since the "
                                          "worker started", "prediction_recall"),
            "oasiskv_draft_acceptance_rate": ("accepted / proposed draft tokens, since the worker started",
                                              "acceptance_rate"),
        }
        for name, (doc, key) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["worker"])
            for worker, stats in m.worker_stats.items():
                # A ratio of nothing yet (no sparse step, no draft) is left out: a panel shows no
                # data, where 0 read as a recall or an acceptance of 0%.
                if stats.get(key) is not None and worker not in m.unanswered:
                    family.add_metric([worker], float(stats[key]))
            yield family
        rate = GaugeMetricFamily("oasiskv_nixl_bytes_per_second",
                                 "bytes/s each decode worker reads from the stores (admission, key summaries, "
                                 "fetches while decoding)", labels=["worker"])
        for worker, value in m.nixl_rate.items():
            rate.add_metric([worker], value)
        yield rate
        used = GaugeMetricFamily("oasiskv_store_used_bytes", "KV store bytes in use", labels=["store"])
        capacity = GaugeMetricFamily("oasiskv_store_capacity_bytes", "KV store capacity", labels=["store"])
        for store, stats in m.store_stats.items():
            if store not in m.unanswered:
                used.add_metric([store], float(stats.get("used_bytes", 0)))
            capacity.add_metric([store], float(stats.get("capacity_bytes", 0)))
        yield used
        yield capacity
        yield from store_series(m.store_stats)
        health = GaugeMetricFamily("oasiskv_worker_healthy", "1 when the worker answers and has not failed", labels=["role", "worker"])
        for (role, worker), ok in m.health.items():
            health.add_metric([role, worker], 1.0 if ok else 0.0)
        yield health


def store_series(store_stats: dict[str, dict]):
    """Every store's own `oasiskv_kvstore_*` series (request events, errors, bytes and blocks
    served), from its last polled stats, labelled with the store. `serve` gives its stores no
    metrics port, so these were seen only from a standalone `oasiskv kvstore`."""
    families: dict[str, Metric] = {}
    for store, stats in store_stats.items():
        for family in text_string_to_metric_families(stats.get("metrics_text") or ""):
            if family.name.endswith("_created"):  # when the store's counter was made: not a reading
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.add_sample(sample.name, {"store": store, **sample.labels}, sample.value)
    yield from families.values()
