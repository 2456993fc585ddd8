"""Keys: issue, list, revoke and rotate the keys issued at run time, as billing lets the caller.

The admin manages every key; a team's lead manages its own team's member keys; billing decides
(``/v1/keys``), and this page only shows its answer, refusals included. A new secret is shown
once, in the answer to the click that made it: billing keeps only its digest, and the page
never stores it (leaving the page forgets it). Signed in with single sign-on, the person's ID
token is what billing sees, so the audit trail names the person who issued or revoked a key.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from typing import Any, Final, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import polars as pl
from dash import Dash, Input, Output, State, callback_context, dcc, html, no_update

from dashboards.client import BillingError
from dashboards.components import frame_table, note, page
from dashboards.context import Context
from dashboards.sessions import Session

PATH = "/keys"
TITLE = "Keys"

ROLES: Final = ("member", "lead", "finance", "viewer", "spend_reader")
_TEAM_ROLES: Final = frozenset({"member", "lead"})
_KEY_ID = re.compile(r"[a-z0-9]{12}")
_COLUMNS: Final = (
    "key_id",
    "team",
    "role",
    "member",
    "project",
    "created",
    "created_by",
    "expires",
    "state",
)
_DAY_SECONDS: Final = 86_400.0


def _field(name: str, control: Any, width: str) -> html.Div:
    return html.Div(
        [html.Label(name, htmlFor=control.id), control],
        className="field",
        style={"minWidth": width, "maxWidth": width},
    )


def layout(ctx: Context) -> html.Div:
    """The keys page's frame; ``register`` fills it."""
    roles = [{"label": r, "value": r} for r in ROLES]
    issue = [
        _field(
            # Filled for the signed-in caller (``team_options``): a team sees its own name only.
            "Team",
            dcc.Dropdown(id="keys-team", options=[], placeholder="(your team)"),
            "10em",
        ),
        _field(
            "Role",
            dcc.Dropdown(
                id="keys-role", options=roles, value="member", clearable=False, searchable=False
            ),
            "9em",
        ),
        _field("Member", dcc.Input(id="keys-member", placeholder="optional"), "10em"),
        _field("Project", dcc.Input(id="keys-project", placeholder="optional"), "10em"),
        _field(
            "Expires in days",
            # Text, read here: a number field hands the callback nothing for a value the
            # browser finds invalid (0, 0.5 under min 1), and nothing meant "never expires".
            dcc.Input(id="keys-days", placeholder="never"),
            "9em",
        ),
        _field("Why", dcc.Input(id="keys-reason", placeholder="for the audit trail"), "16em"),
        html.Button("Issue key", id="keys-issue"),
    ]
    change = [
        _field("Key id", dcc.Input(id="keys-id", placeholder="12 characters"), "10em"),
        _field(
            "Why", dcc.Input(id="keys-change-reason", placeholder="for the audit trail"), "16em"
        ),
        html.Button("Revoke", id="keys-revoke"),
        html.Button("Rotate", id="keys-rotate"),
    ]
    return page(
        TITLE,
        html.Div(id="keys-status"),
        html.H3("Issue a key"),
        html.Div(issue, className="toolbar"),
        html.Div(id="keys-secret"),
        html.H3("Revoke or rotate"),
        html.Div(change, className="toolbar"),
        html.H3("Keys"),
        html.Div(id="keys-table"),
        dcc.Store(id="keys-changed", data=0),
    )


def when(t: float, tz: str | None) -> str:
    """A moment as the viewer reads it in their zone: ``2026-12-05 14:03``."""
    try:
        zone = ZoneInfo(tz or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        zone = ZoneInfo("UTC")
    return dt.datetime.fromtimestamp(t, zone).strftime("%Y-%m-%d %H:%M")


def key_request(
    session: Session,
    team: str | None,
    role: str | None,
    member: str | None,
    project: str | None,
    days: str | float | None,
    reason: str | None,
) -> dict[str, Any]:
    """The body of ``POST /v1/keys`` from the form: a team's role takes the team (the signed-in
    team's when none is picked), the others none; empty fields are left out.

    ValueError for an expiry that is not a positive number of days (the form says it): only an
    empty field means a key that never expires."""
    role = role or "member"
    body: dict[str, Any] = {"role": role, "reason": (reason or "").strip()}
    if role in _TEAM_ROLES:
        body["team"] = team or session.team
    for name, value in (("member", member), ("project", project)):
        if value and value.strip():
            body[name] = value.strip()
    text = "" if days is None else str(days).strip()
    if text:
        try:
            count = float(text)
        except ValueError:
            count = math.nan
        if not (math.isfinite(count) and count > 0):
            raise ValueError(
                f"Expires in days: {text!r} is not a positive number of days (such as 0.5 or "
                "30); leave it empty for a key that never expires."
            )
        body["expires_in_seconds"] = count * _DAY_SECONDS
    return body


def keys_frame(keys: list[dict[str, Any]], now: float, tz: str | None) -> pl.DataFrame:
    """One row per key, newest first: who it is for, when it was made and ends, and its state."""

    def state(k: dict[str, Any]) -> str:
        if k.get("revoked_at") is not None:
            return (
                "revoked" if k["revoked_at"] <= now else "revoked at " + when(k["revoked_at"], tz)
            )
        if k.get("expires_at") is not None and k["expires_at"] <= now:
            return "expired"
        return "active"

    rows = [
        {
            "key_id": k["key_id"],
            "team": k.get("team") or "",
            "role": k["role"],
            "member": k.get("member") or "",
            "project": k.get("project") or "",
            "created": when(k["created_at"], tz),
            "created_by": k.get("created_by") or "",
            "expires": when(k["expires_at"], tz) if k.get("expires_at") else "never",
            "state": state(k),
            "_at": k["created_at"],
        }
        for k in keys
    ]
    schema = dict.fromkeys(_COLUMNS, pl.String) | {"_at": pl.Float64}
    return pl.DataFrame(rows, schema=schema).sort("_at", descending=True).drop("_at")


def _secret(answer: dict[str, Any], what: str, tz: str | None = None) -> Any:
    """The new secret, once, with what it is for and when it expires (or that it never does)."""
    expires = answer.get("expires_at")
    ends = "It never expires." if expires is None else f"It expires {when(expires, tz)}."
    return html.Div(
        [
            note(
                f"{what} {answer['key_id']}: copy the key now. It is shown this once; billing "
                f"keeps only its digest. {ends}"
            ),
            html.Pre(answer["key"], id="keys-secret-value"),
        ]
    )


def team_options(session: Session | None, teams: list[str]) -> list[dict[str, str]]:
    """The teams the form offers: every one to the admin, a team's own to a team's key (the
    other teams' names are not its to read), none signed out."""
    if session is None:
        return []
    names = teams if session.is_admin else [t for t in teams if t == session.team]
    return [{"label": t, "value": t} for t in names]


def register(app: Dash, ctx: Context) -> None:
    """The keys page's callbacks: the listing, and the issue, revoke and rotate buttons."""
    teams = [t.name for t in ctx.config.teams]

    @app.callback(Output("keys-team", "options"), Input("auth", "data"))
    def options(auth: Any) -> list[dict[str, str]]:
        return team_options(ctx.session(auth), teams)

    @app.callback(
        Output("keys-status", "children"),
        Output("keys-table", "children"),
        Input("keys-changed", "data"),
        Input("auth", "data"),
        Input("tz", "data"),
    )
    def listing(_: Any, auth: Any, tz: str | None) -> tuple[Any, Any]:
        session = ctx.session(auth)
        if session is None:
            return note("Sign in to manage keys."), None
        try:
            keys = ctx.client.keys(session.token, revoked=True)
        except BillingError as exc:
            if exc.status == 403:
                return note("Only the admin and team leads manage keys.", "info"), None
            return note(f"Keys unavailable: {exc}.", "error"), None
        table = frame_table(
            keys_frame(keys, time.time(), tz),
            "keys-list",
            _COLUMNS,
            empty="No key has been issued yet.",
        )
        return None, table

    @app.callback(
        Output("keys-secret", "children"),
        Output("keys-changed", "data"),
        Input("keys-issue", "n_clicks"),
        Input("keys-revoke", "n_clicks"),
        Input("keys-rotate", "n_clicks"),
        State("keys-team", "value"),
        State("keys-role", "value"),
        State("keys-member", "value"),
        State("keys-project", "value"),
        State("keys-days", "value"),
        State("keys-reason", "value"),
        State("keys-id", "value"),
        State("keys-change-reason", "value"),
        State("keys-changed", "data"),
        State("auth", "data"),
        State("tz", "data"),
        prevent_initial_call=True,
    )
    def act(
        _: Any,
        __: Any,
        ___: Any,
        team: str | None,
        role: str | None,
        member: str | None,
        project: str | None,
        days: str | None,
        reason: str | None,
        key_id: str | None,
        change_reason: str | None,
        changed: int | None,
        auth: Any,
        tz: str | None,
    ) -> tuple[Any, Any]:
        session = ctx.session(auth)
        if session is None:
            return note("Sign in to manage keys.", "error"), no_update
        action = callback_context.triggered_id
        try:
            if action == "keys-issue":
                try:
                    body = key_request(session, team, role, member, project, days, reason)
                except ValueError as exc:
                    return note(str(exc), "error"), no_update
                answer = ctx.client.issue_key(session.token, body)
                shown = _secret(answer, "Issued key", tz)
            else:
                wanted = (key_id or "").strip()
                if not _KEY_ID.fullmatch(wanted):
                    return note(
                        "Enter the 12-character id of a key from the list.", "error"
                    ), no_update
                verb: Literal["revoke", "rotate"] = (
                    "revoke" if action == "keys-revoke" else "rotate"
                )
                answer = ctx.client.change_key(session.token, wanted, verb, change_reason or "")
                shown = (
                    note(f"Revoked key {wanted}.")
                    if verb == "revoke"
                    else _secret(answer, f"Rotated key {wanted}; the new key is", tz)
                )
        except BillingError as exc:
            return note(f"Refused: {exc}", "error"), no_update
        return shown, (changed or 0) + 1
