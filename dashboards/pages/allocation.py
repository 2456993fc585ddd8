"""Allocation: cost, GPU-hours, tokens, efficiency and idle per group, over any window.

A window (this month, last month, the last 7 days or 24 hours, or whole UTC days picked), a
grouping by one or two of team, model, replica group, instance, node and GPU model, and filters
on any of them: billing answers (``GET /v1/allocation``) with a row per group and their total,
which for whole months are the statement's to the cent, and each group's cost over time, drawn
stacked with the window's events marked. Clicking a row drills into it: its values become
filters and the rows are grouped by the next key. The download is the file billing wrote for
the very answer on screen, so it holds exactly the rows shown. A team key sees its own team.

Windows are in UTC, like statements: a month is a UTC month, a day a UTC day.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import plotly.graph_objects as go  # type: ignore[import-untyped]
import polars as pl
from dash import ALL, Dash, Input, Output, State, callback_context, dcc, html, no_update

from dashboards import events
from dashboards.client import BillingError
from dashboards.components import frame_table, graph, note, page, usd
from dashboards.context import Context
from dashboards.figures import colours_for, empty_figure, stacked_figure
from dashboards.formatting import as_of, label
from infermeter.months import month_bounds, month_of

__all__ = ["KEYS", "WINDOWS", "drill", "window_of"]

PATH = "/allocation"
TITLE = "Allocation"
KEYS: Final = ("team", "model", "replica", "instance", "node", "gpu_model")
WINDOWS: Final = {
    "month": "This month",
    "last-month": "Last month",
    "7d": "Last 7 days",
    "24h": "Last 24 hours",
    "custom": "Whole days (UTC)",
}
_OTHER_COLOUR: Final = "#98a2b3"
_HIDDEN: Final = {"display": "none"}


def _field(name: str, control: Any, width: str) -> html.Div:
    return html.Div(
        [html.Label(name, htmlFor=control.id), control],
        className="field",
        style={"minWidth": width},
    )


def _toolbar() -> html.Div:
    keys = [{"label": label(k), "value": k} for k in KEYS]
    windows = [{"label": v, "value": k} for k, v in WINDOWS.items()]
    controls = [
        _field(
            "Window",
            dcc.Dropdown(
                id="alloc-window", value="month", clearable=False, searchable=False, options=windows
            ),
            "10em",
        ),
        html.Div(
            dcc.DatePickerRange(id="alloc-dates", display_format="YYYY-MM-DD", minimum_nights=0),
            id="alloc-dates-field",
            style=_HIDDEN,
        ),
        _field(
            "Group by",
            dcc.Dropdown(
                id="alloc-by", options=keys, value="team", clearable=False, searchable=False
            ),
            "9em",
        ),
        _field(
            "Then by",
            dcc.Dropdown(
                id="alloc-then", options=keys, value=None, placeholder="(none)", searchable=False
            ),
            "9em",
        ),
        _field(
            "Filter",
            dcc.Dropdown(
                id="alloc-filter", multi=True, value=[], placeholder="every team, model, ..."
            ),
            "16em",
        ),
        html.Button("Clear filters", id="alloc-clear"),
        html.Button("Download CSV", id="alloc-csv-button"),
    ]
    return html.Div(controls, className="toolbar")


def layout(ctx: Context) -> html.Div:
    """The explorer's controls, its chart and its table; ``register`` fills them."""
    return page(
        TITLE,
        _toolbar(),
        dcc.Download(id="alloc-csv"),
        dcc.Store(id="alloc-shown"),
        html.Div(id="alloc-status"),
        html.Div(graph("alloc-chart"), className="wide"),
        html.Div(id="alloc-events"),
        html.Div(id="alloc-table"),
        html.Div(id="alloc-notes"),
    )


def _failed(message: str) -> list[Any]:
    """The explorer's outputs when there is nothing to show: ``message``, the filters kept."""
    return [note(message, "error"), empty_figure("", ""), None, None, None, no_update, None]


def window_of(
    choice: str | None, dates: tuple[str | None, str | None], now: float
) -> tuple[float, float]:
    """(from, to) Unix seconds for a window choice; whole UTC days for "custom" (``dates`` are
    its first and last day, YYYY-MM-DD), never past ``now``."""
    month = month_of(now)
    if choice == "last-month":
        start, _ = month_bounds(month)
        return month_bounds(month_of(start - 1))[0], start
    if choice == "7d":
        return now - 7 * 86400, now
    if choice == "24h":
        return now - 86400, now
    if choice == "custom" and dates[0]:
        first = dt.datetime.fromisoformat(dates[0]).replace(tzinfo=dt.UTC).timestamp()
        last = dt.datetime.fromisoformat(dates[1] or dates[0]).replace(tzinfo=dt.UTC).timestamp()
        return first, min(max(last, first) + 86400, max(now, first + 3600))
    return month_bounds(month)[0], now


def drill(
    by: Sequence[str], row: Sequence[str], filters: Sequence[str]
) -> tuple[str | None, list[str]]:
    """What clicking a row does: its key values become filters, and the rows are grouped by the
    first key not used yet (None: every key is used, nothing further to drill into)."""
    added = [f"{k}={v}" for k, v in zip(by, row, strict=True)]
    kept = [*filters, *(f for f in added if f not in filters)]
    used = set(by) | {f.split("=", 1)[0] for f in kept}
    return next((k for k in KEYS if k not in used), None), kept


def _params(start: float, end: float, by: Sequence[str], filters: Sequence[str]) -> dict[str, Any]:
    params: dict[str, Any] = {"from": start, "to": end, "by": ",".join(by)}
    for item in filters:
        key, _, value = item.partition("=")
        if key in KEYS:
            params.setdefault(key, []).append(value)
    return params


def _options(
    values: Mapping[str, Sequence[str]], team: str | None, chosen: Sequence[str]
) -> list[dict[str, str]]:
    """The filter's choices: every value of every key in the window (a team: not the team)."""
    found = [f"{k}={v}" for k in KEYS if not (k == "team" and team) for v in values.get(k, [])]
    for item in chosen:  # a chosen filter stays choosable even when nothing matches it now
        if item not in found:
            found.append(item)
    return [
        {"label": f"{label(f.split('=', 1)[0])}: {f.split('=', 1)[1]}", "value": f} for f in found
    ]


def _figure(answer: Mapping[str, Any], by: Sequence[str]) -> go.Figure:
    series = pl.DataFrame(
        answer["series"]["rows"], schema=answer["series"]["columns"], orient="row"
    )
    title = "Cost over time"
    if series.height == 0 or not any(series["cost_usd"]):
        return empty_figure(title, "No cost in this window.")
    step = "hour" if answer["step"] == 3600 else "day"
    order = [
        str(r[0]) if len(by) == 1 else " / ".join(str(v) for v in r[: len(by)])
        for r in answer["rows"]
    ]
    colours = colours_for([g for g in order if g != "other"])
    start = dt.datetime.fromtimestamp(answer["from"], dt.UTC).replace(tzinfo=None)
    end = dt.datetime.fromtimestamp(answer["to"], dt.UTC).replace(tzinfo=None)
    return stacked_figure(
        series,
        title,
        f"USD per {step} (UTC), stacked by {' and '.join(label(k).lower() for k in by)}",
        (start, end),
        order=order,
        colours={**colours, "other": _OTHER_COLOUR},
        step=answer["step"],
    )


def _status(answer: Mapping[str, Any], tz: str | None) -> html.Div:
    first = dt.datetime.fromtimestamp(answer["from"], dt.UTC)
    last = dt.datetime.fromtimestamp(answer["to"], dt.UTC)
    months = answer["months"]
    closed = [m["month"] for m in months if m["closed"]]
    whole = "For whole months these rows are the statement's lines, to the cent" + (
        f"; {', '.join(closed)} closed." if closed else "."
    )
    return html.Div(
        [
            html.P(
                f"{first:%Y-%m-%d %H:%M} to {last:%Y-%m-%d %H:%M} UTC, as of "
                f"{as_of(answer['as_of'], tz)} (your time). {whole}",
                id="alloc-window-text",
            ),
        ]
    )


def _notes(answer: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for m in answer["months"]:
        if m["adjustment_cents"]:
            out.append(
                note(
                    f"The statement of {m['month']} also carries {usd(m['adjustment_cents'] / 100)} of "
                    "adjustments for earlier, closed months: late records of their use, in no row here.",
                    note_id=f"alloc-adjustments-{m['month']}",
                )
            )
    out.append(
        note(
            "Efficiency: the share of a group's cost that paid for its own use (GPU time "
            "and energy while its requests ran); the rest is idle capacity charged to it. "
            "Spare GPUs are replica group and instance (none), model (unallocated)."
        )
    )
    return out


def _table(answer: Mapping[str, Any], by: Sequence[str]) -> html.Div:
    rows = pl.DataFrame(answer["rows"], schema=answer["columns"], orient="row")
    totals = {k: v for k, v in answer["total"].items() if k in answer["columns"]}
    return frame_table(
        rows,
        "alloc-rows",
        total_values=totals,
        row_id="alloc-row",
        kinds=dict.fromkeys(by, "text"),
        empty="No cost and no usage in this window.",
    )


def register(app: Dash, ctx: Context) -> None:
    """The explorer's callbacks: the answer, the drill-down, the download and the custom days."""

    @app.callback(Output("alloc-dates-field", "style"), Input("alloc-window", "value"))
    def dates(choice: str | None) -> dict[str, str]:
        return {} if choice == "custom" else _HIDDEN

    @app.callback(
        Output("alloc-status", "children"),
        Output("alloc-chart", "figure"),
        Output("alloc-events", "children"),
        Output("alloc-table", "children"),
        Output("alloc-notes", "children"),
        Output("alloc-filter", "options"),
        Output("alloc-shown", "data"),
        Input("alloc-window", "value"),
        Input("alloc-dates", "start_date"),
        Input("alloc-dates", "end_date"),
        Input("alloc-by", "value"),
        Input("alloc-then", "value"),
        Input("alloc-filter", "value"),
        Input("auth", "data"),
        Input("tick", "n_intervals"),
        State("tz", "data"),
    )
    def refresh(
        choice: str | None,
        first: str | None,
        last: str | None,
        by: str | None,
        then: str | None,
        filters: list[str] | None,
        auth: Any,
        _: Any,
        tz: str | None,
    ) -> list[Any]:
        session = ctx.session(auth)
        blank = empty_figure("", "")
        if session is None:
            return [note("Sign in to see the allocation."), blank, None, None, None, [], None]
        keys = [k for k in (by or "team", then) if k]
        keys = list(dict.fromkeys(keys))
        try:
            start, end = window_of(choice, (first, last), time.time())
        except ValueError:
            # (The date picker sends YYYY-MM-DD; anything else is a hand-made callback.)
            return _failed("Pick the first and last day as YYYY-MM-DD.")
        chosen = list(filters or [])
        try:
            answer = ctx.client.allocation(session.token, _params(start, end, keys, chosen))
        except BillingError as exc:
            return _failed(f"Allocation unavailable: {exc}.")
        found, problem = events.gather(
            ctx.client,
            session.token,
            session.is_admin,
            ctx.config.dashboard.prometheus_url,
            answer["from"],
            answer["to"],
        )
        colours = colours_for([m.name for m in ctx.config.models])
        figure = events.mark(_figure(answer, keys), events.events_frame(found, "UTC"), colours)
        legend = [note(events.LEGEND), *([note(problem, "error")] if problem else [])]
        team = None if session.is_admin else session.team
        shown = {
            "csv": answer["csv"],
            "by": keys,
            "keys": [[str(v) for v in r[: len(keys)]] for r in answer["rows"]],
            "filename": f"allocation-{'-'.join(keys)}-{dt.datetime.fromtimestamp(answer['from'], dt.UTC):%Y%m%dT%H}-"
            f"{dt.datetime.fromtimestamp(answer['to'], dt.UTC):%Y%m%dT%H}.csv",
        }
        return [
            _status(answer, tz),
            figure,
            html.Div(legend),
            _table(answer, keys),
            _notes(answer),
            _options(answer["values"], team, chosen),
            shown,
        ]

    @app.callback(
        Output("alloc-by", "value"),
        Output("alloc-then", "value"),
        Output("alloc-filter", "value"),
        Input({"type": "alloc-row", "index": ALL}, "n_clicks"),
        Input("alloc-clear", "n_clicks"),
        State("alloc-shown", "data"),
        State("alloc-filter", "value"),
        prevent_initial_call=True,
    )
    def drill_down(
        clicks: list[int | None], _: Any, shown: Any, filters: list[str] | None
    ) -> tuple[Any, Any, Any]:
        trigger = callback_context.triggered_id
        if trigger == "alloc-clear":
            return no_update, no_update, []
        if not isinstance(trigger, dict) or not shown:
            return no_update, no_update, no_update
        index = int(trigger["index"])
        # A table drawn anew fires this with no click: only a real click drills.
        if index >= len(clicks) or not clicks[index] or index >= len(shown["keys"]):
            return no_update, no_update, no_update
        following, kept = drill(shown["by"], shown["keys"][index], filters or [])
        if following is None:
            return no_update, no_update, kept
        return following, None, kept

    @app.callback(
        Output("alloc-csv", "data"),
        Input("alloc-csv-button", "n_clicks"),
        State("alloc-shown", "data"),
        prevent_initial_call=True,
    )
    def download(_: Any, shown: Any) -> Any:
        if not shown:
            return no_update
        return {
            "content": shown["csv"],
            "filename": shown["filename"],
            "type": "text/csv",
            "base64": False,
        }
