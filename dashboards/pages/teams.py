"""Teams: month-to-date spend against budget with a forecast, the budget overrides in force,
usage, unit cost and energy, and each team's spend by project and end user.

Every figure here comes from the money snapshot the summary row fetched (``money`` store):
the same spend and statement, at the same moment, as the tiles above it.

The platform account is no team: it is charged the idle capacity no team pays for (spare GPUs,
groups whose idle policy is ``platform``) and the tokens the engines counted that no record
carries (its unattributed lines). Its row says so, and shows those tokens as unattributed, not
as requests or completions of its own, which it has none of.
"""

from __future__ import annotations

import time
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]
import polars as pl
from dash import Dash, Input, Output, html

from dashboards.client import BillingError
from dashboards.components import frame_table, graph, note, page
from dashboards.context import Context
from dashboards.data import statement_from_json
from dashboards.figures import budget_figure, empty_figure
from dashboards.formatting import as_of, moment
from infermeter.overrides import grant_state

PATH = "/teams"
TITLE = "Teams"
_SPEND_COLUMNS = (
    "team",
    "spent_usd",
    "forecast_usd",
    "budget_usd",
    "budget_used_pct",
    "budget_override",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "unattributed_tokens",
    "energy_kwh",
)
_UNATTRIBUTED = " (unattributed)"  # the model of an unattributed line ends so (billing's rule)


def layout(ctx: Context) -> html.Div:
    """The teams page's frame; ``register`` fills it."""
    return page(
        TITLE,
        html.Div(id="teams-status"),
        html.Div(id="teams-spend"),
        html.Div(graph("teams-spend-figure"), className="grid"),
        html.H3("Cost per million tokens by model, month to date"),
        html.Div(id="teams-models"),
        html.H3("Projects and users, month to date"),
        html.Div(id="teams-tags"),
    )


def platform_label(platform: str) -> str:
    """The platform account's row: what it is charged for, since it is no team."""
    return f"{platform} (idle capacity, unattributed tokens)"


def override_text(row: dict[str, Any], now: float, tz: str | None) -> str | None:
    """What a spend row's ``override`` (billing's last grant for the team) means at ``now``:
    ``until <its end>`` while it lets the team past its budget; None when there is none, it
    has ended, or it was a revocation."""
    state = grant_state(row.get("override"), now)
    return f"until {moment(state[1], tz)}" if state is not None and state[0] == "until" else None


def spend_frame(
    spend: list[dict[str, Any]],
    lines: pl.DataFrame,
    platform: str,
    now: float = 0.0,
    tz: str | None = None,
) -> pl.DataFrame:
    """One row per team: spend, budget, forecast, the override letting it past its budget at
    ``now`` (its end in zone ``tz``), and the month's requests, tokens and energy.

    Tokens of unattributed lines are counted apart; the platform account's row has no requests,
    prompts, completions or budget of its own (missing, not zero).
    """
    unattributed = pl.col("model").str.ends_with(_UNATTRIBUTED)
    own = pl.when(unattributed).then(0)
    usage = lines.group_by("team").agg(
        pl.col("requests").sum(),
        own.otherwise(pl.col("prompt_tokens")).sum().alias("prompt_tokens"),
        own.otherwise(pl.col("completion_tokens")).sum().alias("completion_tokens"),
        pl.when(unattributed)
        .then(pl.col("prompt_tokens") + pl.col("completion_tokens"))
        .otherwise(0)
        .sum()
        .alias("unattributed_tokens"),
        pl.col("energy_kwh").sum().round(4),
    )
    frame = pl.DataFrame(
        [{**row, "budget_override": override_text(row, now, tz)} for row in spend],
        schema={
            "team": pl.String,
            "month": pl.String,
            "spent_usd": pl.Float64,
            "budget_usd": pl.Float64,
            "forecast_usd": pl.Float64,
            "budget_override": pl.String,
        },
    )
    counts = ("requests", "prompt_tokens", "completion_tokens", "unattributed_tokens", "energy_kwh")
    is_platform = pl.col("team") == platform
    mine = ("requests", "prompt_tokens", "completion_tokens", "budget_usd")
    return (
        frame.join(usage, on="team", how="left")
        .with_columns(
            budget_used_pct=pl.when(pl.col("budget_usd") > 0)
            .then(100 * pl.col("spent_usd") / pl.col("budget_usd"))
            .otherwise(None)
        )
        .with_columns(pl.col(counts).fill_null(0))
        .with_columns(pl.when(is_platform).then(None).otherwise(pl.col(c)).alias(c) for c in mine)
        .sort(is_platform, "team")
        .with_columns(
            team=pl.when(is_platform)
            .then(pl.lit(platform_label(platform)))
            .otherwise(pl.col("team"))
        )
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


# A request that named no project or no user (billing's null), as the table shows it.
NO_PROJECT, NO_USER = "(no project)", "(no user)"
_TAG_COLUMNS = (
    "team",
    "project",
    "user",
    "cost_usd",
    "requests",
    "prompt_tokens",
    "completion_tokens",
)


def tags_frame(rows: list[dict[str, Any]], platform: str) -> pl.DataFrame:
    """Spend per team, project and end user over the month's breakdown rows (every model and
    line summed), the largest first within a team; the platform account, no team, left out."""
    schema = {
        "team": pl.String,
        "project": pl.String,
        "user": pl.String,
        "total_cents": pl.Int64,
        "requests": pl.Int64,
        "prompt_tokens": pl.Int64,
        "completion_tokens": pl.Int64,
    }
    frame = pl.DataFrame([{k: r.get(k) for k in schema} for r in rows], schema=schema)
    return (
        frame.filter(pl.col("team") != platform)
        .with_columns(pl.col("project").fill_null(NO_PROJECT), pl.col("user").fill_null(NO_USER))
        .group_by("team", "project", "user")
        .agg(pl.col("total_cents", "requests", "prompt_tokens", "completion_tokens").sum())
        .with_columns(cost_usd=pl.col("total_cents") / 100)
        .sort(["team", "total_cents", "project", "user"], descending=[False, True, False, False])
        .select(_TAG_COLUMNS)
    )


def _tags_table(frame: pl.DataFrame) -> html.Div:
    return frame_table(
        frame, "teams-tags-table", total=_TAG_COLUMNS[3:], empty="No requests this month yet."
    )


def budget_used_percent(frame: pl.DataFrame) -> float | None:
    """The total row's share of budget used, as the chargeback CSV's: the teams with a budget,
    over their budgets (a team without one, and the platform's idle capacity, are in no
    budget); None when no team has one."""
    budgeted = frame.filter(pl.col("budget_usd").fill_null(0) > 0)
    budget = float(budgeted["budget_usd"].sum()) if budgeted.height else 0.0
    return 100 * float(budgeted["spent_usd"].sum()) / budget if budget > 0 else None


def _spend_table(frame: pl.DataFrame) -> html.Div:
    used = budget_used_percent(frame)
    return frame_table(
        frame,
        "teams-table",
        _SPEND_COLUMNS,
        total=tuple(
            c for c in _SPEND_COLUMNS[1:] if c not in ("budget_used_pct", "budget_override")
        ),
        total_values={"budget_used_pct": used},
    )


def _models_table(lines: pl.DataFrame) -> html.Div:
    frame = unit_cost_frame(lines)
    cost, tokens = float(frame["cost_usd"].sum()), float(frame["tokens"].sum())
    per_million = cost * 1e6 / tokens if tokens > 0 else None
    return frame_table(
        frame,
        "teams-models-table",
        total=("cost_usd", "tokens"),
        total_values={"usd_per_million_tokens": per_million},
        empty="No usage this month yet.",
    )


def _figure(frame: pl.DataFrame) -> go.Figure:
    budgeted = frame.filter(pl.col("budget_usd").fill_null(0) > 0)
    if budgeted.height == 0:
        return empty_figure("Budget use by team", "No team shown here has a monthly budget.")
    if float(budgeted["forecast_usd"].sum()) == 0:
        return empty_figure(
            "Budget use by team",
            "Nothing spent this month yet; the budgets are in the table above.",
        )
    return budget_figure(
        budgeted["team"].to_list(),
        (100 * budgeted["spent_usd"] / budgeted["budget_usd"]).to_list(),
        (100 * budgeted["forecast_usd"] / budgeted["budget_usd"]).to_list(),
        budgeted["spent_usd"].to_list(),
        budgeted["forecast_usd"].to_list(),
    )


def register(app: Dash, ctx: Context) -> None:
    """The teams page's callback, run whenever the summary fetches a new money snapshot."""

    @app.callback(
        Output("teams-status", "children"),
        Output("teams-spend", "children"),
        Output("teams-spend-figure", "figure"),
        Output("teams-models", "children"),
        Input("money", "data"),
        Input("auth", "data"),
        Input("tz", "data"),
    )
    def refresh(money: Any, auth: Any, tz: str | None) -> list[Any]:
        if ctx.session(auth) is None:
            return [note("Sign in to see spend."), None, empty_figure("", ""), None]
        if not money:
            return [note("Waiting for billing's figures..."), None, empty_figure("", ""), None]
        lines = statement_from_json(money["statement"]).lines
        platform = ctx.config.billing.platform_account
        # Billing reads its overrides at each ask for the spend: judged at this moment, not
        # at the statement's.
        frame = spend_frame(money["spend"], lines, platform, time.time(), tz)
        status = html.P(
            f"Month to date: {money['month']}, as of {as_of(money['as_of'], tz)}", id="teams-month"
        )
        return [status, _spend_table(frame), _figure(frame), _models_table(lines)]

    @app.callback(Output("teams-tags", "children"), Input("money", "data"), Input("auth", "data"))
    def tags(money: Any, auth: Any) -> Any:
        # Its own fetch, with the signed-in key: a team lead gets its own team's rows only.
        session = ctx.session(auth)
        if session is None or not money:
            return None
        try:
            body = ctx.client.breakdown(session.token, money["month"])
        except BillingError as exc:
            return note(str(exc), "error")
        frame = tags_frame(body["rows"], ctx.config.billing.platform_account)
        shown = _tags_table(frame)
        if body.get("truncated"):
            return html.Div(
                [note(f"The first {len(body['rows'])} of {body['total_rows']} rows."), shown]
            )
        return shown
