"""Samples physically bounded: what no board or engine can report is refused with its reason,
counted on /metrics, and never billed; a ledger that already holds such a row still serves its
month.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import polars as pl
import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing.api import create_app
from billing.bounds import COUNTER_SLACK_SECONDS, POWER_MARGIN, SampleBounds
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from infermeter.boards import UNKNOWN_BOARD_WATTS, board_watts
from infermeter.config import Config
from infermeter.months import month_bounds, month_of
from tests.billing.conftest import NOV, OCT, batch, gpu_samples
from tests.servers import serving

ADMIN, METRICS, INGEST, SEARCH = (
    "im-demo-admin",
    "im-demo-metrics",
    "im-demo-ingest",
    "im-demo-search",
)
NOW = NOV + 86_400.0
L40S = 350.0  # W, the board limit of the demo's small-model GPU
_ids = itertools.count()


def sample(**fields: Any) -> dict[str, Any]:
    """One 10-second reading of small-0's L40S at 200 W (2 kJ), with ``fields`` changed."""
    return gpu_samples("small-0", OCT + 3600, 10.0, 10.0)[0] | fields


def engine(**fields: Any) -> dict[str, Any]:
    """One reading of small-0's engine, with ``fields`` changed."""
    return {
        "sample_id": f"eng-{next(_ids)}",
        "replica": "small-0",
        "model": "chat-small",
        "timestamp": OCT + 3600,
        "requests_running": 2.0,
        "requests_waiting": 0.0,
        "kv_cache_usage": 0.3,
        "prompt_tokens_total": 1000.0,
        "generation_tokens_total": 500.0,
    } | fields


def refused(ledger: Ledger, kind: str, record: dict[str, Any]) -> list[str]:
    """The reasons ``record`` was refused for (empty: it was kept)."""
    result = ledger.ingest(batch(kind, [record]), now=NOW)
    return [r.reason for r in result.rejected]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"energy_joules": 1e15}, "energy_joules: 1e+15 J is more than the board can draw in 10 s"),
        ({"energy_joules": 1e22}, "energy_joules: 1e+22 J is more than the board can draw in 10 s"),
        (
            {"power_watts": 5000.0},
            "power_watts: 5000 W is more than the board can draw (350 W for L40S, +25%)",
        ),
        ({"power_watts": -1.0}, "power_watts: negative"),
        ({"energy_joules": -1.0}, "energy_joules: negative"),
        ({"interval_seconds": -10.0}, "interval_seconds: negative"),
        (
            {"interval_seconds": 900.0},
            "interval_seconds: a measured interval of 900 s, longer than 600 s (a longer one is a gap)",
        ),
        (
            {"interval_seconds": 200_000.0, "gap": True, "energy_joules": None},
            "interval_seconds: longer than 86400 s",
        ),
        ({"utilization": 1.5}, "utilization: not between 0 and 1"),
        (
            {"utilization": 55.0},
            "utilization: not between 0 and 1",
        ),  # percent where a fraction goes
        ({"memory_used_mib": 1e12}, "memory: more than 1048576 MiB on one board"),
        ({"xid_errors": -3}, "xid_errors: negative"),
    ],
)
def test_a_gpu_sample_no_board_can_report_is_refused_with_its_reason(ledger, fields, reason):
    """Each bound refuses the sample and says which field, by how much and against what."""
    reasons = refused(ledger, "gpu_samples", sample(**fields))
    assert len(reasons) == 1
    assert reasons[0].startswith(reason), reasons


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"prompt_tokens_total": 1e22}, "prompt_tokens_total: not between 0 and 1e+15"),
        ({"generation_tokens_total": -5.0}, "generation_tokens_total: not between 0 and 1e+15"),
        ({"preemptions_total": 1e300}, "preemptions_total: not between 0 and 1e+15"),
        ({"kv_cache_usage": 3.0}, "kv_cache_usage: not between 0 and 1"),
        ({"requests_waiting": 1e9}, "request counts above 1,000,000"),
        ({"kv_cache_tokens": 1e20}, "kv_cache_tokens: not between 0 and 1e+15"),
    ],
)
def test_an_engine_sample_no_engine_can_report_is_refused_with_its_reason(ledger, fields, reason):
    """Counters are non-negative and bounded, gauges within what they measure."""
    assert refused(ledger, "engine_samples", engine(**fields)) == [reason]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"interval_seconds": 0.0, "energy_joules": 0.0},  # a board's first reading
        {"interval_seconds": 3600.0, "gap": True, "energy_joules": None},  # a gap: time, no energy
        {"power_watts": L40S * (1 + POWER_MARGIN)},  # a burst over the limit, within the margin
        # A counter refreshed late by dcgm-exporter: 10 s of interval carrying 40 s at the limit.
        {"energy_joules": L40S * 40.0},
        {"gpu_model": "NVIDIA H100 80GB HBM3", "power_watts": 690.0, "energy_joules": 6900.0},
        {"gpu_model": "A100-SXM4-80GB", "power_watts": 395.0},
        {"interval_seconds": 540.0, "energy_joules": L40S * 540.0},  # a restarted collector's
    ],
)
def test_a_sample_a_board_can_report_is_kept(ledger, fields):
    """Readings at the edges of what real boards and the collector do are not refused."""
    assert refused(ledger, "gpu_samples", sample(**fields)) == []


def test_energy_is_bounded_by_power_over_the_interval_and_the_counter_slack(ledger):
    """The energy bound is the board's limit with its margin over the interval plus the slack."""
    most = L40S * (1 + POWER_MARGIN) * (10.0 + COUNTER_SLACK_SECONDS)
    assert refused(ledger, "gpu_samples", sample(energy_joules=most * 0.999)) == []
    over = refused(ledger, "gpu_samples", sample(sample_id="over", energy_joules=most * 1.001))
    assert len(over) == 1
    assert over[0].startswith("energy_joules:")


def test_boards_the_table_does_not_name_are_held_to_the_largest_board():
    """An unknown product name is bounded by the largest board known, not let through."""
    assert board_watts("NVIDIA H100 PCIe") == 350.0
    assert board_watts("nvidia h100 80gb hbm3") == 700.0
    assert board_watts("L4") == 72.0
    assert board_watts("RTX 4000 Ada Generation") == 130.0
    assert board_watts("Quantum X9") is None
    limits = SampleBounds().limits()
    assert limits[""] == UNKNOWN_BOARD_WATTS == 1200.0


def test_the_configuration_overrides_the_table_and_its_gap_limit_widens_intervals(
    config: Config,
) -> None:
    """billing.gpu_max_watts wins over simulator.gpus, which wins over the table."""
    data = config.model_dump(mode="json")
    data["billing"]["gpu_max_watts"] = {"L40S": 100.0, "Quantum X9": 2000.0}
    data["collector"]["scrape_interval_seconds"] = 300.0
    bounds = SampleBounds.of(Config.model_validate(data))
    limits = bounds.limits()
    assert (limits["L40S"], limits["QUANTUMX9"]) == (100.0, 2000.0)
    assert limits["H100"] == config.simulator.gpus["H100"].max_watts == 700.0
    assert bounds.max_measured_seconds == 900.0  # 3 intervals of 300 s
    ledger = Ledger.open(":memory:", ["search"], {}, bounds=bounds)
    try:
        assert refused(ledger, "gpu_samples", sample(power_watts=200.0))[0].startswith(
            "power_watts: 200 W is more than the board can draw (100 W for L40S"
        )
        quantum = sample(sample_id="q", gpu_model="Quantum X9", power_watts=2400.0)
        assert refused(ledger, "gpu_samples", quantum) == []
        slow = sample(sample_id="slow", interval_seconds=800.0, power_watts=50.0, energy_joules=4e4)
        assert refused(ledger, "gpu_samples", slow) == []
    finally:
        ledger.close()


def test_a_refused_sample_costs_nothing(ledger, config):
    """The month's fleet cost is the same with the absurd samples sent as without them."""
    chargeback = Chargeback(ledger, config)
    ledger.ingest(batch("gpu_samples", gpu_samples("small-0", OCT + 3600, 600.0)), now=NOW)
    before = chargeback.statement("2026-10")
    for energy in (1e15, 1e22):
        assert refused(
            ledger, "gpu_samples", sample(sample_id=f"absurd-{energy}", energy_joules=energy)
        )
    after = chargeback.statement("2026-10")
    assert after.fleet_cents == before.fleet_cents
    assert after.reconciles


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """The billing API over the in-memory ledger, on a loopback port."""
    async with serving(create_app(config, ledger), lifespan="off") as url:
        yield url


def _sample_value(text: str, name: str, labels: dict[str, str]) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


async def test_absurd_samples_over_http_are_refused_and_counted_by_reason(billing):
    """1e15 and 1e22 J are refused in the answer, and /metrics counts them under their field."""
    samples = [sample(sample_id=f"absurd-{e}", energy_joules=e) for e in (1e15, 1e22)]
    async with httpx.AsyncClient(base_url=billing) as client:
        answer = await client.post(
            "/v1/ingest",
            content=batch("gpu_samples", samples),
            headers={"authorization": f"Bearer {INGEST}"},
        )
        assert answer.status_code == 200
        body = answer.json()
        text = (await client.get("/metrics", headers={"authorization": f"Bearer {METRICS}"})).text
    assert body["accepted"] == 0
    assert [r["id"] for r in body["rejected"]] == [s["sample_id"] for s in samples]
    assert all(r["reason"].startswith("energy_joules: ") for r in body["rejected"])
    labels = {"kind": "gpu_samples", "reason": "energy_joules"}
    assert _sample_value(text, "infermeter_billing_ingest_rejections_total", labels) == 2.0


@pytest.fixture
def absurd_ledger(config: Config) -> Iterator[Ledger]:
    """A ledger that took one absurd sample before ingest checked bounds: a sample of this month
    of 1e22 J on small-0's board, beside ten minutes of ordinary ones and some usage."""
    ledger = Ledger.open(
        ":memory:", [t.name for t in config.teams], {}, bounds=SampleBounds({"L40S": 1e30})
    )
    now = time.time()
    start = max(month_bounds(month_of(now))[0], now - 900)
    normal = gpu_samples("small-0", start, 600.0)
    absurd = gpu_samples("small-1", start + 300, 10.0, gpu="1")[0] | {"energy_joules": 1e22}
    for records in (normal, [absurd]):
        assert ledger.ingest(batch("gpu_samples", records), now=now).rejected == []
    yield ledger
    ledger.close()


async def test_a_month_holding_an_absurd_row_never_answers_500(
    config: Config, absurd_ledger: Ledger
) -> None:
    """Statement, CSV, FOCUS, spend and /metrics all answer, for admin and team keys alike; the
    statement names the instance whose cost is out of range, and the rest of the month stands."""
    month = month_of(time.time())
    routes = [
        f"/v1/chargeback/{month}",
        f"/v1/chargeback/{month}.csv",
        f"/v1/chargeback/{month}.focus.csv",
        f"/v1/chargeback/{month}.focus.csv?version=1.2",
        "/v1/spend",
        "/v1/query/spend",
    ]
    async with (
        serving(create_app(config, absurd_ledger), lifespan="off") as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        for key in (ADMIN, SEARCH):
            for route in routes:
                answer = await client.get(route, headers={"authorization": f"Bearer {key}"})
                assert answer.status_code == 200, (key, route, answer.text[:300])
        metrics = await client.get("/metrics", headers={"authorization": f"Bearer {METRICS}"})
        assert metrics.status_code == 200
        statement = (
            await client.get(
                f"/v1/chargeback/{month}", headers={"authorization": f"Bearer {ADMIN}"}
            )
        ).json()
    assert statement["reconciles"] is True
    errors = [
        line for line in statement["lines"] if line["model"].startswith("(error) cost out of range")
    ]
    assert len(errors) == 1
    assert "instance small-1 (group small-1)" in errors[0]["model"]
    assert errors[0]["total_cents"] == 0
    assert statement["fleet_cents"] > 0  # small-0's ten minutes are still billed
    labels = {"reason": "cost_out_of_range"}
    assert _sample_value(metrics.text, "infermeter_billing_statement_error_lines", labels) == 1.0


def test_the_statement_of_a_month_holding_an_absurd_row_reconciles(
    config: Config, absurd_ledger: Ledger
) -> None:
    """Lines add up to the fleet cost without the out-of-range instance, to the cent."""
    statement = Chargeback(absurd_ledger, config).statement(month_of(time.time()))
    assert statement.reconciles
    priced = statement.lines.filter(~pl.col("model").str.starts_with("(error)"))
    assert int(priced["total_cents"].sum()) == statement.fleet_cents
