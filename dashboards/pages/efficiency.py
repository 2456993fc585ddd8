"""Efficiency: where the month's GPU money went, hour by hour, and what would save it.

The recommendations and figures are billing's (``/v1/efficiency/{month}``, with the signed-in
user's token): the admin sees every replica group and every recommendation, a team its own
hourly figures and the advice about its own requests. Each recommendation is shown with the
measured figures it rests on and what it assumes, so the saving can be checked, not trusted.
"""

from __future__ import annotations

import time
from typing import Any, Final, Literal
from urllib.parse import parse_qs

import polars as pl
from dash import Dash, Input, Output, dcc, html

from dashboards.client import BillingError
from dashboards.components import frame_table, graph, note, page, usd
from dashboards.context import Context
from dashboards.data import local_range, local_times, recent_months
from dashboards.figures import line_figure
from dashboards.formatting import Kind, format_cell, kind_of
from infermeter.months import check_month, month_bounds, month_of

PATH = "/efficiency"
TITLE = "Efficiency"

# (graph id, column, title, axis) for the replica groups (admin) and for a team's own rows.
GROUP_CHARTS: Final = (
    ("efficiency-tokens", "tokens_per_gpu_second", "Tokens per GPU-second", "tokens/s"),
    ("efficiency-occupancy", "batch_occupancy", "Batch occupancy (running / max_num_seqs)", "share"),
    ("efficiency-kv", "kv_cache_usage", "KV-cache use", "share"),
    ("efficiency-prefix", "prefix_cache_hit_rate", "Prefix-cache hit rate", "share"),
    ("efficiency-idle", "idle_share", "Idle share of GPU time", "share"),
    ("efficiency-cost", "usd_per_1m_output_tokens", "Cost per 1M output tokens", "USD"),
)  # fmt: skip
TEAM_CHARTS: Final = (
    ("efficiency-tokens", "tokens_per_gpu_second", "Tokens per GPU-second held", "tokens/s"),
    ("efficiency-cost", "usd_per_1m_output_tokens", "Cost per 1M output tokens", "USD"),
    ("efficiency-occupancy", "cost_usd", "Cost per hour (in-flight share)", "USD"),
    ("efficiency-kv", "joules_per_token", "Energy per token", "J/token"),
    ("efficiency-prefix", "cached_prompt_share", "Prompt tokens served from cache", "share"),
    ("efficiency-idle", "requests", "Requests per hour", "requests"),
)  # fmt: skip
# Shares are shown in percent, as the charts draw them (``idle_share`` is one by its name).
SUMMARY_KINDS: Final[dict[str, Kind]] = {"batch_occupancy": "share", "engines": "number"}
_ADVICE_COLUMNS: Final = ("saving_usd_per_month", "kind", "model", "team", "title", "evidence",
                          "assumptions", "caveat")  # fmt: skip


def layout(ctx: Context) -> html.Div:
    """The efficiency page's frame: month picker, advice, per-group summary, charts."""
    del ctx
    return page(
        TITLE,
        html.Div(
            [
                html.Label("Month", htmlFor="efficiency-month"),
                dcc.Dropdown(id="efficiency-month", clearable=False, style={"width": "12em"}),
            ],
            className="toolbar",
        ),
        html.Div(id="efficiency-status"),
        html.H3("What would save money"),
        html.Div(id="efficiency-advice"),
        html.H3("The month by replica group"),
        html.Div(id="efficiency-summary"),
        html.Div([graph(g) for g, *_ in GROUP_CHARTS], className="grid"),
    )


def frame_of(figures: dict[str, Any]) -> pl.DataFrame:
    """A figures table (columns and rows, as billing sends it) as a frame."""
    columns: list[str] = figures["columns"]
    if not figures["rows"]:
        return pl.DataFrame(schema=dict.fromkeys(columns, pl.Float64))
    return pl.DataFrame(figures["rows"], schema=columns, orient="row", infer_schema_length=None)


def advice_frame(recommendations: list[dict[str, Any]]) -> pl.DataFrame:
    """One row per recommendation: its saving, what, why (evidence) and what it assumes.

    Evidence that is a share (``*_share``, ``*_rate``) reads in percent, as on the charts.
    """

    def text(key: str, value: Any) -> str:
        if isinstance(value, int | float) and not isinstance(value, bool) and _is_share(key):
            return format_cell(value, "share")
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    rows = [{
        "saving_usd_per_month": usd(r["saving_usd_per_month"]), "kind": r["kind"],
        "model": r["model"], "team": r["team"] or "", "title": r["title"],
        "evidence": "; ".join(f"{k} = {text(k, v)}" for k, v in r["evidence"].items()),
        "assumptions": "; ".join(r["assumptions"]), "caveat": r["caveat"] or "",
    } for r in recommendations]  # fmt: skip
    return pl.DataFrame(rows, schema=dict.fromkeys(_ADVICE_COLUMNS, pl.String))


def _is_share(key: str) -> bool:
    return kind_of(key) == "share" or key.endswith(("_rate", "share_of_peak"))


def group_summary(groups: pl.DataFrame) -> pl.DataFrame:
    """Each replica group's month: engines, GPU-hours, cost, tokens per GPU-second, occupancy,
    idle share.

    Summed from the hourly rows the way each hour is: the idle share is 1 - busy over measured
    instance-hours, the engines the mean live instances of the hours measured, the occupancy
    weighted by instance-hours; so a group whose instance count changes reads as it ran.
    """
    if groups.height == 0:
        return groups
    tokens = pl.col("prompt_tokens") + pl.col("completion_tokens")
    instance_hours = pl.col("instance_hours")
    occupied = instance_hours.filter(pl.col("batch_occupancy").is_not_null())
    return (
        groups.group_by("replica")
        .agg(
            pl.col("model").drop_nulls().first(),
            pl.col("engines").mean(),
            pl.col("gpu_hours").sum(),
            pl.col("cost_usd").sum(),
            pl.col("requests").sum(),
            (tokens.sum() / (pl.col("gpu_hours").sum() * 3600)).alias("tokens_per_gpu_second"),
            ((pl.col("batch_occupancy") * instance_hours).sum() / occupied.sum()).alias("batch_occupancy"),
            (1 - pl.col("busy_hours").sum() / instance_hours.sum()).alias("idle_share"),
        )
        .sort("replica")
    )  # fmt: skip


def register(app: Dash, ctx: Context) -> None:
    """The month picker (``?month=`` in the address picks it) and the month's advice and charts."""

    @app.callback(
        Output("efficiency-month", "options"),
        Output("efficiency-month", "value"),
        Input("auth", "data"),
        Input("url", "search"),
    )
    def months(auth: Any, search: str | None) -> tuple[list[str], str]:
        del auth
        asked = parse_qs((search or "").lstrip("?")).get("month", [None])[0]
        try:
            month = check_month(asked) if asked else month_of(time.time())
        except ValueError:
            month = month_of(time.time())
        return recent_months([month]), month

    outputs = [Output(g, "figure") for g, *_ in GROUP_CHARTS]

    @app.callback(
        Output("efficiency-status", "children"),
        Output("efficiency-advice", "children"),
        Output("efficiency-summary", "children"),
        *outputs,
        Input("efficiency-month", "value"),
        Input("auth", "data"),
        Input("tz", "data"),
    )
    def show(month: str | None, auth: Any, tz: str | None) -> list[Any]:
        span = local_range(*month_bounds(month), tz) if month else local_range(0.0, 3600.0, tz)
        empty = [
            _chart(pl.DataFrame(), "", "", title, axis, span) for _, _, title, axis in GROUP_CHARTS
        ]
        session = ctx.session(auth)
        if session is None or not month:
            return [note("Sign in and pick a month."), None, None, *empty]
        try:
            body = ctx.client.efficiency(session.token, month)
        except BillingError as exc:
            return [note(str(exc), "error"), None, None, *empty]
        recs = body["recommendations"]
        status = html.P(
            f"{month}: {len(recs)} recommendation{'s' * (len(recs) != 1)}, "
            f"{usd(body['saving_usd_per_month'])} a month in all (each is priced on its own; two "
            "on the same model overlap)",
            id="efficiency-total",
        )
        advice = (frame_table(advice_frame(recs), "efficiency-advice-table")
                  if recs else note("Nothing to save from the use measured this month."))  # fmt: skip
        if session.is_admin:
            rows, series, charts = frame_of(body["figures"]["groups"]), "replica", GROUP_CHARTS
            summary: Any = frame_table(group_summary(rows), "efficiency-summary-table",
                                       kinds=SUMMARY_KINDS) \
                if rows.height else note("No GPU time measured this month.")  # fmt: skip
        else:
            rows, series, charts = frame_of(body["figures"]["teams"]), "model", TEAM_CHARTS
            summary = note("Replica groups span every team: the admin credential sees them.")
        rows = local_times(rows, tz)
        figures = [_chart(rows, column, series, title, axis, span) if column in rows.columns
                   else _chart(pl.DataFrame(), "", "", title, axis, span)
                   for _, column, title, axis in charts]  # fmt: skip
        for figure in figures:  # hourly points: a month's first hour is one point, drawn as a dot
            figure.update_traces(mode="lines+markers")
        return [status, advice, summary, *figures]


def _chart(rows: pl.DataFrame, column: str, series: str, title: str, axis: str, span: Any) -> Any:
    """One hourly chart over the month; shares are drawn in percent like every other page's."""
    kind: Literal["number", "share"] = "share" if axis == "share" else "number"
    return line_figure(rows, column, series, title, axis, span, kind=kind,
                       empty="Nothing measured this month.")  # fmt: skip
