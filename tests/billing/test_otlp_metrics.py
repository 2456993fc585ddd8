"""Billing's cost reaches a real OTLP receiver as ``infermeter.cost`` (USD), per team and model,
equal to the statement and to the spend on /metrics."""

from __future__ import annotations

import os

import polars as pl
import pytest
from prometheus_client import CollectorRegistry

from billing.api import create_app
from billing.metrics import SpendCollector
from billing.otlp_metrics import CostExport
from billing.serve import metrics_export
from billing.statement_cache import CachedChargeback
from infermeter.months import month_bounds
from infermeter.otlp import OtlpSettings
from infermeter.otlp_export import make_metrics_export
from tests.billing.conftest import NOV, OCT, batch, gpu_samples, usage
from tests.otlp_receiver import OtlpHttpReceiver

NOW = OCT + 10 * 86400.0  # ten days into October 2026
DEC = NOV + 30 * 86400


async def test_cost_per_team_and_model_month_to_date(ledger, config, monkeypatch):
    """Two teams on one GPU hour: their cost, summed per team, is the spend /metrics gives, and
    the points start at the month's first second."""
    ledger.ingest(batch("gpu_samples", gpu_samples(start=OCT + 3600, seconds=3600)), now=DEC)
    ledger.ingest(
        batch("usage", [usage("search", OCT + 3700, 300), usage("assistant", OCT + 3800, 600)]),
        now=DEC,
    )
    cache = CachedChargeback(ledger, config, ttl_seconds=60, clock=lambda: NOW)
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    with OtlpHttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        export = make_metrics_export(
            OtlpSettings("http/protobuf", 60.0),
            "infermeter-billing",
            "infermeter.billing",
            {},
            [CostExport(cache, clock=lambda: NOW).produce],
        )
        assert await export.export_once()
        points = receiver.latest()
        raw = receiver.metrics[-1].resource_metrics[0].scope_metrics[0].metrics[0]
    assert {(p.name, p.unit, p.kind, p.monotonic, p.cumulative) for p in points} == {
        ("infermeter.cost", "USD", "sum", False, True)
    }
    assert raw.sum.data_points[0].start_time_unix_nano == int(month_bounds("2026-10")[0] * 1e9)
    lines = cache.statement("2026-10").lines
    want = {
        (t, m): c / 100
        for t, m, c in lines.group_by("team", "model").agg(pl.col("total_cents").sum()).iter_rows()
    }
    got = {
        (p.attributes["infermeter.team"], p.attributes.get("infermeter.model")): p.value
        for p in points
    }
    assert got == pytest.approx(want)
    assert {team for team, _ in got} >= {"search", "assistant"}
    registry = CollectorRegistry()
    registry.register(SpendCollector(cache))
    for team in ("search", "assistant"):
        spent = registry.get_sample_value("infermeter_team_spend_usd", {"team": team})
        assert sum(v for (t, _), v in got.items() if t == team) == pytest.approx(spent)


def test_without_the_variables_billing_exports_nothing(ledger, config):
    """No OTEL_* variable: no export is made; asked for, one exporting the cost."""
    app = create_app(config, ledger)
    assert metrics_export(app, {}) is None
    assert (
        metrics_export(
            app, {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}
        )
        is None
    )
    export = metrics_export(app, {"OTEL_METRICS_EXPORTER": "otlp"})
    assert export is not None
    assert export.scope.name == "infermeter.billing"
