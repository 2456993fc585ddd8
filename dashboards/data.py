"""Data for the pages, kept out of the layouts: time ranges, local times, statements, scaling.

Pages call these with the signed-in user's token; nothing here keeps state between calls.

A chart's last bucket is usually still filling: ``drawn`` keeps it, marked as partial, with its
per-second rates taken over the part of it that has passed, so a chart agrees with the range's
totals from the first request on (a fresh ledger has nothing but that bucket) and its last point
does not dip only because its bucket is young.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import httpx
import polars as pl
from prometheus_client.parser import text_string_to_metric_families

from dashboards.client import Answer, BillingClient
from infermeter.months import month_bounds, month_of
from infermeter.statement import statement_from_json

__all__ = [
    "RANGES",
    "RANGE_LABELS",
    "Drawn",
    "Window",
    "desired_replicas",
    "drawn",
    "fetch_answers",
    "fetch_queries",
    "local_range",
    "local_times",
    "recent_months",
    "statement_from_json",
    "time_range",
    "window",
]

# The time-range picker's choices: "fit" (the default) fits the range to the data's span; the
# others are seconds back from now.
RANGES: Final = {"fit": None, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400}
RANGE_LABELS: Final = {
    "fit": "Fit to the data",
    "1h": "Last hour",
    "6h": "Last 6 hours",
    "24h": "Last 24 hours",
    "7d": "Last 7 days",
}
DESIRED_METRIC: Final = "infermeter_desired_replicas"
# The least part of a bucket a partial rate is taken over: the first second's rate is noise.
MIN_PARTIAL_SECONDS: Final = 1.0
# A range fitted to young data is at least this long, so its first minutes are not a sliver.
MIN_FIT_SECONDS: Final = 300.0


@dataclass(frozen=True, slots=True)
class Window:
    """The range a page shows: ``start``..``end`` (Unix seconds) and how a person says it
    ("the last 6 hours", "the data so far: 20 minutes")."""

    start: float
    end: float
    label: str


def _duration(seconds: float) -> str:
    """How long, as a person says it: "20 minutes", "1 h 45 min", "3 days"."""
    minutes = max(1, round(seconds / 60))
    if minutes < 60:
        return "1 minute" if minutes == 1 else f"{minutes} minutes"
    if minutes < 48 * 60:
        hours, rest = divmod(minutes, 60)
        return f"{hours} h {rest} min" if rest else f"{hours} h"
    return f"{minutes / 1440:.1f} days".replace(".0 days", " days")


def window(
    choice: str | None, span: tuple[float, float] | None = None, now: float | None = None
) -> Window:
    """The range for a picker choice: a preset, or ("fit", the default) the data's span.

    Fitted, the range starts at the data's first minute (drawn at least ``MIN_FIT_SECONDS``
    long) and ends now, for data up to 7 days old; older data is shown over the last 7 days.
    With no data, the last hour. Unknown choices fit too.
    """
    now = time.time() if now is None else now
    preset = RANGES.get(choice or "fit")
    if preset is not None:
        return Window(now - preset, now, f"the {RANGE_LABELS[choice or 'fit'].lower()}")
    if span is None:
        return Window(now - 3600, now, "the last hour")
    age = now - span[0]
    if age > 7 * 86400:
        return Window(now - 7 * 86400, now, "the last 7 days")
    shown = max(age, MIN_FIT_SECONDS)
    return Window(now - shown, now, f"the data so far ({_duration(age)})")


def time_range(
    choice: str | None, now: float | None = None, span: tuple[float, float] | None = None
) -> tuple[float, float]:
    """(from, to) in Unix seconds for a picker choice (``window``'s)."""
    found = window(choice, span, now)
    return found.start, found.end


def local_times(frame: pl.DataFrame, tz: str | None, column: str = "t") -> pl.DataFrame:
    """``column`` (Unix seconds, UTC) as wall-clock datetimes in the viewer's time zone.

    The browser reports its IANA zone; the wall-clock values are sent without a zone so plotly
    draws them as they are. An unknown zone falls back to UTC rather than failing the page.
    """
    if column not in frame.columns or frame.height == 0:
        return frame
    utc = pl.from_epoch(pl.col(column).cast(pl.Int64), time_unit="s").dt.replace_time_zone("UTC")
    try:
        return frame.with_columns(
            utc.dt.convert_time_zone(tz or "UTC").dt.replace_time_zone(None).alias(column)
        )
    except pl.exceptions.PolarsError:
        return frame.with_columns(utc.dt.replace_time_zone(None).alias(column))


def local_range(start: float, end: float, tz: str | None) -> tuple[dt.datetime, dt.datetime]:
    """``start``..``end`` (Unix seconds) as wall-clock datetimes in the viewer's zone, as charts draw them."""
    frame = local_times(pl.DataFrame({"t": [start, end]}), tz)
    first, last = frame["t"].to_list()
    return first, last


@dataclass(frozen=True, slots=True)
class Drawn:
    """A query's rows as a chart draws them: the complete buckets, then the one still filling."""

    frame: pl.DataFrame
    # The start (Unix seconds) of the bucket still filling when it has rows; None: none has.
    partial_from: float | None


def drawn(answer: Answer, end: float, rates: Sequence[str] = ()) -> Drawn:
    """``answer``'s rows of buckets that ended by ``end``, and of the one ``end`` falls in.

    ``rates``: columns that are a bucket's sum per second of its step (requests per second...);
    in the bucket still filling they are per second of the part that has passed (at least
    ``MIN_PARTIAL_SECONDS``). Shares and means need no such care. Rows after ``end`` are left out.
    """
    frame, step = answer.frame, answer.step
    if frame.height == 0 or "t" not in frame.columns:
        return Drawn(frame, None)
    t = pl.col("t").cast(pl.Float64)
    complete = frame.filter(t + step <= end)
    partial = frame.filter((t <= end) & (t + step > end))
    if partial.height == 0:
        return Drawn(complete, None)
    start = float(partial["t"].cast(pl.Float64).min())  # type: ignore[arg-type]
    scale = step / max(end - start, MIN_PARTIAL_SECONDS)
    partial = partial.with_columns(
        [(pl.col(c).cast(pl.Float64) * scale).alias(c) for c in rates if c in partial.columns]
    )
    complete = complete.with_columns(
        [pl.col(c).cast(pl.Float64) for c in rates if c in complete.columns]
    )
    return Drawn(pl.concat([complete, partial], how="vertical_relaxed"), start)


def fetch_answers(
    client: BillingClient, token: str, names: Sequence[str], start: float, end: float
) -> dict[str, Answer]:
    """Several queries at once, each with the step billing served (see ``fetch_queries``)."""
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        futures = {name: pool.submit(client.answer, token, name, start, end) for name in names}
        return {name: future.result() for name, future in futures.items()}


def fetch_queries(
    client: BillingClient, token: str, names: Sequence[str], start: float, end: float
) -> dict[str, pl.DataFrame]:
    """Several queries at once (one thread each), so a page waits for the slowest, not the sum."""
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        futures = {name: pool.submit(client.query, token, name, start, end) for name in names}
        return {name: future.result() for name, future in futures.items()}


def recent_months(known: Sequence[str], now: float | None = None, count: int = 12) -> list[str]:
    """The month picker's choices: months with data plus the last ``count`` months, newest first."""
    now = time.time() if now is None else now
    months = {month_of(now)}
    month = month_of(now)
    for _ in range(count - 1):
        month = month_of(month_bounds(month)[0] - 1)
        months.add(month)
    return sorted(months | set(known), reverse=True)


def desired_replicas(urls: Sequence[str], timeout_seconds: float = 2.0) -> dict[str, float]:
    """``infermeter_desired_replicas`` per model from Prometheus-format ``urls``.

    An unreachable or unreadable URL adds nothing; an empty answer means "n/a" on the page.
    """
    desired: dict[str, float] = {}
    for url in urls:
        try:
            text = httpx.get(url, timeout=timeout_seconds).text
            families = list(text_string_to_metric_families(text))
        except (httpx.HTTPError, ValueError):
            continue
        for family in families:
            if family.name != DESIRED_METRIC:
                continue
            for sample in family.samples:
                if sample.name == DESIRED_METRIC and "model" in sample.labels:
                    desired[sample.labels["model"]] = sample.value
    return desired
