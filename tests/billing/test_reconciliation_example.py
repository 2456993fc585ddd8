"""The worked example of docs/billing.md's "Reconciliation" section, number for number."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from billing import reconciled
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.reconciliation import unattributed_model
from infermeter.config import Config
from tests.billing.conftest import OCT, usage
from tests.billing.test_reconciliation import HOUR, engine_samples, fill, row

ONE = OCT + HOUR  # 01:00:00 UTC on 2026-10-01


def example() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The records and the engine's readings of the example."""
    early = [usage("search", ONE + s, 10.0) for s in (10.0, 40.0, 70.0)]  # before 01:02:00
    two = usage("search", ONE + 600.0, 10.0, completion_tokens=100, choices=2)  # 01:10:00, n=2
    hung = usage(
        "assistant",
        ONE + 1205.0,
        10.0,
        completion_tokens=20,  # 01:20:05-01:20:15
        status="client_aborted",
        finish_reason=None,
        usage_exact=False,
    )
    records = [*early, two, hung]
    extra = [
        (ONE + 1215.5, 0, 8),  # vLLM's 8 tokens after the hang-up
        (ONE + 1805.0, 100, 50),  # 01:30:05: a request whose record was lost
    ]
    # The collector read the engine from 01:02:00 on, every minute.
    engine = engine_samples(records, ONE + 60.0, OCT + 3 * HOUR, extra=extra)
    return records, engine


@pytest.fixture
def worked(ledger: Ledger) -> Ledger:
    """The example's ledger."""
    records, engine = example()
    fill(ledger, records, engine)
    return ledger


def test_the_hours_row(worked: Ledger) -> None:
    """Engine 578 against ledger 420: 8 hang-up tokens, 150 unattributed, 3 requests unreconciled."""
    one = row(reconciled.reconciled(worked, OCT, OCT + 3 * HOUR), 1)
    got = {
        k: one[k]
        for k in (
            "engine_prompt_tokens",
            "engine_completion_tokens",
            "ledger_prompt_tokens",
            "ledger_completion_tokens",
            "difference_tokens",
            "hangup_prompt_tokens",
            "hangup_completion_tokens",
            "unattributed_prompt_tokens",
            "unattributed_completion_tokens",
            "ledger_excess_tokens",
            "unreconciled_requests",
            "unreconciled_prompt_tokens",
            "unreconciled_completion_tokens",
        )
    }
    assert got == {
        "engine_prompt_tokens": 400,
        "engine_completion_tokens": 178,
        "ledger_prompt_tokens": 300,
        "ledger_completion_tokens": 120,
        "difference_tokens": 158,
        "hangup_prompt_tokens": 0,
        "hangup_completion_tokens": 8,
        "unattributed_prompt_tokens": 100,
        "unattributed_completion_tokens": 50,
        "ledger_excess_tokens": 0,
        "unreconciled_requests": 3,
        "unreconciled_prompt_tokens": 300,
        "unreconciled_completion_tokens": 150,
    }
    assert one["unattributed_share"] == pytest.approx(150 / 578)


def test_the_statement(worked: Ledger, config: Config) -> None:
    """Search's line keeps its usage objects' tokens, assistant's carries the tail, and the
    platform's unattributed line costs 250/934 of the hour."""
    statement = Chargeback(worked, config).statement("2026-10")
    tokens = statement.lines.select(
        "team", "model", "requests", "prompt_tokens", "completion_tokens"
    )
    mine = tokens.filter(
        pl.col("model").str.starts_with("chat-small") & (pl.col("requests") > 0)
        | (pl.col("model") == unattributed_model("chat-small"))
    )
    assert sorted(mine.rows()) == [
        ("assistant", "chat-small", 1, 100, 28),
        ("platform", "chat-small (unattributed)", 0, 100, 50),
        ("search", "chat-small", 4, 400, 250),
    ]
    unattributed = statement.lines.filter(pl.col("model") == unattributed_model("chat-small"))
    hour_usd = 1.60 + 0.2 * 0.14 * 1.35  # the L40S hour at the price book, its 0.2 kWh at PUE 1.35
    assert 250 / 934 * hour_usd == pytest.approx(0.4384, abs=1e-4)
    assert unattributed["total_cents"].to_list() == [44]
    assert statement.unreconciled.rows() == [("small-0", "chat-small", 3, 300, 150)]
    assert statement.reconciles
