"""Billing's cost over OTLP: ``infermeter.cost`` (USD) per team and model, month to date.

A FinOps chart in any OpenTelemetry backend then needs no Prometheus: the cost of an hour is the
difference of two points an hour apart. The figure is the current month's statement as the
statement cache holds it (at most one dashboard refresh old, the one ``/metrics`` and the spend
route read), its own lines only (adjustments of closed months are not this month's cost), summed
per team and model. Each point is cumulative from the month's first second (its start time), and
may fall a little when late records re-split the month's idle capacity, so it is a sum that is not
monotonic; a new month starts again from zero with a new start time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import polars as pl

from billing.statement_cache import CachedChargeback
from infermeter.months import month_bounds
from infermeter.otlp_export import Attributes, up_down_sum

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import Metric

__all__ = ["CostExport"]


class CostExport:
    """The producer of billing's points (``infermeter.otlp_export.Producer``)."""

    def __init__(
        self, statements: CachedChargeback, clock: Callable[[], float] = time.time
    ) -> None:
        self.statements = statements
        self.clock = clock

    async def produce(self, start_ns: int, now_ns: int) -> Sequence[Metric]:
        """The month so far per team and model, read from the cache on a worker thread (a
        statement past its age is computed there, never on the event loop)."""
        statement = (await asyncio.to_thread(self.statements.current, self.clock())).statement
        lines = statement.lines.filter(pl.col("for_month") == statement.month)
        rows = (
            lines.group_by("team", "model").agg(pl.col("total_cents").sum()).sort("team", "model")
        )
        values: list[tuple[Attributes, float]] = []
        for team, model, cents in rows.iter_rows():
            attrs: dict[str, str | int | float | bool] = {"infermeter.team": team}
            if model:
                attrs["infermeter.model"] = model
            values.append((attrs, cents / 100))
        month_start_ns = int(month_bounds(statement.month)[0] * 1_000_000_000)
        text = "Cost charged to the team for the model, month to date (the statement's own lines)."
        return [up_down_sum("infermeter.cost", "USD", text, values, month_start_ns, now_ns)]
