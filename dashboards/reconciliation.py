"""The fleet page's reconciliation table: the engines' token counters against the ledger's.

Billing's ``reconciliation`` query answers per instance and hour; the table sums the range per
replica group, so an operator sees at a glance which group has tokens no team was billed for
(``docs/billing.md``, "Reconciliation"). Its numbers span every team, so only the admin sees them.

The columns after the engine's and the ledger's say where their difference went, so none repeats
another: engine - ledger = hang-up tails + unattributed - ledger excess. Hang-up tails are the
tokens vLLM generated after a client hung up, charged to that team; unattributed, those no record
accounts for, charged out of idle capacity; ledger excess, the ledger's tokens beyond the
engine's, reported and never billed. Unreconciled requests and tokens are billed with no engine
reading around them: no counter checked them.
"""

from __future__ import annotations

from typing import Any, Final

import polars as pl
from dash import Dash, Input, Output, html

from dashboards.client import BillingError
from dashboards.components import frame_table, note
from dashboards.context import Context

__all__ = ["CAPTION", "COLUMNS", "register", "summary", "table"]

TABLE_ID: Final = "fleet-reconciliation-table"
COLUMNS: Final = (
    "replica",
    "model",
    "engine_tokens",
    "ledger_tokens",
    "hangup_tokens",
    "unattributed_tokens",
    "ledger_excess_tokens",
    "unattributed_share",
    "unreconciled_requests",
    "unreconciled_tokens",
)
_SUMS: Final = (
    "engine_tokens",
    "ledger_tokens",
    "hangup_tokens",
    "unattributed_tokens",
    "ledger_excess_tokens",
    "unreconciled_requests",
    "unreconciled_tokens",
)
CAPTION: Final = (
    "Engine - ledger = hang-up tails (tokens vLLM generated after a client hung up, on that "
    "team's line) + unattributed (no record carries them; charged out of idle capacity) - "
    "ledger excess (reported, not billed). Unreconciled: billed with no engine reading around "
    "them, so no counter checked them."
)


def summary(frame: pl.DataFrame) -> pl.DataFrame:
    """The query's instance-hours summed per replica group and model, in ``COLUMNS``."""
    if frame.height == 0:
        return pl.DataFrame(schema=dict.fromkeys(COLUMNS, pl.String))
    return (
        frame.group_by("replica", "model")
        .agg(pl.col(*_SUMS).cast(pl.Int64).sum())
        .with_columns(
            unattributed_share=pl.when(pl.col("engine_tokens") > 0)
            .then((pl.col("unattributed_tokens") / pl.col("engine_tokens")).round(4))
            .otherwise(None)
        )
        .select(COLUMNS)
        .sort("replica", "model")
    )


def table(frame: pl.DataFrame) -> html.Div:
    """The summary as the page shows it, with a total row."""
    return frame_table(
        summary(frame), TABLE_ID, total=_SUMS, empty="No engine counters in this range yet."
    )


def register(app: Dash, ctx: Context) -> None:
    """Fill ``fleet-reconciliation`` on the page's interval, for the admin."""

    @app.callback(
        Output("fleet-reconciliation", "children"),
        Input("tick", "n_intervals"),
        Input("range", "value"),
        Input("auth", "data"),
    )
    def refresh(_: int, choice: str | None, auth: Any) -> Any:
        session = ctx.session(auth)
        if session is None:
            return None
        if not session.is_admin:
            return note("The reconciliation spans every team: shown to the admin credential.")
        shown = ctx.window(session, choice)
        start, end = shown.start, shown.end
        try:
            frame = ctx.client.query(session.token, "reconciliation", start, end)
        except BillingError as exc:
            return note(str(exc), "error")
        return html.Div([table(frame), note(CAPTION, note_id="fleet-reconciliation-caption")])
