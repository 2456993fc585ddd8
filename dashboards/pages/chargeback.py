"""Chargeback: a month's statement as exported, its downloads, its reconciliation, its basis.

Below the lines: whether they are on list prices or scaled to imported invoices (the
allocation basis), each node pool's cost on both bases with the difference explained (the
admin's and finance's view), and each team's prompt-cache savings. On a central billing
(``billing.role: central``), the admin also sees its clusters: each one's total for the month,
whether what the central holds of it is stale, and since when; and their closed month's hours:
whether each cluster's hourly cost adds up to its lines, the engines' tokens against the
ledger's, and its instances' hours.

The table and the downloads are billing's own files (its export routes, with the signed-in
user's token): the page shows and saves what finance would get, formatted for reading, and
builds no file itself. Billing computes the statement and the file when asked, so the page
agrees with ``/v1/spend`` and the command line at the time it shows.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal
from urllib.parse import parse_qs

import polars as pl
from dash import Dash, Input, Output, State, dcc, html, no_update

from dashboards.client import BillingError, Download
from dashboards.components import csv_table, note, page, usd
from dashboards.context import Context
from dashboards.data import recent_months, statement_from_json
from dashboards.formatting import as_of
from dashboards.sessions import Session
from infermeter.months import check_month, month_of
from infermeter.statement import Statement

PATH = "/chargeback"
TITLE = "Chargeback"


def layout(ctx: Context) -> html.Div:
    """The chargeback page's frame: month picker, downloads, statement, reconciliation."""
    return page(
        TITLE,
        html.Div(
            [
                html.Label("Month", htmlFor="chargeback-month"),
                dcc.Dropdown(id="chargeback-month", clearable=False, style={"width": "12em"}),
                html.Button("Download CSV", id="chargeback-csv-button"),
                html.Button("Download FOCUS 1.0", id="chargeback-focus-button"),
            ],
            className="toolbar",
        ),
        dcc.Download(id="chargeback-csv"),
        dcc.Download(id="chargeback-focus"),
        html.Div([html.Div(id="chargeback-csv-error"), html.Div(id="chargeback-focus-error")]),
        html.Div(id="chargeback-reconciliation"),
        html.Div(id="chargeback-table"),
        html.Div(id="chargeback-bases"),
        html.Div(id="chargeback-clusters"),
    )


def _reconciliation(body: dict[str, Any], total_cents: int, platform: str) -> html.Div:
    if "fleet_cents" not in body:
        return html.Div(
            html.P(f"Your team's lines: {usd(total_cents / 100)}", id="chargeback-total")
        )
    lines = body["lines"]
    platform_cents = sum(int(x["total_cents"]) for x in lines if x["team"] == platform)
    fleet, adjust = int(body["fleet_cents"]), int(body["adjustment_cents"])
    ok = total_cents == fleet + adjust
    return html.Div(
        [
            html.P(
                f"Team lines {usd((total_cents - platform_cents) / 100)} + platform "
                f"{usd(platform_cents / 100)} = {usd(total_cents / 100)}",
                id="chargeback-total",
            ),
            html.P(
                f"Fleet cost {usd(fleet / 100)} + adjustments for closed months {usd(adjust / 100)} "
                f"= {usd((fleet + adjust) / 100)}",
                id="chargeback-fleet",
            ),
            html.P(
                "Reconciles to the cent" if ok else "Does NOT reconcile",
                id="chargeback-reconciles",
                className="ok" if ok else "note-error",
            ),
        ]
    )


# The pools table's money columns: cents in the statement, USD on the page.
_POOL_MONEY = ("list", "committed", "unused_commitment", "invoice", "allocation", "difference")


def pools_csv(pools: pl.DataFrame) -> str:
    """A statement's node pools (``POOL_SCHEMA``) as a CSV the finance table shows: cents as USD."""
    frame = pools.select(
        "pool",
        "category",
        "gpu_hours",
        *((pl.col(f"{c}_cents").cast(pl.Float64) / 100).alias(f"{c}_usd") for c in _POOL_MONEY),
        "commitment_utilization",
        "explanation",
    )
    return frame.write_csv()


def cache_csv(cache: pl.DataFrame) -> str:
    """A statement's prompt-cache rows (``CACHE_SCHEMA``) as a CSV: savings in USD."""
    return cache.select(
        "team",
        "model",
        "prompt_tokens",
        "cached_prompt_tokens",
        (pl.col("cache_savings_cents").cast(pl.Float64) / 100).alias("cache_savings_usd"),
    ).write_csv()


def _bases(body: dict[str, Any], statement: Statement) -> html.Div:
    """Which basis the lines are on, each pool's cost on both, and the prompt-cache savings."""
    if statement.basis == "allocation" and statement.usage_lines is not None:
        listed = (
            int(statement.usage_lines["total_cents"].sum()) if statement.usage_lines.height else 0
        )
        said = (
            f"Allocation basis: node pools with an imported invoice are scaled to it, so their "
            f"lines add up to the invoice. At list prices (the usage basis) the same lines come "
            f"to {usd(listed / 100)}."
        )
    else:
        said = "List prices: no invoice has been imported for this month."
    parts: list[Any] = [html.P(said, id="chargeback-basis")]
    if "pools" in body:
        parts += [
            html.H3("Node pools"),
            csv_table(pools_csv(statement.pools), "chargeback-pools", empty="No GPU time priced."),
        ]
    parts += [
        html.H3("Prompt caching"),
        csv_table(cache_csv(statement.cache), "chargeback-cache", empty="No prompt-cache hits."),
    ]
    return html.Div(parts)


def _blank_columns(text: str, columns: tuple[str, ...]) -> list[str]:
    """Those of ``columns`` that are empty on every row of the CSV ``text``."""
    rows = list(csv.DictReader(io.StringIO(text)))
    return [c for c in columns if not any(r.get(c) for r in rows)]


def _empty_month(ctx: Context, session: Session, month: str, lines: int) -> list[Any]:
    """A note when ``month`` has no line at all: every figure is zero, which a typo also gives."""
    if lines:
        return []
    whose = "the ledger holds" if session.is_admin else "billing holds for your team"
    known = ""
    if session.is_admin:
        try:
            months = [m["month"] for m in ctx.client.months(session.token)]
        except BillingError:
            months = []
        known = f" Months with data: {', '.join(months)}." if months else " The ledger is empty."
    return [
        note(
            f"No data for {month}: {whose} no usage or GPU time in it, so every figure is "
            f"zero. Is it the month you meant?{known}",
            note_id="chargeback-empty",
        )
    ]


def clusters_csv(body: dict[str, Any]) -> str:
    """A central's statement across clusters (``/v1/federation/statement``) as a CSV of one row
    per cluster: its total in USD, whether its month is closed there, whether it is stale and
    since when (UTC), and the last pull's error."""
    rows = [
        {
            "cluster": c["cluster"],
            "month_closed": "yes" if c["closed"] else "no",
            "total_usd": int(c["total_cents"]) / 100,
            "stale": "yes" if c["stale"] else "no",
            "stale_since": utc(c["stale_since"]) if c["stale_since"] is not None else "",
            "last_pulled": utc(c["pulled_at"]) if c["pulled_at"] is not None else "never",
            "error": c["error"] or "",
        }
        for c in body["clusters"]
    ]
    schema = {
        "cluster": pl.String,
        "month_closed": pl.String,
        "total_usd": pl.Float64,
        "stale": pl.String,
        "stale_since": pl.String,
        "last_pulled": pl.String,
        "error": pl.String,
    }
    return pl.DataFrame(rows, schema=schema).write_csv()


def cluster_hours_csv(body: dict[str, Any]) -> str:
    """A central's hours across clusters (``/v1/federation/hours``) as a CSV of one row per
    cluster: whether its month came with hours, their cost in USD and whether it adds up to the
    cluster's own lines for the month, the tokens the engines and the ledger counted, their
    difference and its share, and the instance-hours of its lifetimes."""
    rows = []
    for c in body["clusters"]:
        r = c["reconciliation"]
        share = r["difference_share"]
        rows.append(
            {
                "cluster": c["cluster"],
                "hours_kept": "yes" if c["hourly"] else "no",
                "hourly_usd": int(c["hourly_cents"]) / 100,
                "adds_up": ("yes" if c["adds_up"] else "NO") if c["hourly"] else "",
                "engine_tokens": int(r["engine_tokens"]),
                "ledger_tokens": int(r["ledger_tokens"]),
                "difference_tokens": int(r["difference_tokens"]),
                "difference_pct": None if share is None else round(100 * float(share), 2),
                "instance_hours": round(float(c["instance_hours"]), 2),
            }
        )
    schema = {
        "cluster": pl.String,
        "hours_kept": pl.String,
        "hourly_usd": pl.Float64,
        "adds_up": pl.String,
        "engine_tokens": pl.Int64,
        "ledger_tokens": pl.Int64,
        "difference_tokens": pl.Int64,
        "difference_pct": pl.Float64,
        "instance_hours": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema).write_csv()


def _cluster_hours(ctx: Context, session: Session, month: str) -> Any:
    """The hours part of the clusters table: a sentence and a row per cluster."""
    try:
        body = ctx.client.federation_hours(session.token, month)
    except BillingError as exc:
        return note(str(exc), "error")
    r = body["reconciliation"]
    ok = "adds up to its own lines to the cent" if body["adds_up"] else "does NOT add up"
    said = (
        f"Hours: each cluster's hourly cost {ok}; the engines counted {r['engine_tokens']:,} "
        f"tokens, the ledger {r['ledger_tokens']:,} (difference {r['difference_tokens']:,})."
    )
    return html.Div(
        [
            html.P(said, id="chargeback-cluster-hours-total"),
            csv_table(
                cluster_hours_csv(body),
                "chargeback-cluster-hours-table",
                empty="No cluster configured.",
            ),
        ]
    )


def utc(t: float) -> str:
    """A Unix time as ``2026-12-05 22:49 UTC``."""
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _clusters(ctx: Context, session: Session, month: str) -> Any:
    """The clusters table of a central billing, for the admin; nothing elsewhere."""
    if ctx.config.billing.role != "central" or not session.is_admin:
        return None
    try:
        body = ctx.client.federation_statement(session.token, month)
    except BillingError as exc:
        return note(str(exc), "error")
    ok = "reconciles to the cent" if body["reconciles"] else "does NOT reconcile"
    stale = body["stale_clusters"]
    said = f"Across clusters: {usd(int(body['total_cents']) / 100)}, the sum of the clusters' own totals: {ok}."
    if stale:
        said += f" Stale (their last pulled months shown): {', '.join(stale)}."
    return html.Div(
        [
            html.H3("Clusters"),
            html.P(said, id="chargeback-clusters-total"),
            csv_table(
                clusters_csv(body), "chargeback-clusters-table", empty="No cluster configured."
            ),
            _cluster_hours(ctx, session, month),
        ]
    )


def _file(file: Download) -> dict[str, Any]:
    """What ``dcc.Download`` takes for a text file (as ``dcc.send_string`` builds it)."""
    return {"content": file.text, "filename": file.filename, "type": "text/csv", "base64": False}


def register(app: Dash, ctx: Context) -> None:
    """The month picker, the statement and the two downloads."""
    platform = ctx.config.billing.platform_account

    @app.callback(
        Output("chargeback-month", "options"),
        Output("chargeback-month", "value"),
        Input("auth", "data"),
        Input("url", "search"),
    )
    def months(auth: Any, search: str | None) -> tuple[list[str], str]:
        """The months with data and the last year's; ``?month=YYYY-MM`` in the address picks one."""
        known: list[str] = []
        session = ctx.session(auth)
        if session is not None and session.is_admin:
            try:
                known = [m["month"] for m in ctx.client.months(session.token)]
            except BillingError:
                known = []
        asked = parse_qs((search or "").lstrip("?")).get("month", [None])[0]
        try:
            picked = check_month(asked) if asked else None
        except ValueError:
            picked = None
        choices = recent_months([*known, *([picked] if picked else [])])
        return choices, picked or (max(known) if known else month_of(time.time()))

    @app.callback(
        Output("chargeback-reconciliation", "children"),
        Output("chargeback-table", "children"),
        Output("chargeback-bases", "children"),
        Output("chargeback-clusters", "children"),
        Input("chargeback-month", "value"),
        Input("auth", "data"),
        Input("tick", "n_intervals"),
        State("tz", "data"),
    )
    def show(month: str | None, auth: Any, _: Any, tz: str | None) -> tuple[Any, Any, Any, Any]:
        session = ctx.session(auth)
        if session is None or not month:
            return note("Sign in and pick a month."), None, None, None
        token = session.token
        try:
            with ThreadPoolExecutor(max_workers=2) as pool:
                body_call = pool.submit(ctx.client.statement, token, month)
                file_call = pool.submit(ctx.client.export, token, month, "csv")
                body, lines = body_call.result(), file_call.result()
        except BillingError as exc:
            return note(str(exc), "error"), None, None, _clusters(ctx, session, month)
        statement = statement_from_json(body)
        state = "closed" if statement.closed else "open: it changes until the month is closed"
        adjusted = statement.lines.filter(pl.col("for_month") != month).height > 0
        # Line and usage month only tell lines apart when some are adjustments.
        hidden = ("month",) if adjusted else ("month", "line_type", "for_month")
        # The basis is said above the table; a split no line has would be a column of blanks.
        hidden = (
            *hidden,
            "basis",
            *_blank_columns(lines.text, ("pricing_category", "pool", "project")),
        )
        return (
            html.Div(
                [
                    html.P(
                        f"{month} is {state}. As of {as_of(body.get('as_of') or time.time(), tz)} (your time).",
                        id="chargeback-state",
                    ),
                    *_empty_month(ctx, session, month, statement.lines.height),
                    _reconciliation(body, statement.total_cents, platform),
                ]
            ),
            csv_table(lines.text, "chargeback-lines", hidden=hidden),
            _bases(body, statement),
            _clusters(ctx, session, month),
        )

    def download(auth: Any, month: str | None, kind: Literal["csv", "focus"]) -> tuple[Any, Any]:
        """The file billing exports, or why not: a refusal or an outage is said beside the
        buttons (a callback that raised was a 500, and the click did nothing the user could see)."""
        session = ctx.session(auth)
        if session is None or not month:
            return no_update, no_update
        try:
            return _file(ctx.client.export(session.token, month, kind)), None
        except BillingError as exc:
            name = "CSV" if kind == "csv" else "FOCUS file"
            return no_update, note(f"The {name} of {month} was not downloaded: {exc}.", "error")

    @app.callback(
        Output("chargeback-csv", "data"),
        Output("chargeback-csv-error", "children"),
        Input("chargeback-csv-button", "n_clicks"),
        State("auth", "data"),
        State("chargeback-month", "value"),
        prevent_initial_call=True,
    )
    def csv(_: int, auth: Any, month: str | None) -> tuple[Any, Any]:
        return download(auth, month, "csv")

    @app.callback(
        Output("chargeback-focus", "data"),
        Output("chargeback-focus-error", "children"),
        Input("chargeback-focus-button", "n_clicks"),
        State("auth", "data"),
        State("chargeback-month", "value"),
        prevent_initial_call=True,
    )
    def focus(_: int, auth: Any, month: str | None) -> tuple[Any, Any]:
        return download(auth, month, "focus")
