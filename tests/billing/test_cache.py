"""Prompt caching priced fairly: cached prompt tokens in the tokens split, the savings, the backfill.

The worked example: one L40S instance (small-0) for one hour at $1.00 an hour, no energy price,
two teams holding it the whole hour (so nothing is idle), each sending one request of 1,000
prompt and 100 completion tokens. ``assistant`` found 400 of its prompt tokens (40 %) in
vLLM's prefix cache; ``search`` none. Weights: prompt 1, cached prompt 0.25, completion 3.

    search:    1000 x 1 +               100 x 3 = 1300 weighted tokens
    assistant:  600 x 1 + 400 x 0.25 +  100 x 3 = 1000 weighted tokens
    100 cents x 1300/2300 = 56.52 -> 57 cents; 100 x 1000/2300 = 43.48 -> 43 cents

(largest remainder: 56 + 43 = 99, the cent left goes to the larger fraction, search's).
The saving on assistant's line: 400 cached x (1 - 0.25) x 43 cents / 1000 weighted tokens
= 12.9 -> 13 cents; search's: 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from pydantic import ValidationError

from billing import allocation_runs
from billing.cache import cache_rows, month_cached_tokens
from billing.charges import Policy
from billing.ledger import Ledger
from billing.schema import MIGRATIONS
from billing.statement import cents_lines, merged
from infermeter.config import CACHED_PROMPT_SHARE, TokenWeights
from infermeter.statement import CACHE_SCHEMA
from tests.billing.conftest import OCT, batch, gpu_samples, usage

MONTH = "2026-10"
WORKED = Policy.listed(
    usd_per_gpu_hour={"L40S": 1.0},
    allocation="tokens",
    prompt_weight=1.0,
    cached_prompt_weight=0.25,
    completion_weight=3.0,
)


def _records() -> list[dict[str, object]]:
    """The two teams' requests, each holding the instance the whole hour."""
    return [
        usage(
            "search", OCT, 3599.0, prompt_tokens=1000, cached_prompt_tokens=0, completion_tokens=100
        ),
        usage(
            "assistant",
            OCT,
            3599.0,
            prompt_tokens=1000,
            cached_prompt_tokens=400,
            completion_tokens=100,
        ),
    ]


def _fill(ledger: Ledger) -> None:
    ledger.ingest(batch("usage", _records()), now=OCT + 86400)
    ledger.ingest(batch("gpu_samples", gpu_samples(seconds=3600.0)), now=OCT + 86400)


@pytest.fixture(scope="module")
def worked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    """A ledger file holding the worked example."""
    path = tmp_path_factory.mktemp("cache") / "ledger.duckdb"
    ledger = Ledger.open(path, ["search", "assistant", "analytics"], {})
    _fill(ledger)
    yield ledger
    ledger.close()


def _cents(ledger: Ledger, policy: Policy) -> dict[str, int]:
    lines, _ = allocation_runs.allocate(ledger, policy, MONTH)
    table = cents_lines(MONTH, merged(lines))
    return {str(r["team"]): int(r["total_cents"]) for r in table.iter_rows(named=True)}


def test_a_team_with_40_percent_cache_hits_pays_less_under_the_tokens_rule(worked: Ledger) -> None:
    """Under ``tokens``, 400 cached prompt tokens weigh 0.25 each: 57 and 43 cents, not 50 each."""
    assert _cents(worked, WORKED) == {"search": 57, "assistant": 43}


def test_without_a_cached_weight_the_tokens_rule_splits_as_before(worked: Ledger) -> None:
    """A policy that names no cached weight prices a cached prompt token as an uncached one."""
    plain = Policy.listed(
        usd_per_gpu_hour={"L40S": 1.0}, allocation="tokens", completion_weight=3.0
    )
    assert _cents(worked, plain) == {"search": 50, "assistant": 50}


def test_in_flight_is_not_discounted_again_for_cache_hits(worked: Ledger) -> None:
    """Under ``in_flight`` the measured time decides: equal time, equal cents, whatever was cached."""
    in_flight = Policy.listed(
        usd_per_gpu_hour={"L40S": 1.0}, allocation="in_flight", cached_prompt_weight=0.0
    )
    assert _cents(worked, in_flight) == {"search": 50, "assistant": 50}


def test_the_month_s_cached_tokens_are_read_per_team_and_model(worked: Ledger) -> None:
    """The ledger read gives every team and model with usage, and its cached prompt tokens."""
    got = month_cached_tokens(worked, MONTH)
    assert got.rows() == [("assistant", "chat-small", 1000, 400), ("search", "chat-small", 1000, 0)]
    assert month_cached_tokens(worked, "2026-11").height == 0


def test_the_savings_of_the_worked_example(worked: Ledger) -> None:
    """assistant saved 400 x 0.75 x 43 / 1000 = 12.9 -> 13 cents; search saved nothing."""
    lines, _ = allocation_runs.allocate(worked, WORKED, MONTH)
    table = cents_lines(MONTH, merged(lines))
    rows = cache_rows(table, month_cached_tokens(worked, MONTH), WORKED)
    assert rows.schema == pl.Schema(CACHE_SCHEMA)
    assert rows.rows() == [
        ("assistant", "chat-small", 1000, 400, 13),
        ("search", "chat-small", 1000, 0, 0),
    ]


@pytest.mark.parametrize(
    ("cached", "total_cents", "expected"),
    [
        (0, 1000, 0),  # no hits, no saving
        (500, 0, 0),  # a free line saved nothing
        (1000, 400, 300),  # all cached: 1000 x 0.75 x 400 / (250 + 750) = 300
        (200, 1000, 94),  # 200 x 0.75 x 1000 / (800 + 50 + 750) = 93.75 -> 94
        (2000, 400, 300),  # more cached than prompted (a late record): capped at the prompt
    ],
)
def test_savings_are_cached_tokens_times_the_weight_saved_at_the_line_s_price(
    cached: int, total_cents: int, expected: int
) -> None:
    """The estimate is cached x (prompt - cached weight) x the line's cents per weighted token."""
    lines = pl.DataFrame(
        {
            "month": [MONTH],
            "for_month": [MONTH],
            "team": ["t"],
            "model": ["m"],
            "prompt_tokens": [1000],
            "completion_tokens": [250],
            "total_cents": [total_cents],
        }
    )
    cached_by_line = pl.DataFrame({"team": ["t"], "model": ["m"], "cached_prompt_tokens": [cached]})
    rows = cache_rows(lines, cached_by_line, WORKED)
    assert rows["cache_savings_cents"].to_list() == [expected]


def test_adjustments_of_earlier_months_are_not_counted() -> None:
    """Only the month's own lines carry its cache hits: an adjustment line adds nothing."""
    lines = pl.DataFrame(
        {
            "month": [MONTH, MONTH],
            "for_month": [MONTH, "2026-09"],
            "team": ["t", "t"],
            "model": ["m", "m"],
            "prompt_tokens": [1000, 5000],
            "completion_tokens": [250, 0],
            "total_cents": [400, 900],
        }
    )
    cached_by_line = pl.DataFrame({"team": ["t"], "model": ["m"], "cached_prompt_tokens": [1000]})
    assert cache_rows(lines, cached_by_line, WORKED).rows() == [("t", "m", 1000, 1000, 300)]


def test_the_migration_backfills_cached_tokens_from_usage_slots(tmp_path: Path) -> None:
    """A ledger from before the column gets it filled from ``usage_slots``: the same split."""
    migration = next(m for m in MIGRATIONS if "ADD COLUMN IF NOT EXISTS cached_prompt_tokens" in m)
    path = tmp_path / "old.duckdb"
    ledger = Ledger.open(path, ["search", "assistant"], {})
    try:
        _fill(ledger)
        with ledger.reader() as cur:  # the table as the migrations before this one leave it
            cur.execute("ALTER TABLE alloc_hours DROP COLUMN cached_prompt_tokens")
            cur.execute(migration)
            rows = cur.execute("""SELECT k.team, sum(h.cached_prompt_tokens) FROM alloc_hours h
                JOIN alloc_keys k USING ("key") GROUP BY ALL ORDER BY ALL""").fetchall()
        assert rows == [("assistant", 400), ("search", 0)]
        assert _cents(ledger, WORKED) == {"search": 57, "assistant": 43}
        # Records arriving after the migration add to the backfilled column.
        ledger.ingest(
            batch(
                "usage",
                [usage("search", OCT + 600, 10.0, prompt_tokens=100, cached_prompt_tokens=30)],
            ),
            now=OCT + 86400,
        )
        assert month_cached_tokens(ledger, MONTH)["cached_prompt_tokens"].to_list() == [400, 30]
    finally:
        ledger.close()


def test_the_cached_weight_defaults_to_the_measured_share_of_the_prompt_weight() -> None:
    """Unset, ``cached_prompt`` is the measured share of the prompt weight given."""
    assert TokenWeights().cached_prompt == CACHED_PROMPT_SHARE
    assert TokenWeights(prompt=2.0).cached_prompt == pytest.approx(2.0 * CACHED_PROMPT_SHARE)
    assert TokenWeights(prompt=1.0, cached_prompt=1.0).cached_prompt == 1.0


def test_a_cached_weight_above_the_prompt_weight_is_refused() -> None:
    """A cache hit may not weigh more than an uncached prompt token."""
    with pytest.raises(ValidationError, match=r"cached_prompt \(0\.6\) exceeds prompt \(0\.5\)"):
        TokenWeights(prompt=0.5, cached_prompt=0.6)
