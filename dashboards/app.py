"""The Dash app: a sign-in form, a page router, and one module per page.

Pages are plain modules routed by ``dcc.Location`` rather than ``dash.register_page``, whose
registry is process-wide: two apps in one process (tests, or two configurations) must not share
pages or callbacks. The signed-in key lives only in the browser's session storage and is sent
to billing with every data request; the server keeps no session. Sign-out and sign-in empty the
key box, and sign-out removes the key from storage, so the key never outlives the tab or the
sign-out. Failed sign-ins are throttled per client address (``dashboards.throttle``), and every
response carries the security headers of ``dashboards.headers``.

Signed out, a visitor sees the sign-in form and nothing else: no navigation, no range picker, no
sign-out button, no figures. Signed in, every page opens with the summary row
(``dashboards.summary``), whose money figures are computed by billing at the moment shown.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, Final
from urllib.parse import parse_qs

from dash import Dash, Input, Output, State, callback_context, dcc, html, no_update
from flask import request

from dashboards.client import BillingClient, BillingError
from dashboards.components import note
from dashboards.context import Context, signed_in
from dashboards.data import RANGE_LABELS, RANGES, fetch_queries, time_range
from dashboards.formatting import as_of
from dashboards.headers import content_security_policy, install_security_headers
from dashboards.pages import chargeback, fleet, planner, sla, teams
from dashboards.summary import summary_row, tiles
from dashboards.throttle import SignInThrottle, locked_message
from infermeter.config import Config
from infermeter.months import month_of
from infermeter.statement import statement_from_json

__all__ = ["PAGES", "create_app"]

PAGES: Final[tuple[ModuleType, ...]] = (fleet, teams, chargeback, sla, planner)

_STYLE: Final = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2430;
       background: #f8f9fb; }
header { display: flex; gap: 1.2em; align-items: center; padding: .55em 1.2em; background: #1d2430;
         min-height: 2.4em; }
header .brand { color: #fff; font-weight: 700; letter-spacing: .02em; }
#nav { display: flex; flex: 1; gap: 1.1em; align-items: center; }
#nav > a { color: #d0d5dd; text-decoration: none; } #nav > a:hover { color: #fff; }
#nav .spacer { flex: 1; } #who { color: #fff; }
#nav label { color: #d0d5dd; font-size: .9em; }
#summary-wrap { padding: .8em 1.2em 0; }
.tiles { display: grid; grid-template-columns: repeat(auto-fit, minmax(175px, 1fr)); gap: .6em; }
.tile { background: #fff; border: 1px solid #e4e7ec; border-radius: 8px; padding: .6em .8em; }
.tile-label { font-size: .8em; color: #475467; text-transform: uppercase; letter-spacing: .04em; }
.tile-value { font-size: 1.55em; font-weight: 650; font-variant-numeric: tabular-nums; margin: .1em 0; }
.tile-detail { font-size: .8em; color: #475467; }
.as-of { font-size: .8em; color: #475467; margin: .4em 0 0; }
.page { padding: 0 1.2em 2em; }
.page h3 { margin: 1.2em 0 .3em; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: .6em; }
.grid .dash-graph { background: #fff; border: 1px solid #e4e7ec; border-radius: 8px; }
/* The chart toolbar only while the pointer is over its chart, never over a title. */
.js-plotly-plot .modebar-container { opacity: 0; transition: opacity .15s; }
.js-plotly-plot:hover .modebar-container { opacity: 1; }
.table-wrap { max-width: 100%; overflow-x: auto; }
.frame-table { border-collapse: collapse; font-size: .88em; margin: .5em 0; background: #fff;
               font-variant-numeric: tabular-nums; }
.frame-table th, .frame-table td { border-bottom: 1px solid #e4e7ec; padding: .35em .7em;
                                   text-align: left; white-space: nowrap; }
.frame-table th { background: #f2f4f7; font-weight: 600; white-space: normal; vertical-align: bottom; }
.frame-table thead th { cursor: pointer; user-select: none; }
.frame-table th[aria-sort="ascending"]::after { content: " \\25B2"; font-size: .7em; }
.frame-table th[aria-sort="descending"]::after { content: " \\25BC"; font-size: .7em; }
.frame-table .num { text-align: right; }
.frame-table tbody tr:hover { background: #f5f8ff; }
.frame-table tfoot td { font-weight: 700; border-top: 2px solid #1d2430; }
.note { color: #475467; } .note-error { color: #b42318; } .ok { color: #067647; font-weight: 600; }
.form, .toolbar { display: flex; flex-wrap: wrap; gap: .8em; align-items: end; margin: .5em 0; }
.field { display: flex; flex-direction: column; min-width: 11em; }
#login { max-width: 28em; margin: 3em auto; background: #fff; padding: 1em 1.5em 1.5em;
         border: 1px solid #e4e7ec; border-radius: 8px; }
#login input { width: 100%; box-sizing: border-box; padding: .4em; margin: .3em 0 .6em; }
"""
_HIDDEN: Final = {"display": "none"}

# The viewer's IANA time zone, read once per page load, so times are drawn in local time.
_TZ_JS: Final = "function(_) { return Intl.DateTimeFormat().resolvedOptions().timeZone || 'UTC'; }"

# Sorting for every table: one click listener on the document (installed once), so tables drawn
# later by any callback sort too. A header click sorts the body rows by that column, ascending
# then descending; numbers compare as numbers ("$1,234.56", "12.5 %"), the total row stays last.
_SORT_JS: Final = r"""function(_) {
  if (window.infermeterSort) { return 1; }
  window.infermeterSort = true;
  var value = function (cell) {
    var text = cell ? cell.textContent.trim() : '';
    var numeric = /^-?\$?[\d,]*\.?\d+( %| s| GB)?$/.test(text);
    return numeric ? parseFloat(text.replace(/[^\d.\-]/g, '')) : text.toLowerCase();
  };
  document.addEventListener('click', function (event) {
    var th = event.target.closest('.frame-table thead th');
    if (!th) { return; }
    var table = th.closest('table'), body = table.tBodies[0];
    var index = Array.prototype.indexOf.call(th.parentNode.children, th);
    var descending = th.getAttribute('aria-sort') === 'ascending';
    Array.prototype.forEach.call(th.parentNode.children, function (h) { h.removeAttribute('aria-sort'); });
    th.setAttribute('aria-sort', descending ? 'descending' : 'ascending');
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = value(a.cells[index]), y = value(b.cells[index]);
      var order = (typeof x === typeof y) ? (x < y ? -1 : x > y ? 1 : 0) : (typeof x === 'number' ? -1 : 1);
      return descending ? -order : order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  });
  return 1;
}"""


def _shell(ctx: Context) -> html.Div:
    links = [dcc.Link(p.TITLE, href=p.PATH) for p in PAGES]
    options = [{"label": RANGE_LABELS[r], "value": r} for r in RANGES]
    range_picker = dcc.Dropdown(id="range", options=options, value="1h", clearable=False,
                                searchable=False, style={"width": "10em"})  # fmt: skip
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
                ],
                id="login",
            ),
            html.Div(id="content"),
        ]
    )


def _refused(throttle: SignInThrottle, address: str) -> str:
    """Count an unknown key from ``address`` and say how many tries it has left."""
    attempts = throttle.failed(address)
    locked = attempts.retry_after(throttle.now())
    if locked > 0:
        return f"Not signed in: this key is not known. {locked_message(locked)}"
    left = throttle.policy.max_failures - attempts.failures
    tries = "1 more try" if left == 1 else f"{left} more tries"
    wait = f"{throttle.policy.lockout_seconds:g} s"
    return f"Not signed in: this key is not known ({tries} before a {wait} wait)."


def _summary(ctx: Context, auth: dict[str, Any], choice: str | None,
             tz: str | None) -> tuple[Any, Any]:  # fmt: skip
    """The summary row and the money snapshot it was computed from."""
    token, admin = auth["token"], bool(auth.get("is_admin"))
    start, end = time_range(choice)
    month = month_of(end)
    names = ["team_usage", "sla", *(["gpus"] if admin else [])]
    try:
        # Money and service figures are fetched together, so the row waits for the slowest only.
        with ThreadPoolExecutor(max_workers=2) as pool:
            spend = pool.submit(ctx.client.spend, token)
            statement = pool.submit(ctx.client.current_statement, token, month)
            frames = fetch_queries(ctx.client, token, names, start, end)
            money: dict[str, Any] = {"spend": spend.result(), "statement": statement.result()}
    except BillingError as exc:
        return note(f"Figures unavailable: {exc}.", "error"), None
    now = time.time()
    money |= {"as_of": now, "month": month}
    lines = statement_from_json(money["statement"]).lines
    period = f"the {RANGE_LABELS.get(choice or '1h', 'last hour').lower()}"
    found = tiles(
        money["spend"], lines, frames["team_usage"], frames["sla"], frames.get("gpus"), period
    )
    return summary_row(found, as_of(now, tz), month), money


def create_app(config: Config, billing_url: str, throttle: SignInThrottle | None = None) -> Dash:
    """The dashboard app reading from the billing service at ``billing_url``.

    ``throttle`` counts failed sign-ins per client address; each app has its own by default.
    """
    ctx = Context(config, BillingClient(billing_url))
    signins = SignInThrottle() if throttle is None else throttle
    app = Dash(__name__, title="infermeter", update_title="", assets_ignore=".*",
               serve_locally=True, suppress_callback_exceptions=False)  # fmt: skip
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + _STYLE + "</style>")
    app.layout = _shell(ctx)
    app.validation_layout = html.Div(  # type: ignore[assignment]
        [_shell(ctx), *(p.layout(ctx) for p in PAGES)]
    )
    by_path = {p.PATH: p for p in PAGES}

    @app.callback(
        Output("content", "children"),
        Output("login", "style"),
        Output("who", "children"),
        Output("nav", "style"),
        Output("summary-wrap", "style"),
        Input("url", "pathname"),
        Input("auth", "data"),
    )
    def route(path: str | None, auth: Any) -> tuple[Any, dict[str, str], str, dict[str, str],
                                                    dict[str, str]]:  # fmt: skip
        if not signed_in(auth):
            return None, {}, "", _HIDDEN, _HIDDEN
        module = by_path.get(path or "/")
        content = module.layout(ctx) if module else html.P(f"No page at {path}", className="note")
        who = "admin" if auth.get("is_admin") else f"team {auth.get('team')}"
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
        if not signed_in(auth):
            return None, None
        return _summary(ctx, auth, choice, tz)

    @app.callback(
        Output("auth", "data"),
        Output("auth", "clear_data"),
        Output("login-error", "children"),
        Output("login-key", "value"),
        Input("login-button", "n_clicks"),
        Input("login-key", "n_submit"),
        Input("logout", "n_clicks"),
        State("login-key", "value"),
        prevent_initial_call=True,
    )
    def sign_in(_: Any, __: Any, ___: Any, key: str | None) -> tuple[Any, bool, str, Any]:
        if callback_context.triggered_id == "logout":
            return None, True, "", ""
        if not key:
            return no_update, False, "Enter a key.", no_update
        address = request.remote_addr or "unknown"
        wait_seconds = signins.retry_after(address)
        if wait_seconds > 0:
            return no_update, False, locked_message(wait_seconds), no_update
        try:
            who = ctx.client.whoami(key.strip())
        except BillingError as exc:
            if exc.status not in (401, 403):
                return no_update, False, f"Not signed in: {exc}.", no_update
            return no_update, False, _refused(signins, address), no_update
        signins.succeeded(address)
        caller = who["caller"]
        return {"token": key.strip(), "name": caller["name"], "team": caller["team"],
                "is_admin": caller["is_admin"], "teams": who["teams"]}, False, "", ""  # fmt: skip

    @app.callback(Output("range", "value"), Input("url", "search"))
    def range_from_url(search: str | None) -> Any:
        """``?range=24h`` in the address picks the range, so a view can be linked to."""
        choice = parse_qs((search or "").lstrip("?")).get("range", [None])[0]
        return choice if choice in RANGES else no_update

    app.clientside_callback(_TZ_JS, Output("tz", "data"), Input("url", "pathname"))  # type: ignore[no-untyped-call]
    app.clientside_callback(_SORT_JS, Output("sortable", "data"), Input("url", "pathname"))  # type: ignore[no-untyped-call]
    for module in PAGES:
        module.register(app, ctx)
    # The hashes name the renderer and the clientside callbacks, so every callback comes first.
    install_security_headers(app.server, content_security_policy(app.csp_hashes()))
    return app
