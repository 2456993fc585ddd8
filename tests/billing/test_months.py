"""Closed months are immutable; late records become adjustments in the next open month."""

from __future__ import annotations

import polars as pl
import pytest

from billing.chargeback import Chargeback
from billing.ledger import Ledger, LedgerError
from tests.billing.conftest import NOV, OCT, batch, gpu_samples, usage

AFTER_OCT = NOV + 86400  # 2026-11-02: October has ended
DEC = NOV + 30 * 86400


def _fill(ledger: Ledger, month_start: float) -> None:
    ledger.ingest(
        batch("gpu_samples", gpu_samples(start=month_start + 3600, seconds=3600)), now=DEC
    )
    ledger.ingest(
        batch(
            "usage",
            [usage("search", month_start + 3700, 300), usage("assistant", month_start + 3800, 600)],
        ),
        now=DEC,
    )


def test_an_open_month_reconciles_to_the_fleet_cost(ledger, config):
    """Lines add up to the fleet cost of the month, to the cent."""
    _fill(ledger, OCT)
    statement = Chargeback(ledger, config).statement("2026-10")
    assert statement.fleet_cents == 164  # one L40S hour at $1.60 + 0.2 kWh x $0.14 x 1.35 = $1.6378
    assert statement.reconciles
    assert set(statement.lines["team"]) == {"search", "assistant"}


def test_closing_freezes_the_statement(ledger, config):
    """After close, a late October record does not change October's statement."""
    _fill(ledger, OCT)
    cb = Chargeback(ledger, config)
    closed = cb.close("2026-10", now=AFTER_OCT)
    ledger.ingest(batch("usage", [usage("research", OCT + 4000, 900)]), now=AFTER_OCT)
    again = cb.statement("2026-10")
    assert again.closed
    assert again.lines.equals(closed.lines)
    assert "research" not in again.lines["team"].to_list()


def test_a_late_record_becomes_an_adjustment_in_the_next_open_month(ledger, config):
    """November carries October's correction as adjustment lines that net to zero cost."""
    _fill(ledger, OCT)
    cb = Chargeback(ledger, config)
    cb.close("2026-10", now=AFTER_OCT)
    ledger.ingest(batch("usage", [usage("research", OCT + 4000, 900)]), now=AFTER_OCT)
    _fill(ledger, NOV)
    nov = cb.statement("2026-11")
    adjustments = nov.lines.filter(pl.col("for_month") == "2026-10")
    assert "research" in adjustments["team"].to_list()
    research = adjustments.filter(pl.col("team") == "research").row(0, named=True)
    assert research["requests"] == 1
    assert research["total_cents"] > 0
    # October's fleet cost did not change, so what research now owes others are credited.
    assert nov.adjustment_cents == 0
    assert adjustments["total_cents"].sum() == 0
    assert nov.reconciles


def test_adjustments_are_issued_once(ledger, config):
    """Closing November freezes October's adjustment; December does not repeat it."""
    _fill(ledger, OCT)
    cb = Chargeback(ledger, config)
    cb.close("2026-10", now=AFTER_OCT)
    ledger.ingest(batch("usage", [usage("research", OCT + 4000, 900)]), now=AFTER_OCT)
    _fill(ledger, NOV)
    cb.close("2026-11", now=DEC + 86400)
    dec = cb.statement("2026-12")
    assert dec.lines.filter(pl.col("for_month") == "2026-10").height == 0


def test_late_gpu_samples_adjust_the_fleet_cost(ledger, config):
    """Samples arriving for a closed month add their cost as an adjustment, and reconcile."""
    _fill(ledger, OCT)
    cb = Chargeback(ledger, config)
    cb.close("2026-10", now=AFTER_OCT)
    ledger.ingest(
        batch("gpu_samples", gpu_samples(start=OCT + 7200, seconds=3600, gpu="1")), now=AFTER_OCT
    )
    nov = cb.statement("2026-11")
    assert nov.adjustment_cents == 164
    assert nov.reconciles


def test_a_month_cannot_close_before_it_ends(ledger, config):
    """Closing the current month is refused with the date it can be closed from."""
    with pytest.raises(LedgerError, match="has not ended yet"):
        Chargeback(ledger, config).close("2026-11", now=NOV + 3600)


def test_months_close_in_order(ledger, config):
    """November cannot close while October, which has data, is open."""
    _fill(ledger, OCT)
    _fill(ledger, NOV)
    with pytest.raises(LedgerError, match="close 2026-10 first"):
        Chargeback(ledger, config).close("2026-11", now=DEC + 86400)


def test_a_month_closes_once(ledger, config):
    """A second close of the same month is refused."""
    _fill(ledger, OCT)
    cb = Chargeback(ledger, config)
    cb.close("2026-10", now=AFTER_OCT)
    with pytest.raises(LedgerError, match="already closed"):
        cb.close("2026-10", now=AFTER_OCT)


def test_spend_forecasts_the_month_end(ledger, config):
    """Half-way through November, a team's forecast is twice what it has spent."""
    _fill(ledger, NOV)
    middle = NOV + 15 * 86400
    spend = {s.team: s for s in Chargeback(ledger, config).spend(now=middle)}
    assert spend["search"].spent_usd > 0
    assert spend["search"].forecast_usd == pytest.approx(spend["search"].spent_usd * 2, abs=0.01)
    assert spend["search"].budget_usd == 6000
    assert spend["research"].spent_usd == 0
