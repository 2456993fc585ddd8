"""Charts that never look broken: fixed time axes, sane value axes, one colour per model.

A chart here is built from a frame that is already complete: ``complete_buckets`` drops the
bucket still filling (the current minute would show every rate dipping at the right edge), and a
frame with nothing to draw becomes a figure that says so in a sentence instead of an empty grid
with made-up axes. The time axis always spans the range the viewer picked, so a chart with one
point, or none, still reads as "the last hour".
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import plotly.graph_objects as go  # type: ignore[import-untyped]
import polars as pl

__all__ = [
    "PALETTE",
    "YAxis",
    "budget_figure",
    "colours_for",
    "complete_buckets",
    "empty_figure",
    "line_figure",
    "stacked_figure",
]

# Okabe-Ito, readable by the colour-blind; models take them in the configuration's order.
PALETTE: Final = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#CC79A7",
    "#56B4E9",
    "#D55E00",
    "#F0E442",
    "#000000",
)
YAxis = Literal["number", "share", "fraction"]
_HEIGHT: Final = 300
# The bottom margin holds the time axis's labels, which take two lines (about 36 px) where the
# range crosses a date.
_MARGIN: Final = {"l": 60, "r": 16, "t": 56, "b": 56}
# At the chart's bottom edge (``yref`` container), under the bottom margin and so under the
# axis's labels whatever the rows of legend: Plotly reserves the legend's height below the
# margin and shrinks the plot. Anchored to the plot by a fraction of its height instead, it
# covered the date labels when two or three rows of legend had shrunk the plot (a team's view
# at 1280 px, the range crossing midnight in the viewer's zone).
_LEGEND: Final = {"orientation": "h", "yref": "container", "yanchor": "bottom", "y": 0, "x": 0}


def colours_for(names: Sequence[str]) -> dict[str, str]:
    """A colour per name, in order: the same model gets the same colour on every page."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def complete_buckets(frame: pl.DataFrame, step: int, end: float, column: str = "t") -> pl.DataFrame:
    """Rows of buckets that ended by ``end``: the bucket still filling is left out."""
    if frame.height == 0 or column not in frame.columns:
        return frame
    return frame.filter(pl.col(column).cast(pl.Float64) + step <= end)


def _layout(title: str, subtitle: str | None = None) -> dict[str, Any]:
    # The title sits left and the toolbar (shown on hover only) right, so they never overlap.
    text = title if subtitle is None else f"{title}<br><sup>{subtitle}</sup>"
    return {
        "title": {"text": text, "x": 0.01, "xanchor": "left", "y": 0.96, "font": {"size": 15}},
        "height": _HEIGHT,
        "margin": _MARGIN,
        "template": "plotly_white",
        "uirevision": title,
    }


def empty_figure(title: str, message: str) -> go.Figure:
    """A chart with nothing to draw: its title and a sentence saying why, no axes."""
    fig = go.Figure()
    fig.update_layout(**_layout(title))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(
        text=message,
        showarrow=False,
        x=0.5,
        y=0.5,
        xref="paper",
        yref="paper",
        font={"size": 14, "color": "#475467"},
    )
    return fig


def _y_axis(fig: go.Figure, kind: YAxis, title: str, peak: float) -> None:
    if kind == "share":  # 0..1, drawn as 0..100 %
        fig.update_yaxes(title=title, tickformat=".0%", range=[0, 1.02])
    elif kind == "fraction":  # small shares such as error rates: from zero, in percent
        top = max(peak * 1.15, 0.01)
        fig.update_yaxes(title=title, tickformat=".1%", range=[0, top])
    else:
        # From zero, and a visible height when every value is zero.
        fig.update_yaxes(title=title, rangemode="tozero", range=None if peak > 0 else [0, 1])


def line_figure(
    frame: pl.DataFrame,
    y: str,
    series: str,
    title: str,
    y_title: str,
    x_range: tuple[dt.datetime, dt.datetime],
    *,
    kind: YAxis = "number",
    colours: Mapping[str, str] | None = None,
    dash_by: Mapping[str, str] | None = None,
    colour_of: Mapping[str, str] | None = None,
    empty: str = "No data in this range.",
    subtitle: str | None = None,
) -> go.Figure:
    """One line per value of ``series`` over ``t`` (already in the viewer's time zone).

    ``colours`` maps a series to its colour; ``colour_of`` maps a series to the key of
    ``colours`` it takes (``"chat-small p50"`` -> ``"chat-small"``). A series of one or two
    points is drawn with markers, since a line needs two points to show at all.
    """
    rows = frame.drop_nulls(y) if y in frame.columns else frame
    if rows.height == 0:
        return empty_figure(title, empty)
    fig = go.Figure()
    for key, part in rows.sort(series, "t").group_by(series, maintain_order=True):
        name = str(key[0])
        colour = (colours or {}).get((colour_of or {}).get(name, name))
        fig.add_trace(
            go.Scatter(
                x=part["t"].to_list(),
                y=part[y].to_list(),
                name=name,
                mode="lines+markers" if part.height < 3 else "lines",
                line={"dash": (dash_by or {}).get(name, "solid"), "color": colour, "width": 2},
                hovertemplate=f"%{{y:{'.1%' if kind != 'number' else ',.3~f'}}}<extra>{name}</extra>",
            )
        )
    fig.update_layout(**_layout(title, subtitle), hovermode="x unified", legend=_LEGEND)
    fig.update_xaxes(range=list(x_range), title=None)
    peak = float(rows[y].max() or 0)  # type: ignore[arg-type]
    _y_axis(fig, kind, y_title, peak)
    return fig


def stacked_figure(
    series: pl.DataFrame,
    title: str,
    subtitle: str,
    x_range: tuple[dt.datetime, dt.datetime],
    *,
    order: Sequence[str],
    colours: Mapping[str, str],
    step: int,
) -> go.Figure:
    """Cost per step (``t``, Unix seconds UTC, ``step`` long), stacked by ``group``, the costliest
    group lowest.

    ``order``: the groups, costliest first (the table's order); groups not in it come last.
    """
    fig = go.Figure()
    groups = series["group"].unique().to_list()
    ranked = [g for g in order if g in groups] + sorted(g for g in groups if g not in order)
    for group in ranked:
        part = series.filter(pl.col("group") == group).sort("t")
        # Each bar spans its step (a date axis would otherwise draw a lone bar a hairline wide).
        times = [
            dt.datetime.fromtimestamp(t + step / 2, dt.UTC).replace(tzinfo=None) for t in part["t"]
        ]
        fig.add_trace(
            go.Bar(
                x=times,
                y=part["cost_usd"].to_list(),
                name=str(group),
                marker_color=colours.get(group),
                width=step * 1000 * 0.9,
                hovertemplate=f"%{{y:$,.2f}}<extra>{group}</extra>",
            )
        )
    fig.update_layout(
        **_layout(title, subtitle),
        barmode="stack",
        bargap=0.1,
        legend=_LEGEND,
        hovermode="x unified",
    )
    fig.update_xaxes(range=list(x_range), title=None)
    fig.update_yaxes(title="USD", rangemode="tozero", tickprefix="$")
    return fig


def budget_figure(
    teams: Sequence[str],
    spent_pct: Sequence[float],
    forecast_pct: Sequence[float],
    spent_usd: Sequence[float],
    forecast_usd: Sequence[float],
) -> go.Figure:
    """Spent and forecast per team as a share of its budget, as bars across, with 100 % marked.

    Drawn as shares, not dollars, so a large budget does not dwarf the spend it is compared
    with. The axis fits the largest share, so small shares are seen; 100 % is a line when it is
    on the axis, and a sentence saying how far off it is when it is not. A share too small to
    see (under ``MIN_BAR`` of the axis) is drawn that wide, and its label, just past the bar's
    end, says its real share and dollars.
    """
    fig = go.Figure()
    peak = max([*spent_pct, *forecast_pct, 0.0]) / 100
    top = max(peak * 1.45, 1e-6) if peak < 1 else peak * 1.3
    for name, pct, money, colour in (
        ("Spent", spent_pct, spent_usd, "#0072B2"),
        ("Forecast at month end", forecast_pct, forecast_usd, "#56B4E9"),
    ):
        shares = [p / 100 for p in pct]
        fig.add_trace(
            go.Bar(
                y=list(teams),
                x=[max(v, top * MIN_BAR) if v > 0 else 0.0 for v in shares],
                customdata=shares,
                orientation="h",
                name=name,
                marker_color=colour,
                text=[f"{_share(v)} \u00b7 ${m:,.2f}" for v, m in zip(shares, money, strict=True)],
                textposition="outside",
                cliponaxis=False,
                textfont={"size": 11},
                hovertemplate="%{customdata:.4%} of budget (%{text})<extra>" + name + "</extra>",
            )
        )
    height = 90 + 46 * max(1, len(teams))
    fig.update_layout(
        **_layout("Budget use by team", "month to date and forecast, share of monthly budget"),
        barmode="group",
        legend=_LEGEND,
    )
    fig.update_layout(height=max(_HEIGHT, height), margin={**_MARGIN, "r": 150})
    fig.update_yaxes(autorange="reversed", title=None)
    fig.update_xaxes(title="share of budget", tickformat=_tick_format(top), range=[0, top])
    if top >= 1:
        fig.add_vline(
            x=1,
            line_dash="dash",
            line_color="#b42318",
            annotation_text="budget",
            annotation_position="top",
        )
    else:
        fig.add_annotation(
            text=f"100 % of budget is off this scale (the largest share is {_share(peak)})",
            xref="paper",
            yref="paper",
            x=1,
            y=1.0,
            xanchor="right",
            yanchor="bottom",
            showarrow=False,
            font={"size": 11, "color": "#b42318"},
        )
    return fig


# A bar narrower than this share of the axis would not be seen: it is drawn this wide.
MIN_BAR: Final = 0.006


def _share(value: float) -> str:
    """A share of budget as a person reads it: 12.5 %, 0.08 %, 0.0012 %."""
    pct = 100 * value
    if pct == 0:
        return "0 %"
    digits = 1 if pct >= 1 else max(2, 1 - math.floor(math.log10(pct)) + 1)
    return f"{pct:,.{digits}f} %"


def _tick_format(top: float) -> str:
    pct = 100 * top
    digits = 0 if pct >= 5 else max(1, 1 - math.floor(math.log10(pct)))
    return f".{digits}%"
