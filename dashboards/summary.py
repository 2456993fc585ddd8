"""The summary row at the top of every page: the month's money and the range's service at a glance.

``tiles`` is pure: from what billing answered (spend, the month's statement lines, usage, SLA and
GPU rows) it computes every figure with its unit and the period it covers. The money comes from
``/v1/spend`` and ``/v1/chargeback/{month}``, which billing computes when asked, so the row
agrees with billing's API and the command line at the moment shown as "as of".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl
from dash import html

from dashboards.formatting import compact, percent, usd

__all__ = ["Tile", "summary_row", "tiles"]


@dataclass(frozen=True, slots=True)
class Tile:
    """One figure of the summary row: what it is, its value with unit, and what it covers."""

    key: str
    label: str
    value: str
    detail: str
    raw: float | None = None


def _sum(frame: pl.DataFrame, column: str) -> float:
    if frame.height == 0 or column not in frame.columns:
        return 0.0
    return float(frame[column].cast(pl.Float64).fill_null(0).sum())


def _or_na(share: float | None) -> str:
    """A percentage, or ``MISSING`` when there was nothing to divide by."""
    return percent(share)


def _spend_tile(spend: Sequence[dict[str, Any]]) -> Tile:
    spent = sum(float(s["spent_usd"]) for s in spend)
    budgeted = [s for s in spend if float(s["budget_usd"]) > 0]
    budget = sum(float(s["budget_usd"]) for s in budgeted)
    forecast = sum(float(s["forecast_usd"]) for s in spend)
    # The budgets against what the teams that have them spent (as the chargeback CSV's total):
    # all spend over them read as a team over its budget when it was the platform's idle time.
    within = usd(sum(float(s["spent_usd"]) for s in budgeted))
    of_budget = f" {within} of {usd(budget)} budgeted" if budget > 0 else " (no budget set)"
    return Tile(
        "spend",
        "Spend, month to date",
        usd(spent),
        f"{of_budget.strip()}; forecast {usd(forecast)} at month end",
        spent,
    )


def _idle_tile(lines: pl.DataFrame) -> Tile:
    total, idle = _sum(lines, "total_cents"), _sum(lines, "idle_cents")
    share = 100 * idle / total if total > 0 else None
    return Tile(
        "idle",
        "Idle share",
        _or_na(share),
        f"of spend is idle GPU capacity ({usd(idle / 100)}), month to date",
        share,
    )


def _sla_tile(sla: pl.DataFrame, period: str) -> Tile:
    asked, within = _sum(sla, "ttft_requests"), _sum(sla, "within_sla")
    share = 100 * within / asked if asked > 0 else None
    detail = f"of {asked:,.0f} requests had TTFT within target, {period}"
    return Tile("sla", "SLA attainment", _or_na(share), detail, share)


def _gpu_tile(gpus: pl.DataFrame | None, period: str) -> Tile | None:
    if gpus is None:
        return None
    weight = _sum(gpus, "gpus")
    busy = (
        float((gpus["utilization"].cast(pl.Float64) * gpus["gpus"].cast(pl.Float64)).sum())
        if gpus.height
        else 0.0
    )
    share = 100 * busy / weight if weight > 0 else None
    return Tile(
        "gpu", "GPU utilization", _or_na(share), f"mean over the fleet's GPUs, {period}", share
    )


def tiles(
    spend: Sequence[dict[str, Any]],
    lines: pl.DataFrame,
    usage: pl.DataFrame,
    sla: pl.DataFrame,
    gpus: pl.DataFrame | None,
    period: str,
) -> list[Tile]:
    """The summary's figures; ``gpus`` is None for a caller that may not see fleet telemetry."""
    requests = _sum(usage, "requests")
    tokens = _sum(usage, "prompt_tokens") + _sum(usage, "completion_tokens")
    found = [
        _spend_tile(spend),
        Tile(
            "requests",
            "Requests",
            compact(requests),
            f"{requests:,.0f} requests, {period}",
            requests,
        ),
        Tile(
            "tokens",
            "Tokens",
            compact(tokens),
            f"{tokens:,.0f} prompt + completion tokens, {period}",
            tokens,
        ),
        _sla_tile(sla, period),
        _gpu_tile(gpus, period),
        _idle_tile(lines),
    ]
    return [t for t in found if t is not None]


def summary_row(found: Sequence[Tile], as_of: str, month: str) -> html.Div:
    """The tiles, and one line saying when they were computed and what they cover."""
    cards = [
        html.Div(
            [
                html.Div(t.label, className="tile-label"),
                html.Div(t.value, className="tile-value", id=f"summary-{t.key}-value"),
                html.Div(t.detail, className="tile-detail"),
            ],
            className="tile",
            id=f"summary-{t.key}",
            title=f"{t.label}: {t.value} {t.detail} (as of {as_of})",
        )
        for t in found
    ]
    caption = html.Div(
        f"As of {as_of} (your time). Money: {month} to date, from billing at that moment.",
        className="as-of",
        id="summary-as-of",
    )
    return html.Div([html.Div(cards, className="tiles"), caption])
