"""The fleet's life on the charts: scaling, alerts that fired, month closes and price changes.

Every time series of the dashboard marks the events of its range: a dotted vertical line and a
symbol at the top of the plot, whose hover says what happened and why (the autoscaler's reasons,
the alert rule's summary, what a month's close means). Billing gives the scaling decisions (to
the admin: they span every team) and the month closes (``GET /v1/events``); Prometheus, when
``dashboard.prometheus_url`` is set, the alerts that fired (to the admin: alerts span every
team, and the dashboard filters nothing itself). The price book carries no dates, so no price
change is ever marked.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import plotly.graph_objects as go  # type: ignore[import-untyped]
import polars as pl

from dashboards.client import BillingClient, BillingError
from dashboards.data import local_times
from dashboards.prometheus import fired_alerts

__all__ = ["KINDS", "LEGEND", "Events", "events_frame", "gather", "mark"]

# kind -> (trace name, marker symbol, colour; None: the model's colour)
KINDS: Final[Mapping[str, tuple[str, str, str | None]]] = {
    "scale_up": ("scale events", "triangle-up", None),
    "scale_down": ("scale events", "triangle-down", None),
    "alert": ("alerts fired", "x", "#b42318"),
    "month_close": ("month closes", "square", "#1d2430"),
    "price_change": ("price changes", "diamond", "#067647"),
}
LEGEND: Final = (
    "Marks on the charts: \u25b2 \u25bc the autoscaler scaled a model up or down, \u2716 an alert "
    "fired, \u25a0 a month was closed; hover a mark for why. The price book has no dates, so no "
    "price change is marked."
)
# At most this many dotted lines per chart; every event keeps its symbol.
MAX_LINES: Final = 100
_FALLBACK_COLOUR: Final = "#475467"
_SCHEMA: Final = {"t": pl.Float64, "kind": pl.String, "model": pl.String, "hover": pl.String}


@dataclass(frozen=True, slots=True)
class Events:
    """A range's events (``events_frame``'s rows, times in the viewer's zone) and a sentence
    when one of their sources failed."""

    frame: pl.DataFrame
    problem: str | None = None


def gather(
    client: BillingClient,
    token: str,
    admin: bool,
    prometheus_url: str | None,
    start: float,
    end: float,
) -> tuple[list[dict[str, Any]], str | None]:
    """The events of ``start``..``end`` from billing and, for the admin, Prometheus, at once."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        asked = pool.submit(client.events, token, start, end)
        alerts = (
            pool.submit(fired_alerts, prometheus_url, start, end)
            if admin and prometheus_url
            else None
        )
        problems = []
        try:
            found = list(asked.result())
        except BillingError as exc:
            found = []
            problems.append(f"Events are not marked: {exc}.")
        if alerts is not None:
            fired, problem = alerts.result()
            found += fired
            if problem:
                problems.append(problem)
    return sorted(found, key=lambda e: e["at"]), " ".join(problems) or None


def _hover(event: Mapping[str, Any]) -> str:
    lines = str(event.get("detail") or "").split("; ")
    return f"<b>{html.escape(str(event['title']))}</b><br>" + "<br>".join(
        html.escape(line) for line in lines if line
    )


def events_frame(events: Sequence[Mapping[str, Any]], tz: str | None) -> pl.DataFrame:
    """The events as rows to draw: time in the viewer's zone, kind, model and hover text."""
    rows = [
        {"t": float(e["at"]), "kind": e["kind"], "model": e.get("model"), "hover": _hover(e)}
        for e in events
        if e["kind"] in KINDS
    ]
    return local_times(pl.DataFrame(rows, schema=_SCHEMA), tz)


def mark(fig: go.Figure, events: pl.DataFrame, colours: Mapping[str, str]) -> go.Figure:
    """A dotted line and a symbol at the top per event, the symbol's hover saying what and why.

    The symbols sit on an axis of their own (0..1, hidden), at the top, whatever the chart's
    values. A chart without data (a sentence in its place) is left as it is.
    """
    if events.height == 0 or not fig.data:
        return fig
    for row in events.head(MAX_LINES).iter_rows(named=True):
        fig.add_vline(x=row["t"], line_dash="dot", line_width=1, line_color=_colour(row, colours))
    for name in dict.fromkeys(n for n, _, _ in KINDS.values()):
        part = events.filter(pl.col("kind").is_in([k for k, v in KINDS.items() if v[0] == name]))
        if part.height == 0:
            continue
        fig.add_trace(
            go.Scatter(
                x=part["t"].to_list(),
                y=[0.97] * part.height,
                yaxis="y2",
                mode="markers",
                name=name,
                showlegend=False,
                text=part["hover"].to_list(),
                hovertemplate="%{text}<extra></extra>",
                marker={
                    "size": 10,
                    "symbol": [KINDS[k][1] for k in part["kind"]],
                    "color": [_colour(r, colours) for r in part.iter_rows(named=True)],
                },
            )
        )
    fig.update_layout(
        yaxis2={"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True}
    )
    return fig


def _colour(row: Mapping[str, Any], colours: Mapping[str, str]) -> str:
    fixed = KINDS[row["kind"]][2]
    return fixed or colours.get(row["model"] or "", _FALLBACK_COLOUR)
