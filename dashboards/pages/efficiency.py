"""Efficiency: where the month's GPU money went, hour by hour, and the plan that would save it.

The plan and figures are billing's (``/v1/efficiency/{month}``, with the signed-in user's
token): the admin sees every replica group, every change and why a model got none; a team its
own hourly figures and the changes about its own requests. Each change is shown with its saving
within the plan and its share of the cost it rests on, the replay that proves it (GPU-hours, each
team's TTFT and inter-token p95 before and after, against the target) and the measured figures,
labelled, so the saving can be checked, not trusted. Beside the plan, its saving on the spend
forecast's basis (the month so far over the elapsed share of the month) stands next to the
forecast itself.
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
    (
        "efficiency-occupancy",
        "batch_occupancy",
        "Batch occupancy (fuller of slots and KV cache)",
        "share",
    ),
    ("efficiency-kv", "kv_cache_usage", "KV-cache use", "share"),
    ("efficiency-prefix", "prefix_cache_hit_rate", "Prefix-cache hit rate", "share"),
    ("efficiency-idle", "idle_share", "Idle share of GPU time", "share"),
    ("efficiency-cost", "usd_per_1m_output_tokens", "Cost per 1M output tokens", "USD"),
)
TEAM_CHARTS: Final = (
    ("efficiency-tokens", "tokens_per_gpu_second", "Tokens per GPU-second held", "tokens/s"),
    ("efficiency-cost", "usd_per_1m_output_tokens", "Cost per 1M output tokens", "USD"),
    ("efficiency-occupancy", "cost_usd", "Cost per hour (in-flight share)", "USD"),
    ("efficiency-kv", "joules_per_token", "Energy per token", "J/token"),
    ("efficiency-prefix", "cached_prompt_share", "Prompt tokens served from cache", "share"),
    ("efficiency-idle", "requests", "Requests per hour", "requests"),
)
# Shares are shown in percent, as the charts draw them (``idle_share`` is one by its name).
SUMMARY_KINDS: Final[dict[str, Kind]] = {"batch_occupancy": "share", "engines": "number"}
_PLAN_COLUMNS: Final = (
    "saving_usd_per_month",
    "share_of_cost_pct",
    "kind",
    "team",
    "title",
    "replay",
    "sla",
    "evidence",
    "assumptions",
    "caveat",
)
_PLAN_KINDS: Final[dict[str, Kind]] = {
    "saving_usd_per_month": "usd",
    "kind": "text",
    "team": "text",
    "title": "text",
    "replay": "text",
    "sla": "text",
    "evidence": "text",
    "assumptions": "text",
    "caveat": "text",
}


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
        html.H3("The plan: what would save money, proven by replaying the month"),
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


def _figure(key: str, value: Any) -> str:
    """One evidence figure as ``label value``: shares in percent, 24 equal hours as one value."""
    label = key.replace("_", " ")
    if isinstance(value, int | float) and not isinstance(value, bool) and _is_share(key):
        return f"{label} {format_cell(value, 'share')}"
    if isinstance(value, list) and len(value) == 24:
        known = [v for v in value if v is not None]
        if known and len(set(known)) == 1:
            return f"{label} {_number(known[0])} every hour"
        return f"{label} by hour {', '.join('-' if v is None else _number(v) for v in value)}"
    if isinstance(value, dict):
        return f"{label} " + ", ".join(f"{k} {_number(v)}" for k, v in value.items())
    return f"{label} {_number(value)}"


def _is_share(key: str) -> bool:
    return kind_of(key) == "share" or key.endswith(("_rate", "share_of_peak"))


def _number(value: Any) -> str:
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:,.0f} ms" if value < 1 else f"{value:,.2f} s"


def _sla(replay: dict[str, Any]) -> str:
    """Each team's p95s before and after, against their targets, per model the change touches."""
    parts = []
    for model, r in replay.items():
        for before, after in zip(r["sla_before"], r["sla_after"], strict=False):
            text = (
                f"{model}/{after['team']}: TTFT {_seconds(before['ttft_p95_s'])} -> "
                f"{_seconds(after['ttft_p95_s'])} (target {_seconds(after['ttft_target_s'])})"
            )
            if after["itl_target_s"] is not None:
                text += (
                    f", inter-token {_seconds(before['itl_p95_s'])} -> "
                    f"{_seconds(after['itl_p95_s'])} (target {_seconds(after['itl_target_s'])})"
                )
            parts.append(text)
    return "; ".join(parts)


def plan_frame(recommendations: list[dict[str, Any]]) -> pl.DataFrame:
    """One row per change of the plan: its saving a month and share of the cost it rests on
    (the replayed cost of the models it touches), the change, its replay and SLA, its evidence."""
    rows = []
    for r in recommendations:
        replay = r.get("replay", {})
        before = sum(x["cost_usd_before"] for x in replay.values())
        rows.append(
            {
                "saving_usd_per_month": float(r["saving_usd_per_month"]),
                "share_of_cost_pct": 100 * r["saving_usd"] / before if before else None,
                "kind": r["kind"],
                "team": r["team"] or "",
                "title": r["title"],
                "replay": "; ".join(
                    f"{m}: GPU-hours {x['gpu_hours_before']:,.1f} -> {x['gpu_hours_after']:,.1f}"
                    for m, x in replay.items()
                ),
                "sla": _sla(replay),
                "evidence": "; ".join(_figure(k, v) for k, v in r["evidence"].items()),
                "assumptions": "; ".join(r["assumptions"]),
                "caveat": " ".join(x for x in (r["caveat"], _policy(r.get("policy_change"))) if x),
            }
        )
    schema = dict.fromkeys(_PLAN_COLUMNS, pl.String) | {
        "saving_usd_per_month": pl.Float64,
        "share_of_cost_pct": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema)


def _policy(change: dict[str, Any] | None) -> str:
    if not change:
        return ""
    return "Policy change needed: " + ", ".join(f"{v}" for v in change.values()) + "."


def plan_table(body: dict[str, Any]) -> Any:
    """The plan as a table with a total row: the plan's saving and its share of the cost."""
    recs = body["recommendations"]
    plan = body.get("plan", {})
    measured = plan.get("measured_usd") or 0.0
    share = 100 * plan.get("saving_usd", 0.0) / measured if measured else None
    return frame_table(
        plan_frame(recs),
        "efficiency-advice-table",
        _PLAN_COLUMNS,
        kinds=_PLAN_KINDS,
        total=("saving_usd_per_month",),
        total_values={"share_of_cost_pct": share},
    )


def plan_status(month: str, body: dict[str, Any], forecast_usd: float | None) -> str:
    """The plan in one line: a month at the measured run rate, and this month on the spend
    forecast's basis, beside the forecast."""
    recs, plan = body["recommendations"], body.get("plan", {})
    if not recs:
        return (
            f"{month}: no change to offer from the {plan.get('hours_measured', 0)} hours measured"
        )
    text = (
        f"{month}: one plan of {len(recs)} change{'s' * (len(recs) != 1)}, "
        f"{usd(body['saving_usd_per_month'])} a month at the run rate of the "
        f"{plan.get('hours_measured', 0)} hours measured; this month on the spend forecast's "
        f"basis {usd(plan.get('saving_usd_month_end', 0.0))}"
    )
    if forecast_usd is not None:
        text += f", of a forecast spend of {usd(forecast_usd)}"
    return text


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
            ((pl.col("batch_occupancy") * instance_hours).sum() / occupied.sum()).alias(
                "batch_occupancy"
            ),
            (1 - pl.col("busy_hours").sum() / instance_hours.sum()).alias("idle_share"),
        )
        .sort("replica")
    )


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
        try:
            month = check_month(month) if month else None
        except ValueError:
            # (The month list sends YYYY-MM; anything else is a hand-made callback.)
            month = None
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
            plan_status(month, body, _forecast(ctx, session.token, month)), id="efficiency-total"
        )
        advice: Any = (
            plan_table(body) if recs else note("Nothing to save from the use measured this month.")
        )
        if body.get("notes"):
            advice = html.Div(
                [
                    advice,
                    html.H4("Not advised"),
                    html.Ul([html.Li(n["text"]) for n in body["notes"]], id="efficiency-notes"),
                ]
            )
        if session.is_admin:
            rows, series, charts = frame_of(body["figures"]["groups"]), "replica", GROUP_CHARTS
            summary: Any = (
                frame_table(group_summary(rows), "efficiency-summary-table", kinds=SUMMARY_KINDS)
                if rows.height
                else note("No GPU time measured this month.")
            )
        else:
            rows, series, charts = frame_of(body["figures"]["teams"]), "model", TEAM_CHARTS
            summary = note("Replica groups span every team: the admin credential sees them.")
        rows = local_times(rows, tz)
        figures = [
            _chart(rows, column, series, title, axis, span)
            if column in rows.columns
            else _chart(pl.DataFrame(), "", "", title, axis, span)
            for _, column, title, axis in charts
        ]
        for figure in figures:  # hourly points: a month's first hour is one point, drawn as a dot
            figure.update_traces(mode="lines+markers")
        return [status, advice, summary, *figures]


def _forecast(ctx: Context, token: str, month: str) -> float | None:
    """The month-end spend forecast of the teams the token sees, for the month being shown."""
    if month != month_of(time.time()):
        return None  # a past month has no forecast but its spend, which the plan is not beside
    try:
        return sum(float(s["forecast_usd"]) for s in ctx.client.spend(token))
    except BillingError:
        return None


def _chart(rows: pl.DataFrame, column: str, series: str, title: str, axis: str, span: Any) -> Any:
    """One hourly chart over the month; shares are drawn in percent like every other page's."""
    kind: Literal["number", "share"] = "share" if axis == "share" else "number"
    return line_figure(
        rows, column, series, title, axis, span, kind=kind, empty="Nothing measured this month."
    )
