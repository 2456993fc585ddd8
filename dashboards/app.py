"""The Dash app: a sign-in form, a page router, and one module per page.

Pages are plain modules routed by ``dcc.Location`` rather than ``dash.register_page``, whose
registry is process-wide: two apps in one process (tests, or two configurations) must not share
pages or callbacks. Only the sign-in form takes a key: once billing accepts it, the server keeps
it in a session and the browser's session storage holds the session's opaque id, which every
data callback names (``dashboards.sessions``), so no callback can be used to test keys. Failed
sign-ins are throttled per client address (``dashboards.throttle``), and while an address is
locked out no callback from it looks anything up. Sign-out and sign-in empty the key box, and
sign-out ends the session. A session ends with its key: when billing answers one of its reads
with 401 (the key was revoked, or has expired; for single sign-on, the ID token was refused),
or at the key's expiry, and the next refresh sends the tab to the sign-in form saying why; the
audit trail has it as a sign-out, with why ("revoked", "expired"). Billing's 503 ends nothing.
Every response carries the security headers of ``dashboards.headers``.

Signed out, a visitor sees the sign-in form and nothing else: no navigation, no range picker, no
sign-out button, no figures. Signed in, every page opens with the summary row
(``dashboards.summary``), whose money figures are billing's cached statement, shown with the
time billing read the ledger for it (at most one refresh interval ago).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, Final
from urllib.parse import parse_qs

from dash import Dash, Input, Output, State, callback_context, dcc, html, no_update
from flask import request

from dashboards.client import BillingClient, BillingError
from dashboards.components import note
from dashboards.context import Context
from dashboards.data import RANGE_LABELS, RANGES, fetch_queries
from dashboards.formatting import as_of
from dashboards.headers import content_security_policy, install_security_headers
from dashboards.oidc import LOGIN_PATH, end_sso, install_oidc, sso_session_id, take_error
from dashboards.pages import allocation, chargeback, efficiency, fleet, keys, planner, sla, teams
from dashboards.sessions import EXPIRED, REFUSED, Gate, Session, Sessions, clean_key
from dashboards.style import SORT_JS, STYLE, TZ_JS
from dashboards.summary import summary_row, tiles
from dashboards.throttle import SignInThrottle, locked_message
from infermeter.config import Config, process_environment
from infermeter.months import month_of
from infermeter.statement import statement_from_json

__all__ = ["PAGES", "Audit", "create_app"]

# Told of each sign-in, failure and sign-out: (action, actor, role, address=, why=, ...).
Audit = Callable[..., None]


def _unheard(*_: Any, **__: Any) -> None:
    """No audit trail configured (tests of the pages alone)."""


PAGES: Final[tuple[ModuleType, ...]] = (
    fleet,
    teams,
    allocation,
    chargeback,
    sla,
    planner,
    efficiency,
    keys,
)

_HIDDEN: Final = {"display": "none"}
# What the sign-in form says to a tab whose session ended with its key (``Sessions.ended``),
# signed in with a key, or with single sign-on.
_ENDED: Final = {
    REFUSED: "Signed out: billing no longer accepts the key you signed in with (it was revoked "
    "or has expired). Sign in with a key in force.",
    EXPIRED: "Signed out: the key you signed in with has expired. Sign in with a key in force.",
}
_ENDED_SSO: Final = {
    REFUSED: "Signed out: billing no longer accepts your single sign-on (it refused the identity "
    "provider's token). Sign in again.",
    EXPIRED: "Signed out: your single sign-on session has ended. Sign in again.",
}
# The audit trail's reason for a sign-out no one asked for: billing refused the key (401), or
# the key (or the single sign-on session) expired.
_AUDITED: Final = {REFUSED: "revoked", EXPIRED: "expired"}


def _shell(ctx: Context) -> html.Div:
    links = [dcc.Link(p.TITLE, href=p.PATH) for p in PAGES]
    options = [{"label": RANGE_LABELS[r], "value": r} for r in RANGES]
    range_picker = dcc.Dropdown(
        id="range",
        options=options,
        value="fit",
        clearable=False,
        searchable=False,
        style={"width": "11em"},
    )
    return html.Div(
        [
            dcc.Location(id="url"),
            # Session storage: the key survives a reload of the tab but not the tab itself.
            dcc.Store(id="auth", storage_type="session"),
            dcc.Store(id="tz"),
            dcc.Store(id="sortable"),
            # The month's spend and statement as the summary fetched them: the pages that show
            # money read this copy, so every figure on screen is from the same moment.
            dcc.Store(id="money"),
            dcc.Interval(id="tick", interval=int(ctx.config.dashboard.refresh_seconds * 1000)),
            html.Header(
                [
                    html.Span("infermeter", className="brand"),
                    html.Nav(
                        [
                            *links,
                            html.Div(className="spacer"),
                            html.Label("Range", htmlFor="range"),
                            range_picker,
                            html.Span(id="who"),
                            html.Button("Sign out", id="logout"),
                        ],
                        id="nav",
                        style=_HIDDEN,
                    ),
                ]
            ),
            html.Div(id="summary-wrap", children=html.Div(id="summary"), style=_HIDDEN),
            html.Div(
                [
                    html.H2("Sign in"),
                    html.P("Your team key shows your team; the admin key shows every team."),
                    dcc.Input(
                        id="login-key", type="password", placeholder="API key", debounce=False
                    ),
                    html.Button("Sign in", id="login-button"),
                    html.P(id="login-error", className="note-error"),
                    *_sso_button(ctx),
                ],
                id="login",
            ),
            html.Div(id="content"),
        ]
    )


def _sso_button(ctx: Context) -> list[Any]:
    """The "Sign in with <IdP>" link and where its refusal is said, when single sign-on is on."""
    oidc = ctx.config.dashboard.oidc
    if oidc is None:
        return []
    return [
        html.A(f"Sign in with {oidc.display_name}", href=LOGIN_PATH, id="sso-login"),
        html.P(id="sso-error", className="note-error"),
    ]


def _refused(throttle: SignInThrottle, address: str, status: int) -> str:
    """Count a refused key from ``address`` and say why, and how many tries it has left.

    401: billing knows no such key. 403: the key is one of the services' (metrics, ingest),
    which billing knows but which may not read the ledger; it counts all the same, as a guess.
    """
    why = (
        "this key is not known"
        if status == 401
        else "this key is known, but it is a service's (metrics or ingest), which may not sign in: "
        "use the admin key or a team key"
    )
    attempts = throttle.failed(address)
    locked = attempts.retry_after(throttle.now())
    if locked > 0:
        return f"Not signed in: {why}. {locked_message(locked)}"
    left = throttle.policy.max_failures - attempts.failures
    tries = "1 more try" if left == 1 else f"{left} more tries"
    wait = f"{throttle.policy.lockout_seconds:g} s"
    return f"Not signed in: {why} ({tries} before a {wait} wait)."


def _ended(gate: Gate, auth: Any, address: str) -> tuple[Any, Any, Any, Any]:
    """At each refresh: a tab whose session ended with its key is signed out and told why.

    The session is the one the tab's store names, else its single sign-on cookie's. Nothing
    changes for a live session, one ended otherwise, or while ``address`` is locked out of
    sign-in (nothing from it is looked up).
    """
    sid = auth.get("session") if isinstance(auth, dict) else None
    if not isinstance(sid, str):
        sid = sso_session_id()
    found = None
    if sid is not None and gate.throttle.retry_after(address) <= 0:
        found = gate.sessions.ending(sid)
    if found is None:
        return no_update, no_update, no_update, no_update
    why, session = found
    return None, True, (_ENDED if session.person is None else _ENDED_SSO)[why], no_update


def _audited(heard: Audit) -> Callable[[Session, str], None]:
    """What ``Sessions.on_end`` tells: a session its key's refusal or expiry ended goes on the
    audit trail as a sign-out, with why ("revoked", "expired")."""

    def tell(session: Session, why: str) -> None:
        sso = session.person is not None
        heard(
            "signout",
            session.person or session.name,
            "",
            why=_AUDITED[why],
            detail={"with": "sso" if sso else "key"},
        )

    return tell


def _summary(ctx: Context, session: Session, choice: str | None, tz: str | None) -> tuple[Any, Any]:
    """The summary row and the money snapshot it was computed from."""
    token, admin = session.token, session.is_admin
    shown = ctx.window(session, choice)
    start, end = shown.start, shown.end
    month = month_of(end)
    names = ["team_usage", "sla", *(["gpus"] if admin else [])]
    try:
        # Money and service figures are fetched together, so the row waits for the slowest only.
        with ThreadPoolExecutor(max_workers=2) as pool:
            spend = pool.submit(ctx.client.spend, token)
            statement = pool.submit(ctx.client.statement, token, month)
            frames = fetch_queries(ctx.client, token, names, start, end)
            money: dict[str, Any] = {"spend": spend.result(), "statement": statement.result()}
    except BillingError as exc:
        return note(f"Figures unavailable: {exc}.", "error"), None
    # The time billing read the ledger for these figures (when it says), not the time we asked.
    now = float(money["statement"].get("as_of") or time.time())
    money |= {"as_of": now, "month": month}
    lines = statement_from_json(money["statement"]).lines
    period = shown.label
    found = tiles(
        money["spend"], lines, frames["team_usage"], frames["sla"], frames.get("gpus"), period
    )
    return summary_row(found, as_of(now, tz), month), money


def create_app(
    config: Config,
    billing_url: str,
    throttle: SignInThrottle | None = None,
    sessions: Sessions | None = None,
    audit: Audit | None = None,
    environ: Mapping[str, str] | None = None,
) -> Dash:
    """The dashboard app reading from the billing service at ``billing_url``.

    ``throttle`` counts failed sign-ins per client address, ``sessions`` holds the signed-in
    callers; each app has its own of both by default (the app sets ``sessions.on_end``).
    ``audit`` hears every sign-in, sign-in failure and sign-out, a session its key's refusal or
    expiry ended included (the audit trail; ``infermeter.audit_spool.AuditThread.record``).
    ``environ`` holds the single sign-on client secret (``dashboard.oidc``; default the process's).
    """
    heard = audit or _unheard
    signins = SignInThrottle() if throttle is None else throttle
    gate = Gate(signins, Sessions() if sessions is None else sessions)
    # Each session its key's refusal or expiry ends is a sign-out on the audit trail.
    gate.sessions.on_end = _audited(heard)
    # A 401 from billing ends every session signed in with that key or ID token.
    ctx = Context(config, BillingClient(billing_url, refused=gate.sessions.refused), gate)
    app = Dash(
        __name__,
        title="infermeter",
        update_title="",
        assets_ignore=".*",
        serve_locally=True,
        suppress_callback_exceptions=False,
    )
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + STYLE + "</style>")
    app.layout = _shell(ctx)
    app.validation_layout = html.Div(  # type: ignore[assignment]
        [_shell(ctx), *(p.layout(ctx) for p in PAGES)]
    )
    by_path = {p.PATH: p for p in PAGES}
    oidc = config.dashboard.oidc
    if oidc is not None:
        env = process_environment() if environ is None else environ
        install_oidc(app.server, oidc, env, gate.sessions, heard)

        @app.callback(Output("sso-error", "children"), Input("url", "pathname"))
        def sso_error(_: Any) -> str:
            """Why the last single sign-on was refused, shown once on the sign-in form."""
            return take_error() or ""

    @app.callback(
        Output("content", "children"),
        Output("login", "style"),
        Output("who", "children"),
        Output("nav", "style"),
        Output("summary-wrap", "style"),
        Input("url", "pathname"),
        Input("auth", "data"),
    )
    def route(
        path: str | None, auth: Any
    ) -> tuple[Any, dict[str, str], str, dict[str, str], dict[str, str]]:
        session = ctx.session(auth)
        if session is None:
            return None, {}, "", _HIDDEN, _HIDDEN
        module = by_path.get(path or "/")
        content = module.layout(ctx) if module else html.P(f"No page at {path}", className="note")
        who = "admin" if session.is_admin else f"team {session.team}"
        if session.team is None and not session.is_admin:
            who = session.name.removeprefix("@")  # finance or viewer
        if session.person:
            who = f"{session.person} ({who})"
        return content, _HIDDEN, who, {}, {}

    @app.callback(
        Output("summary", "children"),
        Output("money", "data"),
        Input("tick", "n_intervals"),
        Input("range", "value"),
        Input("auth", "data"),
        Input("tz", "data"),
    )
    def summary(_: Any, choice: str | None, auth: Any, tz: str | None) -> tuple[Any, Any]:
        session = ctx.session(auth)
        if session is None:
            return None, None
        return _summary(ctx, session, choice, tz)

    @app.callback(
        Output("auth", "data"),
        Output("auth", "clear_data"),
        Output("login-error", "children"),
        Output("login-key", "value"),
        Input("login-button", "n_clicks"),
        Input("login-key", "n_submit"),
        Input("logout", "n_clicks"),
        Input("tick", "n_intervals"),
        State("login-key", "value"),
        State("auth", "data"),
        prevent_initial_call=True,
    )
    def sign_in(
        _: Any, __: Any, ___: Any, ____: Any, typed: str | None, auth: Any
    ) -> tuple[Any, Any, Any, Any]:
        address = request.remote_addr or "unknown"
        if callback_context.triggered_id == "tick":
            return _ended(gate, auth, address)
        if isinstance(auth, dict) and isinstance(auth.get("session"), str):
            ended = gate.sessions.get(auth["session"])
            gate.sessions.end(auth["session"])  # signing out, or in again: the old one is over
            if ended is not None and callback_context.triggered_id == "logout":
                heard("signout", ended.name, "", address=address)
        if callback_context.triggered_id == "logout":
            end_sso(gate.sessions, heard, address)
            return None, True, "", ""
        key = clean_key(typed)
        if not key:
            return None, True, "Enter a key.", no_update
        wait_seconds = signins.retry_after(address)
        if wait_seconds > 0:
            heard(
                "signin.failed", "unknown", "", address=address, why="locked out", outcome="refused"
            )
            return None, True, locked_message(wait_seconds), no_update
        try:
            who = ctx.client.whoami(key)
        except BillingError as exc:
            if exc.status not in (401, 403):
                return None, True, f"Not signed in: {exc}.", no_update
            why = "unknown key" if exc.status == 401 else "a service's key"
            heard("signin.failed", "unknown", "", address=address, why=why, outcome="refused")
            return None, True, _refused(signins, address, exc.status), no_update
        caller = who["caller"]
        heard(
            "signin.succeeded",
            caller.get("who") or caller["name"],
            caller.get("role", ""),
            address=address,
            detail={"with": "key"},
        )
        expires = caller.get("expires_at")
        session = Session(
            key,
            caller["name"],
            caller["team"],
            bool(caller["is_admin"]),
            expires_at=float(expires) if expires is not None else None,
        )
        return {"session": gate.sessions.begin(session)}, False, "", ""

    @app.callback(Output("range", "value"), Input("url", "search"))
    def range_from_url(search: str | None) -> Any:
        """``?range=24h`` in the address picks the range, so a view can be linked to."""
        choice = parse_qs((search or "").lstrip("?")).get("range", [None])[0]
        return choice if choice in RANGES else no_update

    app.clientside_callback(TZ_JS, Output("tz", "data"), Input("url", "pathname"))  # type: ignore[no-untyped-call]
    app.clientside_callback(SORT_JS, Output("sortable", "data"), Input("url", "pathname"))  # type: ignore[no-untyped-call]
    for module in PAGES:
        module.register(app, ctx)
    # The hashes name the renderer and the clientside callbacks, so every callback comes first.
    install_security_headers(app.server, content_security_policy(app.csp_hashes()))
    return app
