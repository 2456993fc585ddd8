"""The Grafana dashboard: valid JSON, built only on recording rules and known metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from alerts.rules import render
from tests.alerts.names import BILLING, exposed_names, metric_names

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "infermeter-dashboard.json"


def _load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            # label_values(<selector>, <label>): Grafana's function, not PromQL
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["definition"])
            assert match, var["definition"]
            exprs.append(match.group(1))
    return exprs


def test_dashboard_is_valid_json_with_the_promised_panels():
    """It parses, and has the SLA, speed, errors, queue, GPU and spend panels."""
    dashboard = _load()
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "TTFT p95 vs SLA",
        "Output tokens/s",
        "Error ratio vs SLA",
        "Queue depth",
        "GPU utilization",
        "GPU power",
        "Spend vs budget",
    } <= titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "infermeter-overview"


def test_dashboard_has_the_engine_efficiency_panels():
    """Batch occupancy, KV-cache use, preemptions, prefix-cache hits and cost per 1M tokens are drawn."""
    titles = {p["title"] for p in _load()["panels"]}
    assert {
        "Batch occupancy",
        "KV-cache use",
        "Preemptions",
        "Prefix-cache hit rate",
        "GPU cost per 1M tokens",
    } <= titles


def test_every_query_uses_the_datasource_variable():
    """Panels and targets read the chosen Prometheus, so the file imports into any Grafana."""
    for p in _load()["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]


def test_every_expression_reads_only_recorded_or_known_metrics(config):
    """Each name a panel queries is a rendered recording rule or one of billing's gauges."""
    recorded = {
        r["record"] for f in render(config).values() for g in f for r in g["rules"] if "record" in r
    }
    unknown = {n for e in _exprs(_load()) for n in metric_names(e)} - recorded - BILLING
    assert unknown == set()


def test_sli_panels_are_built_on_recording_rules(config):
    """Outside the spend panel, every query names a recording rule (level:metric:operations)."""
    for p in _load()["panels"]:
        for t in p.get("targets", []):
            names = metric_names(t["expr"])
            assert names, t["expr"]
            if p["title"] != "Spend vs budget":
                assert all(n.count(":") == 2 for n in names), (p["title"], t["expr"])


def test_rules_read_only_metrics_that_infermeter_exposes(config):
    """Every raw metric the rules read is exposed by the sidecar, collector, vLLM or billing."""
    groups = render(config)
    recorded = {
        r["record"] for f in groups.values() for g in f for r in g["rules"] if "record" in r
    }
    read = {
        n for f in groups.values() for g in f for r in g["rules"] for n in metric_names(r["expr"])
    }
    assert read - recorded - exposed_names(config) == set()
    assert "vllm:num_requests_waiting" in read


def test_metric_names_finds_selectors_not_labels_or_functions():
    """The name extractor skips functions, grouping labels, matchers, ranges, offsets and keywords."""
    expr = (
        'sum by (model, le) (rate(a_bucket{status=~"x|y"}[5m])) / on (model) '
        "group_left b:c:d > bool 0 or vector(1) or e offset 10m"
    )
    assert metric_names(expr) == {"a_bucket", "b:c:d", "e"}
