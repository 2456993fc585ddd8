"""Hang-up tails: vLLM's tokens after a client hung up go to that team only when provably its own."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from billing import reconciled
from billing.chargeback import Chargeback
from billing.hangups import others_sql, readings_sql, spans
from billing.ledger import Ledger
from billing.reconciliation import is_unattributed, reconcile, reconciliation_sql
from exporters.chargeback_csv import chargeback_frame
from infermeter.config import Config
from tests.billing.conftest import OCT, usage
from tests.billing.test_reconciliation import HOUR, engine_samples, fill, requests, row

# The hang-up: assistant's stream from 01:03:10 to 01:03:20, alone between the engine's readings
# at 01:03:00 and 01:04:00 (search's requests run at 01:02:05-15 and 01:04:05-15).
HUNG_UP_AT = OCT + HOUR + 200.0
TAIL = (HUNG_UP_AT + 0.5, 0, 8)  # vLLM's 8 tokens before its abort took effect


def hangup(**kw: Any) -> dict[str, Any]:
    """Assistant's request that its client left after 20 completion tokens."""
    fields = {
        "status": "client_aborted",
        "completion_tokens": 20,
        "finish_reason": None,
        "usage_exact": False,
    } | kw
    return usage("assistant", HUNG_UP_AT - 10.0, 10.0, **fields)


def hour_one(
    ledger: Ledger, kept: list[dict[str, Any]], engine: list[dict[str, Any]]
) -> dict[str, Any]:
    """The ledger filled with ``kept`` and ``engine``; hour 1's reconciliation row."""
    fill(ledger, kept, engine)
    return row(reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR), 1)


def line(lines: pl.DataFrame, team: str, model: str = "chat-small") -> dict[str, Any]:
    found = lines.filter((pl.col("team") == team) & (pl.col("model") == model)).to_dicts()
    assert len(found) == 1, found
    return found[0]


def test_a_lone_hang_ups_tail_is_its_teams(ledger: Ledger, config: Config) -> None:
    """Alone between two readings: the 8 tokens go on assistant's line, none is unattributed."""
    kept = [*requests(10, 1), hangup()]
    one = hour_one(ledger, kept, engine_samples(kept, OCT, OCT + 3 * HOUR, extra=[TAIL]))
    assert (one["difference_tokens"], one["hangup_completion_tokens"], one["hangup_tokens"]) == (
        8,
        8,
        8,
    )
    assert (one["unattributed_tokens"], one["ledger_excess_tokens"]) == (0, 0)
    statement = Chargeback(ledger, config).statement("2026-10")
    assert statement.reconciles
    assistant = line(statement.lines, "assistant")
    assert (assistant["requests"], assistant["prompt_tokens"], assistant["completion_tokens"]) == (
        1,
        100,
        28,
    )
    assert line(statement.lines, "search")["completion_tokens"] == 500
    assert not any(is_unattributed(m) for m in statement.lines["model"])
    csv = chargeback_frame(statement, {}).filter(pl.col("team") == "assistant")
    assert csv["completion_tokens"].to_list() == [28]


def test_the_tail_adds_tokens_not_money(ledger: Ledger, config: Config) -> None:
    """The team's line costs what its in-flight share costs, with or without the tail counted."""
    kept = [*requests(10, 1), hangup()]
    fill(ledger, kept, engine_samples(kept, OCT, OCT + 3 * HOUR, extra=[TAIL]))
    with_tail = Chargeback(ledger, config).statement("2026-10").lines
    other = Ledger.open(":memory:", [t.name for t in config.teams], {})
    try:
        fill(other, kept, engine_samples(kept, OCT, OCT + 3 * HOUR))
        without = Chargeback(other, config).statement("2026-10").lines
    finally:
        other.close()
    cents = ["compute_cents", "energy_cents", "idle_cents", "total_cents"]
    assert with_tail.select("team", "model", *cents).equals(without.select("team", "model", *cents))
    assert line(without, "assistant")["completion_tokens"] == 20


def test_another_record_in_the_interval_leaves_the_tail_unattributed(
    ledger: Ledger, config: Config
) -> None:
    """Search's request overlapping the interval could have made the tokens: none is assistant's."""
    overlapping = usage("search", OCT + HOUR + 230.0, 20.0)  # 01:03:50-01:04:10
    kept = [*requests(10, 1), hangup(), overlapping]
    one = hour_one(ledger, kept, engine_samples(kept, OCT, OCT + 3 * HOUR, extra=[TAIL]))
    assert (one["hangup_tokens"], one["unattributed_completion_tokens"]) == (0, 8)
    lines = Chargeback(ledger, config).statement("2026-10").lines
    assert line(lines, "assistant")["completion_tokens"] == 20
    assert line(lines, "platform", "chat-small (unattributed)")["completion_tokens"] == 8


def test_an_engine_busy_with_another_request_leaves_the_tail_unattributed(ledger: Ledger) -> None:
    """The engine ran a request at the reading before the hang-up that left no record: not provable."""
    kept = [*requests(10, 1), hangup()]
    busy = engine_samples(
        kept,
        OCT,
        OCT + 3 * HOUR,
        extra=[TAIL],
        running=lambda t: 1.0 if t == HUNG_UP_AT - 20.0 else 0.0,
    )
    one = hour_one(ledger, kept, busy)
    assert (one["hangup_tokens"], one["unattributed_tokens"]) == (0, 8)


def test_a_hang_up_of_two_choices_is_alone_with_itself(ledger: Ledger, config: Config) -> None:
    """n=2, running at the reading before: the engine's two running requests are its own choices."""
    two = hangup(received_at=HUNG_UP_AT - 30.0, first_token_at=HUNG_UP_AT - 29.9, choices=2)
    kept = [*requests(10, 1), two]
    engine = engine_samples(
        kept,
        OCT,
        OCT + 3 * HOUR,
        extra=[TAIL],
        running=lambda t: 2.0 if t == HUNG_UP_AT - 20.0 else 0.0,
    )
    one = hour_one(ledger, kept, engine)
    assert (one["hangup_completion_tokens"], one["unattributed_tokens"]) == (8, 0)
    assert (
        line(Chargeback(ledger, config).statement("2026-10").lines, "assistant")[
            "completion_tokens"
        ]
        == 28
    )


def test_tails_never_exceed_the_hours_positive_difference(ledger: Ledger) -> None:
    """Where the hour's engine is 5 completion tokens short elsewhere, the tail counts 3."""
    kept = [*requests(10, 1), hangup()]
    short = (OCT + HOUR + 900.0, 0, -5)
    one = hour_one(ledger, kept, engine_samples(kept, OCT, OCT + 3 * HOUR, extra=[TAIL, short]))
    assert one["difference_tokens"] == 3
    assert (one["hangup_tokens"], one["unattributed_tokens"], one["ledger_excess_tokens"]) == (
        3,
        0,
        0,
    )


def test_the_query_and_the_statement_find_the_same_tails(ledger: Ledger) -> None:
    """The raw query (``GET /v1/query/reconciliation``) and the rollups give the same rows."""
    kept = [
        *requests(10, 1),
        hangup(),
        hangup(
            received_at=OCT + HOUR + 1500.0,
            first_token_at=OCT + HOUR + 1500.1,
            finished_at=OCT + HOUR + 1510.0,
        ),
    ]
    tails = [TAIL, (OCT + HOUR + 1510.4, 0, 5)]
    fill(ledger, kept, engine_samples(kept, OCT, OCT + 3 * HOUR, extra=tails))
    first = int(OCT // HOUR)
    sql, values = reconciliation_sql(first, first + 3)
    with ledger.reader() as cur:
        raw: pl.DataFrame = cur.sql(sql, params=values).pl()
    rolled = reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR)
    assert rolled.equals(raw)
    assert row(rolled, 1)["hangup_completion_tokens"] == 13


def test_only_hang_ups_are_examined(ledger: Ledger) -> None:
    """Thirty requests and one hang-up: one interval is examined; without hang-ups, none."""
    kept = [
        *requests(30, 1),
        hangup(
            received_at=OCT + HOUR + 3700.0,
            first_token_at=OCT + HOUR + 3700.1,
            finished_at=OCT + HOUR + 3710.0,
        ),
    ]
    fill(ledger, kept, engine_samples(kept, OCT, OCT + 3 * HOUR))
    first = int(OCT // HOUR)
    with ledger.reader() as cur:
        reconcile(cur, first, first + 3)
        examined = cur.execute("SELECT request_id FROM _bounded").fetchall()
        reconcile(cur, first, first + 1)  # hour 0: no hang-up ends in or near it
        none = cur.execute("SELECT count(*) FROM _bounded").fetchone()
    assert examined == [(kept[-1]["request_id"],)]
    assert none == (0,)


def test_readings_and_records_are_read_only_around_hang_ups() -> None:
    """The engine's readings come from the hours around hang-ups, the records from their spans."""
    sql = readings_sql([(4, 7)])
    assert '"timestamp" >= 14400.0 AND "timestamp" < 25200.0' in sql
    assert "WHERE false" in readings_sql([])
    assert "WHERE false" in others_sql([])
    assert "finished_at > 100.0 AND received_at < 160.0" in others_sql([(100.0, 160.0)])


@pytest.mark.parametrize(
    ("intervals", "merged"),
    [
        ([(200.0, 260.0), (0.0, 60.0), (100.0, 160.0)], [(0.0, 260.0)]),
        ([(0.0, 60.0), (500.0, 560.0)], [(0.0, 60.0), (500.0, 560.0)]),
        ([], []),
    ],
)
def test_close_intervals_are_read_as_one_span(
    intervals: list[tuple[float, float]], merged: list[tuple[float, float]]
) -> None:
    """Intervals within a minute of each other are one read of the records; far ones, apart."""
    assert spans(intervals) == merged


def test_too_many_spans_become_one_scan() -> None:
    """Past the limit, one read from the first start to the last end costs less."""
    many = [(i * 1000.0, i * 1000.0 + 60.0) for i in range(10)]
    assert spans(many, most=5) == [(0.0, 9060.0)]
