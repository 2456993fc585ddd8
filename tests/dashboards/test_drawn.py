"""What a chart draws of a query's answer: complete buckets, and the one still filling, as partial."""

from __future__ import annotations

import polars as pl
import pytest

from dashboards.client import Answer
from dashboards.data import drawn

STEP = 60
T0 = 1_790_000_040.0  # a whole minute


def answer(rows: list[tuple[float, str, float, float]]) -> Answer:
    """Throughput rows (t, model, requests per second, error ratio) in 1-minute steps."""
    frame = pl.DataFrame(
        rows, schema=["t", "model", "requests_per_second", "error_ratio"], orient="row"
    )
    return Answer(frame, T0 - 600, T0 + 600, STEP)


def test_the_bucket_still_filling_is_kept_with_its_rate_over_the_time_passed():
    """12 requests in the 15 s of a minute that passed: 0.8 requests/s, not 0.2; ratios stay."""
    got = drawn(
        answer([(T0 - 60, "m", 1.0, 0.5), (T0, "m", 12 / 60, 0.25)]),
        T0 + 15,
        ["requests_per_second"],
    )
    assert got.partial_from == T0
    assert got.frame["requests_per_second"].to_list() == pytest.approx([1.0, 0.8])
    assert got.frame["error_ratio"].to_list() == [0.5, 0.25]


def test_a_ledger_in_its_first_minute_still_draws():
    """Nothing complete yet: the partial bucket alone, not an empty chart."""
    got = drawn(answer([(T0, "m", 3 / 60, 0.0)]), T0 + 0.2, ["requests_per_second"])
    assert (got.partial_from, got.frame.height) == (T0, 1)
    # The first second is the least a rate is taken over.
    assert got.frame["requests_per_second"].to_list() == pytest.approx([3.0])


def test_only_complete_buckets_leave_nothing_partial_and_later_rows_are_left_out():
    """At a minute's end every bucket is complete; a row after the end is not drawn."""
    got = drawn(
        answer([(T0 - 60, "m", 1.0, 0.0), (T0 + 60, "m", 9.0, 0.0)]), T0, ["requests_per_second"]
    )
    assert got.partial_from is None
    assert got.frame["t"].to_list() == [T0 - 60]
