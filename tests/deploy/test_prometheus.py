"""Prometheus configuration and alert rules: promtool's config and rule checks, the rule unit
tests (deploy/prometheus/tests), and that every alert the deployment promises exists and is
unit-tested."""

from __future__ import annotations

import re

import yaml

from .conftest import REPO, require_tool, run
from .contract_metrics import exposed_names

PROMETHEUS = REPO / "deploy" / "prometheus"
RULE_FILES = sorted((PROMETHEUS / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))

# What the alerts must cover, by name.
REQUIRED_ALERTS = {
    "OasisKVHighErrorRate",            # high error rate
    "OasisKVTTFTOverSLO",              # TTFT p99 over the SLO
    "OasisKVKVPoolNearlyFull",         # device KV pool nearly full
    "OasisKVStoreNearlyFull",          # host-memory store nearly full
    "OasisKVPrefetchMissRateHigh",     # prefetch miss rate high
    "OasisKVNoHealthyDecodeWorkers",   # no healthy decode workers
}


def alerts() -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule]


def test_promtool_check_config():
    # cwd matters: rule_files are relative to the config file's folder
    run([require_tool("promtool"), "check", "config", "prometheus.yml"], cwd=PROMETHEUS)


def test_promtool_check_rules():
    assert RULE_FILES
    run([require_tool("promtool"), "check", "rules", *map(str, RULE_FILES)])


def test_promtool_rule_unit_tests():
    assert RULE_TESTS
    result = run([require_tool("promtool"), "test", "rules", *map(str, RULE_TESTS)])
    assert "SUCCESS" in result.stdout + result.stderr


def test_required_alerts_exist_with_severity_and_text():
    by_name = {rule["alert"]: rule for rule in alerts()}
    assert REQUIRED_ALERTS <= by_name.keys()
    for name, rule in by_name.items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert "for" in rule, f"{name} would fire on a single evaluation"


def test_every_alert_has_a_firing_unit_test():
    fired = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])
    assert {rule["alert"] for rule in alerts()} <= fired


def test_rules_use_the_contract_metric_names():
    known = exposed_names()
    for rule in alerts():
        for name in re.findall(r"\boasiskv_[a-z0-9_]+", rule["expr"]):
            assert name in known, f"{rule['alert']}: {name} is not in the metrics contract"


def test_every_alert_aggregation_keeps_the_namespace():
    """One Prometheus often scrapes several releases (one per namespace): an aggregation without
    `namespace` let one release's healthy decode worker or clean traffic hide another's outage,
    and dropped the label saying which release alerts. The promtool cases with two namespaces
    show the behaviour; this catches a new rule that aggregates without it."""
    for rule in alerts():
        expr = " ".join(rule["expr"].split())
        for match in re.finditer(r"\b(sum|max|min|avg|count)\s*(by\s*\(([^)]*)\))?\s*\(", expr):
            grouping = match.group(3)
            assert grouping is not None and "namespace" in [g.strip() for g in grouping.split(",")], (
                f"{rule['alert']}: `{match.group(0)}` drops the namespace")
