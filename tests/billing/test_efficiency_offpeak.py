"""Off-peak advice: a batch team's work moved out of the peak hours, priced by hand."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from billing.api import create_app
from billing.efficiency.advice import Policy
from billing.efficiency.cli import table
from billing.efficiency.offpeak import TeamWorkload, is_batch
from billing.ledger import Ledger
from infermeter.config import Config
from tests.billing.conftest import OCT, gpu_samples, usage
from tests.billing.test_efficiency import engine, fill, kinds, report
from tests.servers import serving

PEAK = range(8, 12)
PEAK_HOURS = ["08:00-09:00", "09:00-10:00", "10:00-11:00", "11:00-12:00"]


def _day(ledger: Ledger, quiet: float = 10, analytics: int = 1, search: int = 1,
         stream: bool = False) -> None:  # fmt: skip
    """small-0 and small-1 (one L40S each, $1.60/h) for a day, each running 100 sequences 08-12, ``quiet`` else.

    In each peak hour ``analytics`` and ``search`` have that many hour-long requests in flight,
    so analytics holds ``analytics / (analytics + search)`` of every peak minute.
    """
    samples: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    for hour in range(24):
        start = OCT + hour * 3600
        running = 100 if hour in PEAK else quiet
        for replica in ("small-0", "small-1"):
            samples += engine(replica, running, start=start)
        if hour in PEAK:
            records += [usage("analytics", start, 3600.0, stream=stream) for _ in range(analytics)]
            records += [usage("search", start, 3600.0) for _ in range(search)]
        else:
            records.append(usage("search", start, 3600.0))
    records.append(usage("search", OCT, 10.0, replica="small-1"))  # small-1 serves too
    gpus = []
    for replica, gpu in (("small-0", "0"), ("small-1", "1")):
        gpus += gpu_samples(replica, start=OCT, seconds=86400, every=60, watts=0.0, gpu=gpu)
    fill(ledger, usage=records, gpu_samples=gpus, engine_samples=samples)


def _declared(config: Config, workload: str) -> Config:
    """``config`` with the analytics team's ``workload`` set."""
    teams = [t.model_copy(update={"workload": workload}) if t.name == "analytics" else t
             for t in config.teams]  # fmt: skip
    return config.model_copy(update={"teams": teams})


def test_a_batch_team_holding_half_the_peak_is_moved_off_peak(ledger, config):
    """analytics holds 100 of the peak's 200 sequences: without it 08-12 needs one engine, 4 engine-hours a day and a start-up saved."""
    _day(ledger)
    found = report(ledger, config)
    [rec] = kinds(found, "off_peak")
    assert (rec.team, rec.model) == ("analytics", "chat-small")
    assert rec.evidence["share_of_peak"] == pytest.approx(0.5)
    assert rec.evidence["peak_hours"] == PEAK_HOURS
    assert rec.evidence["engines_needed_by_hour"] == [1] * 8 + [2] * 4 + [1] * 12
    assert rec.evidence["engines_needed_by_hour_after"] == [1] * 24
    # 4 peak hours x 100 sequences; each quiet hour has 128 / 1.25 - 20 = 82.4 sequences of room.
    assert rec.evidence["sequence_hours_moved"] == pytest.approx(400)
    assert rec.action["move_from"] == PEAK_HOURS
    assert [m["sequence_hours"] for m in rec.action["move_to"]] == pytest.approx(
        [82.4, 82.4, 82.4, 82.4, 70.4]
    )
    # 4 engine-hours at $1.60, plus the 180 s start-up at 08:00 the flat day no longer pays.
    assert rec.saving_usd_per_month == pytest.approx((4 * 1.60 + 0.05 * 1.60) * 730 / 24)
    [schedule] = kinds(found, "schedule")  # 20 quiet engine-hours, less the same start-up
    assert schedule.saving_usd_per_month == pytest.approx((20 * 1.60 - 0.05 * 1.60) * 730 / 24)
    total = schedule.saving_usd_per_month + rec.saving_usd_per_month  # the day on one engine
    assert total == pytest.approx(24 * 1.60 * 730 / 24)


def test_a_team_that_streams_is_not_batch_work(ledger, config):
    """The same load sent streamed is someone watching: no off-peak advice."""
    _day(ledger, stream=True)
    assert kinds(report(ledger, config), "off_peak") == []


def test_a_declared_batch_team_is_moved_even_when_it_streams(ledger, config):
    """teams[].workload: batch stands for the measured rule."""
    _day(ledger, stream=True)
    [rec] = kinds(report(ledger, _declared(config, "batch")), "off_peak")
    assert rec.evidence["workload"] == "batch"


def test_a_declared_interactive_team_is_never_moved(ledger, config):
    """teams[].workload: interactive keeps the team's unstreamed work where it is."""
    _day(ledger)
    assert kinds(report(ledger, _declared(config, "interactive")), "off_peak") == []


def test_no_advice_when_the_peak_needs_its_engines_without_the_team(ledger, config):
    """analytics holds a tenth of the peak: the other 180 sequences still need two engines."""
    _day(ledger, analytics=1, search=9)
    assert kinds(report(ledger, config), "off_peak") == []


def test_no_advice_when_the_work_does_not_fit_off_peak(ledger, config):
    """Quiet hours running 100 of 102.4 sequences have room for 48 of the 400 sequence-hours."""
    _day(ledger, quiet=50)
    assert kinds(report(ledger, config), "off_peak") == []


def test_a_team_sees_its_own_off_peak_advice(ledger, config):
    """The advice is about analytics' requests, so analytics' own view carries it."""
    _day(ledger)
    found = report(ledger, config, team="analytics")
    assert [r.kind for r in found.recommendations] == ["off_peak"]
    assert "[off_peak]" in table(found.to_json())


async def test_the_api_gives_the_team_its_off_peak_advice(ledger, config):
    """GET /v1/efficiency/{month} with analytics' key carries the advice, priced as read_report prices it."""
    _day(ledger)
    async with serving(create_app(config, ledger), lifespan="off") as url:
        headers = {"authorization": "Bearer im-demo-analytics"}
        async with httpx.AsyncClient(base_url=url, headers=headers) as client:
            body = (await client.get("/v1/efficiency/2026-10")).json()
    [rec] = body["recommendations"]
    assert (rec["kind"], rec["team"], rec["action"]["move_from"]) == (
        "off_peak",
        "analytics",
        PEAK_HOURS,
    )
    assert rec["saving_usd_per_month"] == pytest.approx(197.10)


@pytest.mark.parametrize(
    ("unstreamed", "declared", "batch"),
    [
        (8, "auto", True),
        (7, "auto", False),
        (0, "batch", True),
        (10, "interactive", False),
    ],
)
def test_batch_work_is_declared_or_mostly_unstreamed(unstreamed, declared, batch):
    """auto: at least 80% of requests unstreamed; a declared workload stands for the rule."""
    w = TeamWorkload("chat-small", "analytics", 10, unstreamed)
    assert is_batch(w, declared, Policy()) is batch
