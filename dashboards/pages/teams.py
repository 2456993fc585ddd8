"""Teams: month-to-date spend against budget with a forecast, usage, unit cost and energy."""

from __future__ import annotations

import time
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]
import polars as pl
from dash import Dash, Input, Output, html

from dashboards.client import BillingError
from dashboards.components import frame_table, graph, note, page
from dashboards.context import Context, signed_in
from dashboards.data import statement_from_json
from infermeter.months import month_of

PATH = "/teams"
TITLE = "Teams"


def layout(ctx: Context) -> html.Div:
    """The teams page's frame; ``register`` fills it."""
    return page(
        TITLE,
        html.Div(id="teams-status"),
        html.Div(id="teams-spend"),
        graph("teams-spend-figure"),
        html.H3("Cost per 1M tokens by model"),
        html.Div(id="teams-models"),
    )


def spend_frame(spend: list[dict[str, Any]], lines: pl.DataFrame) -> pl.DataFrame:
    """One row per team: spend, budget, forecast, and the month's requests, tokens and energy."""
    usage = lines.group_by("team").agg(
        pl.col("requests").sum(),
        pl.col("prompt_tokens").sum(),
        pl.col("completion_tokens").sum(),
        pl.col("energy_kwh").sum().round(4),
    )
    frame = pl.DataFrame(
        spend,
        schema={
            "team": pl.String,
            "month": pl.String,
            "spent_usd": pl.Float64,
            "budget_usd": pl.Float64,
            "forecast_usd": pl.Float64,
        },
    )
    return (
        frame.join(usage, on="team", how="left")
        .with_columns(
            budget_used_pct=pl.when(pl.col("budget_usd") > 0)
            .then((100 * pl.col("spent_usd") / pl.col("budget_usd")).round(1))
            .otherwise(None)
        )
        .fill_null(0)
        .sort("team")
    )


def unit_cost_frame(lines: pl.DataFrame) -> pl.DataFrame:
    """Cost per million tokens (prompt + completion) by model, over the visible lines."""
    return (
        lines.group_by("model")
        .agg(
            (pl.col("total_cents").sum() / 100).alias("cost_usd"),
            (pl.col("prompt_tokens").sum() + pl.col("completion_tokens").sum()).alias("tokens"),
        )
        .with_columns(
            usd_per_million_tokens=pl.when(pl.col("tokens") > 0)
            .then((pl.col("cost_usd") * 1e6 / pl.col("tokens")).round(4))
            .otherwise(None)
        )
        .sort("model")
    )


def _figure(frame: pl.DataFrame) -> go.Figure:
    fig = go.Figure()
    for column, name in (
        ("spent_usd", "spent"),
        ("forecast_usd", "forecast"),
        ("budget_usd", "budget"),
    ):
        fig.add_trace(go.Bar(x=frame["team"].to_list(), y=frame[column].to_list(), name=name))
    fig.update_layout(title="Month to date: spent, forecast to month end, budget", barmode="group",
                      yaxis_title="USD", height=320, margin={"l": 50, "r": 10, "t": 40, "b": 30})  # fmt: skip
    return fig


def register(app: Dash, ctx: Context) -> None:
    """The teams page's callback, refreshed on the interval."""

    @app.callback(
        Output("teams-status", "children"),
        Output("teams-spend", "children"),
        Output("teams-spend-figure", "figure"),
        Output("teams-models", "children"),
        Input("tick", "n_intervals"),
        Input("auth", "data"),
    )
    def refresh(_: int, auth: Any) -> list[Any]:
        if not signed_in(auth):
            return [note("Sign in to see spend."), None, go.Figure(), None]
        token = auth["token"]
        try:
            spend = ctx.client.spend(token)
            month = spend[0]["month"] if spend else month_of(time.time())
            statement = statement_from_json(ctx.client.statement(token, month))
        except BillingError as exc:
            return [note(str(exc), "error"), None, go.Figure(), None]
        frame = spend_frame(spend, statement.lines)
        status = html.P(f"Month to date: {month}", id="teams-month")
        return [status, frame_table(frame, "teams-table"), _figure(frame),
                frame_table(unit_cost_frame(statement.lines), "teams-models-table")]  # fmt: skip
