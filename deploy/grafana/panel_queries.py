"""Every PromQL expression of the OasisKV Grafana dashboards, ready to run against Prometheus.

Grafana expands macros such as `$__rate_interval` and the dashboards' `$namespace` variable
before a query reaches Prometheus; `render` does the same with fixed values so a test (or an
operator) can run each panel's query against a real Prometheus and see that it parses and
returns data:

    python deploy/grafana/panel_queries.py                        # list: one JSON object a line
    python deploy/grafana/panel_queries.py --prometheus http://127.0.0.1:9090

Standard library only, so it runs anywhere the dashboards are checked.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboards"

# Grafana's built-in variables that can appear inside PromQL; values are what a test scrape
# interval of about a second makes sensible.
DEFAULT_MACROS = {"__rate_interval": "15s", "__interval": "5s", "__range": "1h"}

# The dashboards' own variables, at what Grafana sends when All is selected (the allValue): `.*`
# also matches series without the label, as under docker compose, where nothing adds `namespace`.
DEFAULT_VARIABLES = {"namespace": ".*"}

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan", "atan2"}


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str  # the dashboard's uid
    panel_id: int
    panel_title: str
    ref_id: str
    expr: str
    legend_format: str = ""


def dashboard_files(directory: Path = DASHBOARD_DIR) -> list[Path]:
    return sorted(directory.glob("*.json"))


def iter_panels(panels: Iterable[dict]) -> Iterator[dict]:
    """Panels in layout order, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def iter_queries(dashboard: dict) -> Iterator[PanelQuery]:
    for panel in iter_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield PanelQuery(dashboard["uid"], panel["id"], panel.get("title", ""),
                                 target.get("refId", ""), target["expr"], target.get("legendFormat", ""))


def load_queries(paths: Iterable[Path] | None = None) -> list[PanelQuery]:
    queries: list[PanelQuery] = []
    for path in paths if paths is not None else dashboard_files():
        queries.extend(iter_queries(json.loads(Path(path).read_text())))
    return queries


def render(expr: str, macros: dict[str, str] | None = None) -> str:
    """Replace `$name` and `${name}` Grafana variables by fixed values."""
    values = {**DEFAULT_MACROS, **DEFAULT_VARIABLES, **(macros or {})}

    def substitute(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", substitute, expr)


def _blank(text: str, pattern: str, keep_ends: bool = False) -> str:
    """`text` with every match of `pattern` turned into spaces (its first and last character kept
    with `keep_ends`), so offsets into the result are offsets into `text`."""
    def spaces(match: re.Match) -> str:
        found = match.group(0)
        return found[0] + " " * (len(found) - 2) + found[-1] if keep_ends else " " * len(found)
    return re.sub(pattern, spaces, text)


def _code(expr: str) -> str:
    """`expr` with its strings and label matchers blanked (their quotes and braces kept), so
    neither is read as PromQL."""
    return _blank(_blank(expr, r'"(?:[^"\\]|\\.)*"', keep_ends=True), r"\{[^}]*\}", keep_ends=True)


def metric_selectors(expr: str) -> list[tuple[str, str]]:
    """Each metric selector of an expression as (metric name, its label matchers as written,
    "" when it has none), in order (a light PromQL scan, enough for dashboards: strings, label
    matchers, grouping clauses and range durations are not read for names)."""
    text = _blank(_code(expr), r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
    text = _blank(text, r"\[[^\]]*\]")
    selectors = []
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = match.group(0), text[match.end():]
        if rest.lstrip().startswith("(") or word.lower() in _KEYWORDS:
            continue
        matchers = ""
        if rest.lstrip().startswith("{"):
            start = match.end() + len(rest) - len(rest.lstrip())
            matchers = expr[start + 1:text.index("}", start)]
        selectors.append((word, matchers))
    return selectors


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects."""
    return {name for name, _ in metric_selectors(expr)}


def groupings(expr: str) -> list[tuple[str, tuple[str, ...]]]:
    """Each label list of an expression's aggregations and vector matchings as (keyword, labels),
    in order: `by`, `without`, `on`, `ignoring`, `group_left` and `group_right` clauses."""
    text = _code(expr)
    found = []
    for match in re.finditer(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        labels = tuple(label.strip() for label in match.group(2).split(",") if label.strip())
        found.append((match.group(1), labels))
    return found


def legend(legend_format: str, labels: dict[str, str]) -> str:
    """A series' name as Grafana's Prometheus data source makes it from a legendFormat: each
    `{{label}}` is the series' value of that label, an empty string where the series lacks it."""
    return re.sub(r"\{\{\s*(.+?)\s*\}\}", lambda match: labels.get(match.group(1), ""), legend_format)


def run_query(prometheus_url: str, expr: str, timeout_s: float = 10.0) -> dict:
    """One instant query; returns Prometheus' JSON answer (status, data or error)."""
    url = prometheus_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 400/422 carry a JSON error body
        return json.loads(exc.read() or b'{"status": "error", "error": "HTTP error"}')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dashboards", nargs="*", type=Path, help="dashboard JSON files (default: all)")
    parser.add_argument("--prometheus", help="run every query against this Prometheus URL")
    args = parser.parse_args(argv)
    failures = 0
    for query in load_queries(args.dashboards or None):
        record = asdict(query) | {"rendered": render(query.expr)}
        if args.prometheus:
            answer = run_query(args.prometheus, record["rendered"])
            record["status"] = answer.get("status")
            record["error"] = answer.get("error")
            record["series"] = len(answer.get("data", {}).get("result", []))
            failures += answer.get("status") != "success"
        print(json.dumps(record))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
