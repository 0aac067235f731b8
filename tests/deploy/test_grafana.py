"""Grafana dashboards: schema-level checks of the JSON, and every panel query run against a real
Prometheus that scrapes the contract's metrics (skipped only when the prometheus binary is absent)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
import time
import urllib.request
from itertools import combinations

import pytest
import yaml

from .conftest import REPO, require_tool, start_prometheus
from .contract_metrics import HISTOGRAMS, ContractExporter, exposed_names

GRAFANA = REPO / "deploy" / "grafana"


def _load_panel_queries():
    spec = importlib.util.spec_from_file_location("panel_queries", GRAFANA / "panel_queries.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


pq = _load_panel_queries()
DASHBOARDS = {path.name: json.loads(path.read_text()) for path in pq.dashboard_files()}
DS_UID = "${datasource}"


def test_both_dashboards_exist():
    assert set(DASHBOARDS) == {"oasiskv-overview.json", "oasiskv-kv.json"}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_top_level_follows_grafana_schema(name):
    d = DASHBOARDS[name]
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["uid"] and len(d["uid"]) <= 40 and d["title"]
    assert d["id"] is None, "provisioned dashboards must not carry a database id"
    assert isinstance(d["panels"], list) and d["panels"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panel_ids_unique_and_grid_positions_sane(name):
    panels = list(pq.iter_panels(DASHBOARDS[name]["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    boxes = []
    for p in panels:
        grid = p["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys(), p["title"]
        assert all(isinstance(grid[k], int) and grid[k] >= 0 for k in "hwxy")
        assert grid["w"] >= 1 and grid["h"] >= 1 and grid["x"] + grid["w"] <= 24, p["title"]
        boxes.append((p["title"], grid))
    for (ta, a), (tb, b) in combinations(boxes, 2):
        overlap = (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                   and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])
        assert not overlap, f"{name}: panels {ta!r} and {tb!r} overlap"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_panel_queries_prometheus_through_the_datasource_variable(name):
    for panel in pq.iter_panels(DASHBOARDS[name]["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": DS_UID}, panel["title"]
        targets = panel["targets"]
        assert targets, f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in targets:
            assert target["expr"].strip(), f"{panel['title']} {target['refId']}: empty expr"
            assert target["datasource"]["uid"] == DS_UID


def _matchers(text: str) -> set[tuple[str, str, str]]:
    return set(re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', text))


def test_every_metric_selector_is_scoped_to_the_namespace_variable():
    """One Prometheus often scrapes several releases, a namespace each: a selector without the
    matcher adds every release into the panel whatever namespace is picked."""
    unscoped = [f"{q.dashboard}/{q.panel_title}/{q.ref_id}: {name}{{{matchers}}}"
                for q in pq.load_queries() for name, matchers in pq.metric_selectors(q.expr)
                if ("namespace", "=~", "$namespace") not in _matchers(matchers)]
    assert not unscoped, "\n".join(unscoped)


def _listing_metric(variable: dict) -> str:
    listed = re.fullmatch(r"label_values\((\w+),\s*namespace\)", variable["query"])
    assert listed, variable["query"]
    return listed.group(1)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_namespace_variable_offers_every_release_and_all(name):
    variables = {v["name"]: v for v in DASHBOARDS[name]["templating"]["list"]}
    namespace = variables["namespace"]
    assert namespace["type"] == "query"
    assert namespace["datasource"] == {"type": "prometheus", "uid": DS_UID}
    assert _listing_metric(namespace) in exposed_names()
    assert namespace["multi"] is True and namespace["includeAll"] is True
    # All must also match series with no namespace label (docker compose): `.*` matches the empty value
    assert namespace["allValue"] == ".*" == pq.render("$namespace")
    assert namespace["current"]["value"] == ["$__all"]


def test_the_namespace_list_has_a_release_that_served_nothing_yet():
    """label_values finds a namespace only through a series of the metric it names: a labelled
    counter has none before its first request."""
    metrics_module = pytest.importorskip("oasiskv.cluster.metrics")
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    exposition = generate_latest(metrics_module.ServingMetrics().registry).decode()
    exposed = {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}
    for dashboard in DASHBOARDS.values():
        (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "namespace"]
        assert _listing_metric(variable) in exposed


# Labels naming one instance inside a release: decode-0, store-0 and the decode role recur in every
# namespace, so a grouping by one of them alone adds the same-named instances of the releases up.
PER_INSTANCE_LABELS = {"worker", "store", "role"}
# Labels that group across instances on purpose: a request's outcome, a histogram bucket.
ACROSS_INSTANCES_LABELS = {"status", "le"}


def _per_instance(query) -> set[str]:
    """The per-instance labels a query's result keeps (named in its `by` clauses)."""
    return {label for keyword, labels in pq.groupings(query.expr) if keyword == "by" for label in labels} & (
        PER_INSTANCE_LABELS)


def test_every_grouping_label_is_known_as_per_instance_or_not():
    """A new label in a grouping needs the decision below: kept apart per namespace or not."""
    used = {label for q in pq.load_queries() for _, labels in pq.groupings(q.expr) for label in labels}
    assert used <= PER_INSTANCE_LABELS | ACROSS_INSTANCES_LABELS | {"namespace"}, used


def test_per_instance_groupings_keep_the_namespace():
    """With All or several namespaces picked, `by (worker)` makes one series of decode-0 of team-a
    and decode-0 of team-b. `without` and `ignoring` keep the namespace as long as they do not name it."""
    merged = []
    for q in pq.load_queries():
        for keyword, labels in pq.groupings(q.expr):
            keeps = set(labels) if keyword in ("by", "on") else set()
            if (keeps & PER_INSTANCE_LABELS and "namespace" not in keeps) or (
                    keyword in ("without", "ignoring") and "namespace" in labels):
                merged.append(f"{q.dashboard}/{q.panel_title}/{q.ref_id}: {keyword} ({', '.join(labels)})")
    assert not merged, "\n".join(merged)


def test_per_instance_legends_name_the_namespace_and_read_well_without_one():
    """Series of two releases need the namespace in their names to be told apart. Under docker
    compose there is no namespace label and Grafana puts an empty string in its place: the name
    must still read as words with single spaces (no `/decode-0`, `decode-0 ()` or doubled space)."""
    queries = [q for q in pq.load_queries() if _per_instance(q)]
    assert queries
    for q in queries:
        where = f"{q.dashboard}/{q.panel_title}/{q.ref_id}: {q.legend_format!r}"
        assert re.search(r"\{\{\s*namespace\s*\}\}", q.legend_format), where
        compose = pq.legend(q.legend_format, {label: f"{label}-0" for label in PER_INSTANCE_LABELS})
        assert re.fullmatch(r"[\w-]+(?: [\w-]+)*", compose.strip()), (where, compose)


def test_queries_use_only_contract_metrics():
    allowed = exposed_names()
    for query in pq.load_queries():
        names = pq.metric_names(query.expr)
        assert names, f"{query.panel_title}: no metric found in {query.expr!r}"
        unknown = names - allowed
        assert not unknown, f"{query.panel_title}: not in the metrics contract: {sorted(unknown)}"
        assert all(n.startswith("oasiskv_") for n in names)


def test_the_api_exposes_every_name_the_dashboards_and_rules_use():
    """Against the API's real metrics registry, not only the contract's list."""
    metrics_module = pytest.importorskip("oasiskv.cluster.metrics")
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    metrics = metrics_module.ServingMetrics()
    metrics.requests.labels("success").inc()
    for histogram in (metrics.ttft, metrics.itl, metrics.tpot, metrics.e2e):
        histogram.observe(0.1)
    metrics.prompt_tokens.inc(10)
    metrics.generation_tokens.inc(5)
    metrics.worker_stats["decode-0"] = {"prediction_recall": 0.7, "acceptance_rate": 0.3, "pool_usage": 0.1,
                                        "pool_quarantined": 0.0}
    metrics.store_stats["store-0"] = {"used_bytes": 1, "capacity_bytes": 2}
    metrics.health[("decode", "decode-0")] = True
    metrics.nixl_rate["decode-0"] = 1.0
    metrics.worker_restarts.labels("decode", "decode-0").inc()
    exposition = generate_latest(metrics.registry).decode()
    exposed = {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}
    used = set().union(*(pq.metric_names(q.expr) for q in pq.load_queries()))
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules" / "oasiskv.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            used |= {n for n in pq.metric_names(rule["expr"]) if n.startswith("oasiskv_")}
    assert used - exposed == set()


def test_a_ratio_of_nothing_yet_is_left_out_not_shown_as_zero():
    """A dense-only cluster has no recall and a worker without drafts no acceptance: the panels
    read 0% from a 0 that stood for "none"."""
    metrics_module = pytest.importorskip("oasiskv.cluster.metrics")
    from prometheus_client import generate_latest

    metrics = metrics_module.ServingMetrics()
    metrics.worker_stats["decode-0"] = {"prediction_recall": None, "acceptance_rate": 0.0, "pool_usage": 0.0}
    exposition = generate_latest(metrics.registry).decode()
    assert 'oasiskv_prediction_recall{worker="decode-0"}' not in exposition
    assert 'oasiskv_draft_acceptance_rate{worker="decode-0"} 0.0' in exposition  # a real 0 stays
    assert 'oasiskv_decode_kv_pool_usage_ratio{worker="decode-0"} 0.0' in exposition


def test_every_contract_metric_is_on_a_dashboard():
    used = set().union(*(pq.metric_names(q.expr) for q in pq.load_queries()))
    shown = {n.removesuffix("_bucket") for n in used}
    wanted = {n for n in exposed_names() if not n.endswith(("_sum", "_count", "_bucket"))} | set(HISTOGRAMS)
    assert wanted - shown == set()


def test_overview_shows_p50_p90_p99_of_every_latency():
    exprs = [q.expr for q in pq.iter_queries(DASHBOARDS["oasiskv-overview.json"])]
    for histogram in HISTOGRAMS:
        for quantile in ("0.5", "0.9", "0.99"):
            assert any(f"histogram_quantile({quantile}," in e and f"{histogram}_bucket" in e for e in exprs), (
                histogram, quantile)


def test_dashboard_links_point_at_existing_dashboards():
    uids = {d["uid"] for d in DASHBOARDS.values()}
    assert len(uids) == len(DASHBOARDS)
    for d in DASHBOARDS.values():
        for link in d.get("links", []):
            assert link["url"].removeprefix("/d/") in uids


def test_render_and_metric_names():
    expr = 'sum by (le) (rate(oasiskv_request_ttft_seconds_bucket{status!="x"}[$__rate_interval]))'
    assert pq.render(expr, {"__rate_interval": "5s"}).endswith("[5s]))")
    assert pq.metric_names(expr) == {"oasiskv_request_ttft_seconds_bucket"}
    assert pq.metric_names("a / ignoring(status) group_left() b or vector(0)") == {"a", "b"}
    with pytest.raises(KeyError):
        pq.render("rate(x[$unknown])")
    assert pq.render('x{namespace=~"$namespace"}') == 'x{namespace=~".*"}'
    assert pq.metric_selectors('a{x="}{", y!~"z"} / on(x) b[5m] + vector(0)') == [("a", 'x="}{", y!~"z"'), ("b", "")]
    assert pq.groupings('sum by (namespace, worker) (a{x="by (y)"}) / ignoring(status) group_left() max(b)') == [
        ("by", ("namespace", "worker")), ("ignoring", ("status",)), ("group_left", ())]
    # Grafana's Prometheus data source: a label the series lacks is an empty string
    assert pq.legend("{{namespace}} {{ worker }} hits", {"worker": "decode-0"}) == " decode-0 hits"
    assert pq.legend("{{namespace}} {{worker}}", {"namespace": "team-a", "worker": "decode-0"}) == "team-a decode-0"


def test_provisioning_files_are_valid():
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "oasiskv.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/var/lib/grafana/dashboards")


# --- every query against a real Prometheus ------------------------------------------------------

# Under docker compose (no namespace label) and as two Helm releases.
SCRAPED_AS = (None, "team-a", "team-b")


def _query(base: str, expr: str) -> dict:
    return pq.run_query(base, expr, timeout_s=5)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    require_tool("prometheus")
    exporter = ContractExporter()
    target = exporter.start()
    process, base = start_prometheus(target, tmp_path_factory.mktemp("prometheus"), SCRAPED_AS)
    try:
        deadline = time.monotonic() + 30
        while True:  # ready, and enough scrapes of every job for a 5 s rate window
            assert process.poll() is None, process.stderr.read().decode()
            try:
                answer = _query(base, "count_over_time(up[1m])")
                samples = answer["data"]["result"]
                if len(samples) == len(SCRAPED_AS) and all(float(s["value"][1]) >= 6 for s in samples):
                    break
            except (OSError, KeyError):
                pass
            assert time.monotonic() < deadline, "Prometheus did not scrape the exporter in 30 s"
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)
        exporter.stop()


@pytest.mark.parametrize("namespace", [".*", "team-a"])
def test_every_panel_query_returns_data_from_a_real_prometheus(prometheus, namespace):
    failures = []
    for query in pq.load_queries():
        expr = pq.render(query.expr, {"__rate_interval": "5s", "namespace": namespace})
        answer = _query(prometheus, expr)
        result = answer.get("data", {}).get("result", [])
        values = [float(series["value"][1]) for series in result]
        if answer.get("status") != "success" or not values or not all(math.isfinite(v) for v in values):
            failures.append(f"{query.dashboard}/{query.panel_title}/{query.ref_id}: {expr} -> {answer}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("namespace, selected", [
    (".*", {"", "team-a", "team-b"}),  # All: the empty value of an absent label matches `.*`
    ("team-a", {"team-a"}),
    ("(team-a|team-b)", {"team-a", "team-b"}),  # how Grafana sends several picked values
])
def test_the_namespace_variable_selects_series_in_a_real_prometheus(prometheus, namespace, selected):
    """Each panel selector alone, so the answer still carries the namespace label that the
    panels' aggregations drop."""
    selectors = {f"{name}{{{matchers}}}" for q in pq.load_queries() for name, matchers in pq.metric_selectors(q.expr)}
    for selector in sorted(selectors):
        answer = _query(prometheus, pq.render(selector, {"namespace": namespace}))
        found = {series["metric"].get("namespace", "") for series in answer["data"]["result"]}
        assert found == selected, (selector, namespace)


def test_per_instance_panels_keep_the_releases_apart_in_a_real_prometheus(prometheus):
    """With All picked, decode-0 scraped as team-a, as team-b and as compose (no namespace) are
    three series of every per-worker (per-store, per-role) panel, each with its own name."""
    queries = [q for q in pq.load_queries() if _per_instance(q)]
    assert queries
    for query in queries:
        expr = pq.render(query.expr, {"__rate_interval": "5s"})
        result = _query(prometheus, expr)["data"]["result"]
        namespaces = {}
        for series in result:
            instance = tuple(series["metric"].get(label, "") for label in sorted(_per_instance(query)))
            namespaces.setdefault(instance, []).append(series["metric"].get("namespace", ""))
        assert namespaces, expr
        for instance, found in namespaces.items():
            assert sorted(found) == sorted(ns or "" for ns in SCRAPED_AS), (query.panel_title, query.ref_id, instance, found)
        names = [pq.legend(query.legend_format, series["metric"]) for series in result]
        assert len(set(names)) == len(names), (query.panel_title, query.ref_id, names)


def test_alert_rule_expressions_run_on_the_contract_metrics(prometheus):
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules" / "oasiskv.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            answer = _query(prometheus, rule["expr"])
            assert answer["status"] == "success", (rule["alert"], answer)


def test_panel_queries_command_line_runs_queries(prometheus):
    with urllib.request.urlopen(f"{prometheus}/-/ready", timeout=5) as response:
        assert response.status == 200
    result = subprocess.run(
        [sys.executable, str(GRAFANA / "panel_queries.py"), "--prometheus", prometheus],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == len(pq.load_queries())
    assert all(r["status"] == "success" for r in records)
