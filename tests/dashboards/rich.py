"""A ledger with the fleet's whole life in it, for the page-by-page browser tests.

``records``' hour of the demo fleet, plus what a new user meets in a real one: a spare GPU (no
replica runs on it), tokens an engine counted that no record carries (the platform's
unattributed line), two scaling decisions, and last month's usage closed half an hour ago (a
month close on the charts). ``alerting_prometheus`` is a real Prometheus whose one rule fires
from its first evaluation, for the alert marks.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from billing.chargeback import Chargeback
from billing.ledger import Ledger
from infermeter.config import Config
from infermeter.months import month_bounds, month_of
from tests.alerts.prometheus import running_prometheus
from tests.billing.conftest import scaling_decision
from tests.dashboards import records

# Tokens small-0's engine counted that no usage record carries: its unattributed tokens.
UNATTRIBUTED_TOKENS = 7
ALERT = "InfermeterDashboardTestAlert"
_ids = itertools.count()


def _keep(ledger: Ledger, kind: str, rows: list[dict[str, Any]]) -> None:
    result = ledger.ingest(orjson.dumps({kind: rows}))
    assert (result.accepted, result.rejected) == (len(rows), []), result.rejected[:3]


def _counting_engine(fleet: records.Fleet, replica: str) -> list[dict[str, Any]]:
    """``replica``'s vLLM counters every 10 s: its requests' tokens so far, and from the middle
    of the hour ``UNATTRIBUTED_TOKENS`` more that no record carries."""
    mine = [r for r in fleet.usage if r["replica"] == replica]
    out = []
    for k in range(records.MINUTES * 6 + 1):
        t = fleet.start + k * 10.0
        prompt = sum(r["prompt_tokens"] for r in mine if r["first_token_at"] <= t)
        done = sum(r["completion_tokens"] for r in mine if r["finished_at"] <= t)
        extra = UNATTRIBUTED_TOKENS if t >= fleet.start + 1800 else 0
        out.append(
            {
                "sample_id": f"rich-e-{next(_ids)}",
                "replica": replica,
                "model": records.REPLICAS[replica][0],
                "timestamp": t,
                "requests_running": 4.0,
                "requests_waiting": 1.0,
                "kv_cache_usage": 0.25,
                "prompt_tokens_total": float(prompt),
                "generation_tokens_total": float(done + extra),
            }
        )
    return out


def _spare_gpu(fleet: records.Fleet) -> list[dict[str, Any]]:
    """GPU 2 of node-b, which no replica runs on, seen every 10 s of the hour."""
    return [
        {
            "sample_id": f"rich-g-{k}",
            "node": "node-b",
            "gpu": "2",
            "uuid": "GPU-node-b-2",
            "gpu_model": "L40S",
            "replica": None,
            "model": None,
            "timestamp": fleet.start + (k + 1) * 10.0,
            "interval_seconds": 10.0,
            "utilization": 0.0,
            "power_watts": 60.0,
            "energy_joules": 600.0,
            "memory_used_mib": 0.0,
            "memory_free_mib": 48000.0,
        }
        for k in range(records.MINUTES * 6)
    ]


def _decisions(fleet: records.Fleet) -> list[dict[str, Any]]:
    out = []
    for minutes, previous, desired, why in (
        (10, 2, 3, "queue 12 > 10 for 35 s (>= 30 s): scale up"),
        (40, 3, 2, "GPUs 12 % busy for 5 m: scale down"),
    ):
        out.append(scaling_decision(fleet.start + minutes * 60, previous, desired, why))
    return out


def open_ledger(
    config: Config, path: Path, now: float | None = None
) -> tuple[Ledger, records.Fleet]:
    """The rich ledger at ``path``, and the hour of ``records`` it holds."""
    now = time.time() if now is None else now
    fleet = records.build(records.recent_start(now))
    fleet = records.Fleet(
        fleet.start,
        fleet.usage,
        fleet.gpu,
        [e for e in fleet.engine if e["replica"] != "small-0"],
    )
    ledger = records.open_ledger(config, path, fleet)
    _keep(ledger, "engine_samples", _counting_engine(fleet, "small-0"))
    _keep(ledger, "gpu_samples", _spare_gpu(fleet))
    _keep(ledger, "scaling_decisions", _decisions(fleet))
    # Last month: one hour of the same fleet, closed half an hour ago.
    last_month = month_of(month_bounds(month_of(now))[0] - 1)
    before = records.build(int(month_bounds(last_month)[0]) + 86400)
    for kind, rows in (("usage", before.usage), ("gpu_samples", before.gpu)):
        _keep(
            ledger,
            kind,
            [
                r
                | {
                    "request_id"
                    if kind == "usage"
                    else "sample_id": f"old-{r.get('request_id') or r['sample_id']}"
                }
                for r in rows
            ],
        )
    Chargeback(ledger, config).close(last_month, now=now - 1800)
    return ledger, fleet


@contextlib.contextmanager
def alerting_prometheus(tmp: Path) -> Iterator[str]:
    """A real Prometheus evaluating, every second, one rule that fires at once; yields its URL."""
    rules = tmp / "dashboard-test.rules.yml"
    rules.write_text(
        "groups:\n- name: dashboard-test\n  rules:\n"
        f"  - alert: {ALERT}\n    expr: vector(1)\n    labels: {{severity: warning, model: chat-small}}\n"
        "    annotations:\n      summary: queue of {{ $labels.model }} over 10 for the test\n"
    )
    with running_prometheus(tmp, [], [str(rules)]) as url:
        yield url
