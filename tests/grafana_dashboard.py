"""deploy/grafana/dashboards/kvserve.json read as Grafana and Prometheus read it: every PromQL query (panels' and
variables'), Grafana's variables given values as Grafana would, parsed by a PromQL parser into the series each
selects and the labels it names."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvserve.json"
# what Grafana writes in place of each variable before Prometheus sees a query
VARIABLE_VALUES = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h", "tenant": ".*"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)")


@dataclass
class Query:
    where: str  # the panel's title (or the variable's name) and the query's refId
    expr: str
    series: set[str] = field(default_factory=set)  # the metric names it selects
    labels: set[str] = field(default_factory=set)  # the labels its matchers and groupings name


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries(dashboard: dict) -> list[Query]:
    found = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            found.append(parse(f"{panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = _LABEL_VALUES.fullmatch(query.strip())
            assert match, f"variable {variable['name']}: {query!r} is not label_values(metric, label)"
            found.append(Query(f"variable {variable['name']}", query, {match.group(1)}, {match.group(2)}))
    return found


def substitute(expr: str) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in VARIABLE_VALUES, f"{expr!r}: Grafana variable ${name} has no value here"
        return VARIABLE_VALUES[name]

    return _VARIABLE.sub(value, expr)


def parse(where: str, expr: str) -> Query:
    promql = pytest.importorskip(
        "promql_parser", reason="promql-parser is not installed (the test extra has it)"
    )
    query = Query(where, expr)
    try:
        tree = promql.parse(substitute(expr))
    except ValueError as error:
        pytest.fail(f"{where}: {expr!r} is not PromQL: {error}")

    def visit(node) -> None:
        if isinstance(node, promql.VectorSelector):
            assert node.name, f"{where}: a selector without a metric name"
            query.series.add(node.name)
            query.labels.update(m.name for m in node.matchers.matchers)
        elif isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            query.labels.update(node.modifier.labels)
        elif isinstance(node, promql.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            query.labels.update(matching.labels if matching is not None else [])
            query.labels.update(node.modifier.group_labels or [])

    promql.walk(tree, visit)
    return query
