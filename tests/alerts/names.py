"""Metric names: the ones a PromQL expression reads, and the ones infermeter's parts expose."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from alerts.autoscale.hooks import ScalingGauges
from collectors.loop import FleetCollector
from collectors.metrics import FleetMetrics
from infermeter.config import Config
from sidecar.budgets import BudgetMetrics
from sidecar.metrics import SidecarMetrics
from sidecar.shared_limits import SharedLimitsMetrics

FIXTURES = Path(__file__).parents[1] / "fixtures"
# Announced by billing for the spend, reconciliation and quarantine alerts and dashboards.
BILLING = {
    "infermeter_team_spend_usd",
    "infermeter_team_budget_usd",
    "infermeter_team_spend_forecast_usd",
    "infermeter_reconciliation_unattributed_share",
    "infermeter_billing_quarantined_records_total",
    "infermeter_billing_statement_error_lines",
}

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_RANGES = re.compile(r"\[[^\]]*\]")
_OFFSETS = re.compile(r"\boffset\s+-?[0-9][0-9a-z]*")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}


def metric_names(expr: str) -> set[str]:
    """Every metric (or recorded) name ``expr`` selects: identifiers that are not calls or labels."""
    text = _STRINGS.sub('""', expr)
    text = _OFFSETS.sub("", _RANGES.sub("", _GROUPING.sub("", _MATCHERS.sub("", text))))
    names = set()
    for m in _IDENT.finditer(text):
        following = text[m.end() :].lstrip()
        if following.startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def _sample_names(collector: Collector) -> set[str]:
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}
    names = set()
    for family in collector.collect():
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def exposed_names(config: Config) -> set[str]:
    """Series names the sidecar, the collector, the autoscaler, vLLM (captured) and billing
    expose."""
    registry = SidecarMetrics().registry
    SharedLimitsMetrics(registry)
    BudgetMetrics(registry)
    sidecar = _sample_names(registry)
    collector = _sample_names(FleetMetrics(FleetCollector(config, [], [])))
    text = (FIXTURES / "vllm-0.32-metrics.prom").read_text()
    vllm = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    autoscaler = _sample_names(ScalingGauges().registry)
    return sidecar | collector | autoscaler | vllm | BILLING
