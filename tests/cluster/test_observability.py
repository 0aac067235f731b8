"""The real server under the real load tool, scraped by a real Prometheus: the load tool's
counts equal the server's own metrics, and every Grafana panel query returns data.

Skipped only when the prometheus binary is absent (scripts/install-deploy-tools.sh installs it).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import httpx
import pytest

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.server import BackgroundServer
from oasiskv.decode_node.config import DecodeConfig

from ..conftest import DEFAULT_MODEL, stdlib_source
from ..deploy.conftest import require_tool, start_prometheus
from ..deploy.test_grafana import pq

# In CI's slow step (its load run takes most of a minute), which keeps the default suite well under
# 25 minutes; tests/deploy/test_grafana.py checks the panels against a real Prometheus by default.
pytestmark = pytest.mark.slow

NUM_PROMPTS = 6


@pytest.fixture(scope="module")
def loaded_server(tmp_path_factory):
    require_tool("prometheus")
    config = ServeConfig(model=DEFAULT_MODEL, port=0, store_capacity_gb=0.25, threads_per_worker=1,
                         decode=DecodeConfig(kv_pool_gb=0.25, budget_tokens=256))
    with BackgroundServer(config) as server:
        work = tmp_path_factory.mktemp("observability")
        result = subprocess.run(
            [sys.executable, "-m", "oasiskv.cluster.cli", "bench", "serve", "--base-url", server.url,
             "--dataset", "files", "--num-prompts", str(NUM_PROMPTS), "--files-input-len", "600",
             "--files-output-len", "12", "--ignore-eos", "--request-rate", "4", "--save-result", "--no-plot",
             "--result-dir", str(work), "--result-filename", "run.json", "--disable-tqdm",
             "--skip-initial-test"],
            capture_output=True, text=True, timeout=600,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        record = json.loads((work / "run.json").read_text())
        after_the_tool = _families(server)
        process, base = start_prometheus(server.url.removeprefix("http://"), work)
        try:
            # More load while Prometheus scrapes, so rate() windows see traffic: long prompts
            # (sparse decode, prefetches) and one client that hangs up (a non-success status).
            long_prompt = stdlib_source("argparse.py")[:2400]
            deadline = time.monotonic() + 60
            hung_up = False
            while True:
                assert process.poll() is None, process.stderr.read().decode()
                httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": DEFAULT_MODEL, "prompt": long_prompt, "max_tokens": 4, "ignore_eos": True})
                if not hung_up:
                    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                                      json={"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 300,
                                            "ignore_eos": True, "stream": True}) as response:
                        next(response.iter_lines())
                    hung_up = True
                try:
                    up = pq.run_query(base, "count_over_time(up[1m])", timeout_s=5)["data"]["result"]
                    if up and float(up[0]["value"][1]) >= 8:
                        break
                except (OSError, KeyError):
                    pass
                assert time.monotonic() < deadline, "Prometheus did not scrape the server"
                time.sleep(0.5)
            yield server, record, base, after_the_tool
        finally:
            process.terminate()
            process.wait(timeout=10)


def _families(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("oasiskv_") and " " in line}


def _value(base: str, expr: str) -> float:
    result = pq.run_query(base, expr, timeout_s=5)["data"]["result"]
    return sum(float(series["value"][1]) for series in result)


def test_load_tool_counts_equal_the_server_metrics(loaded_server):
    server, record, base, after_the_tool = loaded_server
    summary = record.get("summary", record)
    assert summary["completed"] == NUM_PROMPTS and summary["failed"] == 0
    assert after_the_tool['oasiskv_requests_total{status="success"}'] == NUM_PROMPTS
    assert after_the_tool["oasiskv_generation_tokens_total"] == summary["total_output_tokens"]
    families = _families(server)
    success = families['oasiskv_requests_total{status="success"}']
    generated = families["oasiskv_generation_tokens_total"]
    # Then the scrape-time requests of 4 tokens, and one client that hung up after its first
    # chunk: the tokens it was sent count too.
    extra = success - NUM_PROMPTS
    assert extra >= 1
    assert families['oasiskv_requests_total{status="abort"}'] == 1
    assert 1 <= generated - summary["total_output_tokens"] - 4 * extra < 300
    assert _value(base, 'oasiskv_requests_total{status="success"}') >= NUM_PROMPTS


def test_every_grafana_panel_query_returns_data(loaded_server):
    _, _, base, _ = loaded_server
    time.sleep(3)  # the last stats poll and scrape
    failures = []
    for query in pq.load_queries():
        expr = pq.render(query.expr, {"__rate_interval": "1m"})
        answer = pq.run_query(base, expr, timeout_s=5)
        values = [float(s["value"][1]) for s in answer.get("data", {}).get("result", [])]
        if answer.get("status") != "success" or not values or not all(math.isfinite(v) for v in values):
            failures.append(f"{query.dashboard}/{query.panel_title}: {expr} -> {answer}")
    assert not failures, "\n".join(failures)
