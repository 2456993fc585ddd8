"""SLA: the share of requests within the TTFT target per model and use case, and the worst hours."""

from __future__ import annotations

from typing import Any

import polars as pl
from dash import Dash, Input, Output, html

from dashboards.client import BillingError
from dashboards.components import frame_table, note, page
from dashboards.context import Context
from dashboards.data import fetch_queries, local_times

PATH = "/sla"
TITLE = "SLA"


def layout(ctx: Context) -> html.Div:
    """The SLA page's frame; ``register`` fills it."""
    return page(
        TITLE,
        html.Div(id="sla-status"),
        html.H3("Compliance by model and use case"),
        html.Div(id="sla-models"),
        html.H3("Compliance by model and team"),
        html.Div(id="sla-teams"),
        html.H3("Worst hours by TTFT p95"),
        html.Div(id="sla-worst"),
    )


def compliance_frames(ctx: Context, rows: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per model and use case, per model and team) with targets and the share within them."""
    targets = pl.DataFrame(
        [
            {
                "model": m.name,
                "use_case": m.use_case,
                "ttft_p95_target_seconds": m.sla.ttft_p95_seconds,
            }
            for m in ctx.config.models
        ]
    )
    share = (100 * pl.col("within_sla") / pl.col("ttft_requests")).round(2)
    if rows.height == 0:
        rows = pl.DataFrame(
            schema={
                "model": pl.String,
                "team": pl.String,
                "ttft_requests": pl.Int64,
                "within_sla": pl.Int64,
            }
        )
    by_team = rows.join(targets, on="model", how="left").with_columns(compliance_pct=share)
    by_model = (
        by_team.group_by("model", "use_case", "ttft_p95_target_seconds")
        .agg(pl.col("ttft_requests").sum(), pl.col("within_sla").sum())
        .with_columns(compliance_pct=share)
        .sort("model")
    )
    cols = [
        "model",
        "team",
        "use_case",
        "ttft_p95_target_seconds",
        "ttft_requests",
        "within_sla",
        "compliance_pct",
    ]
    return by_model, by_team.select(cols).sort("model", "team")


def _share(frame: pl.DataFrame) -> float | None:
    """Requests within target as a percentage of all, over every row of ``frame``."""
    asked = int(frame["ttft_requests"].sum()) if frame.height else 0
    return round(100 * int(frame["within_sla"].sum()) / asked, 2) if asked else None


def register(app: Dash, ctx: Context) -> None:
    """The SLA page's callback, refreshed on the interval."""
    targets = {m.name: m.sla.ttft_p95_seconds for m in ctx.config.models}

    @app.callback(
        Output("sla-status", "children"),
        Output("sla-models", "children"),
        Output("sla-teams", "children"),
        Output("sla-worst", "children"),
        Input("tick", "n_intervals"),
        Input("range", "value"),
        Input("auth", "data"),
        Input("tz", "data"),
    )
    def refresh(_: int, choice: str | None, auth: Any, tz: str | None) -> list[Any]:
        session = ctx.session(auth)
        if session is None:
            return [note("Sign in to see SLA compliance."), None, None, None]
        shown = ctx.window(session, choice)
        start, end = shown.start, shown.end
        try:
            frames = fetch_queries(ctx.client, session.token, ["sla", "worst_hours"], start, end)
            rows, worst = frames["sla"], frames["worst_hours"]
        except BillingError as exc:
            return [note(str(exc), "error"), None, None, None]
        by_model, by_team = compliance_frames(ctx, rows)
        if worst.height:
            worst = (
                local_times(worst, tz)
                .with_columns(
                    over_target=pl.col("p95_seconds")
                    > pl.col("model").replace_strict(targets, default=None),
                    p95_seconds=pl.col("p95_seconds").round(3),
                )
                .rename({"t": "hour"})
            )
        totals = {"compliance_pct": _share(by_model)}
        return [
            html.P(
                "Within target: the share of requests whose time to first token was within "
                "the model's p95 target, over the range picked above."
            ),
            frame_table(
                by_model,
                "sla-models-table",
                total=("ttft_requests", "within_sla"),
                total_values=totals,
                empty="No requests in range.",
            ),
            frame_table(
                by_team,
                "sla-teams-table",
                total=("ttft_requests", "within_sla"),
                total_values=totals,
                empty="No requests in range.",
            ),
            frame_table(worst, "sla-worst-table", empty="No requests in range."),
        ]
