"""The dashboard's pages and sign-in hold against the attacks on a key typed into them.

Adversaries: a page elsewhere that frames the dashboard to overlay its sign-in form, markup or
script injected into a page (the Content-Security-Policy must stop it while Dash still works, in
real Chromium), the next person at the same browser (the key must not outlive the tab or the
sign-out, and never reaches the browser's storage: it holds a session id), a guesser of keys
(failures from one address are throttled, and no data callback takes a key, so none is a way
around the throttle), and a client sending a body large enough to exhaust memory (413 before it
is read).
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from dashboards.app import create_app
from dashboards.headers import installed_headers
from dashboards.sessions import Session, Sessions, clean_key
from dashboards.throttle import (
    Attempts,
    SignInThrottle,
    ThrottlePolicy,
    after_failure,
    locked_message,
)
from dashboards.wsgi import WsgiServer
from infermeter.config import Config
from infermeter.serving import free_port
from tests.dashboards import records
from tests.dashboards.records import ADMIN_KEY
from tests.dashboards.stack import billing_thread, chromium, dashboard_config, wsgi_thread

HEADERS = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
# Each page and an element that shows once its data has loaded.
PAGES = [
    ("/?range=24h", "#fleet-requests-total"),
    ("/teams", "#teams-table"),
    ("/chargeback", "#chargeback-reconciles"),
    ("/sla?range=24h", "#sla-models-table"),
    ("/planner", "#plan-total"),
]


@contextlib.contextmanager
def dashboard(
    config: Config,
    billing: str,
    throttle: SignInThrottle | None = None,
    sessions: Sessions | None = None,
) -> Iterator[str]:
    """The dashboard app under its production server (waitress) on a loopback port, with its body
    limit and headers as ``infermeter dashboard`` sets them; yields its URL."""
    port = free_port()
    app = create_app(config, billing, throttle=throttle, sessions=sessions).server
    server = WsgiServer(
        app,
        "127.0.0.1",
        port,
        max_body_bytes=config.dashboard.max_body_bytes,
        error_headers=installed_headers(app),
    )
    with wsgi_thread(server, port) as url:
        yield url


@pytest.fixture(scope="module")
def config() -> Config:
    return dashboard_config()


@pytest.fixture(scope="module")
def billing(config: Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("dashboard-security")
    ledger = records.open_ledger(
        config, tmp / "ledger.duckdb", records.build(records.recent_start())
    )
    try:
        with billing_thread(config, ledger) as url:
            yield url
    finally:
        ledger.close()


@pytest.fixture(scope="module")
def url(config: Config, billing: str) -> Iterator[str]:
    with dashboard(config, billing) as url:
        yield url


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dashboard-security-downloads")


@pytest.fixture(scope="module")
def driver(downloads: Path) -> Iterator[webdriver.Chrome]:
    with chromium(downloads) as driver:
        yield driver


def wait_text(driver: webdriver.Chrome, css: str, text: str = "", timeout: float = 20) -> str:
    """The text of the first element matching ``css`` once it shows (containing ``text``)."""

    def ready(d: webdriver.Chrome) -> str | bool:
        found = d.find_elements(By.CSS_SELECTOR, css)
        return bool(found) and text in found[0].text and (found[0].text or True)

    result = WebDriverWait(driver, timeout, poll_frequency=0.1).until(ready)
    return result if isinstance(result, str) else ""


def open_fresh(driver: webdriver.Chrome, url: str) -> None:
    """Open the sign-in form in a tab with no stored state."""
    driver.get(url + "/")
    driver.execute_script("window.sessionStorage.clear(); window.localStorage.clear();")
    driver.get(url + "/")
    wait_text(driver, "#login-key")
    driver.get_log("browser")  # type: ignore[no-untyped-call]


def try_key(driver: webdriver.Chrome, key: str) -> None:
    """Type ``key`` into the sign-in form and press the button."""
    box = driver.find_element(By.ID, "login-key")
    box.clear()
    box.send_keys(key)
    driver.find_element(By.ID, "login-button").click()


def severe_logs(driver: webdriver.Chrome) -> list[dict[str, object]]:
    """The browser console's errors since the last call (CSP violations are among them)."""
    logs = driver.get_log("browser")  # type: ignore[no-untyped-call]
    return [e for e in logs if e["level"] == "SEVERE"]


def stored(driver: webdriver.Chrome, storage: str) -> str:
    """Every key and value of ``localStorage`` or ``sessionStorage``, as one string."""
    text: str = driver.execute_script(f"return JSON.stringify(Object.entries(window.{storage}));")
    return text


def test_every_response_carries_the_security_headers(url):
    """The page, Dash's API, a script, refused requests and an unknown path all carry the headers."""
    with httpx.Client(base_url=url) as client:
        page = client.get("/")
        script = re.search(r'src="(/_dash-component-suites/[^"]+)"', page.text)
        assert script is not None
        responses = [
            page,
            client.get("/_dash-layout"),
            client.get("/_dash-dependencies"),
            client.get(script.group(1)),
            client.post("/_dash-update-component", content=b"not json"),
            client.put("/"),
            client.get("/no/such/page"),  # Dash answers every unknown path with the page
        ]
    assert [r.status_code for r in responses] == [200, 200, 200, 200, 415, 405, 200]
    for response in responses:
        assert {k: response.headers.get(k) for k in HEADERS} == HEADERS, response.url
        csp = response.headers.get("content-security-policy", "")
        assert "frame-ancestors 'none'" in csp, response.url
        assert re.search(r"(^|; )script-src 'self'( 'sha256-[A-Za-z0-9+/=]+')+(;|$)", csp), csp
        assert "unsafe-eval" not in csp


def test_every_page_works_under_the_policy(driver, url, downloads):
    """Signed in as the admin, every page loads and downloads a file with no console error."""
    open_fresh(driver, url)
    try_key(driver, ADMIN_KEY)
    wait_text(driver, "#who", "admin")
    for path, ready in PAGES:
        driver.get(url + path)
        wait_text(driver, ready)
        if path.startswith("/?"):  # Plotly draws the fleet's graphs after the numbers show
            WebDriverWait(driver, 20).until(
                lambda d: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) == 8
            )
        assert severe_logs(driver) == [], path
    driver.get(url + "/chargeback")
    wait_text(driver, "#chargeback-reconciles", "Reconciles")
    driver.find_element(By.ID, "chargeback-csv-button").click()
    WebDriverWait(driver, 10).until(lambda _: any(downloads.glob("chargeback-*.csv")))
    assert severe_logs(driver) == []


def test_injected_inline_script_does_not_run(driver, url):
    """A script element added to the page (as injected markup would be) is refused by the CSP."""
    open_fresh(driver, url)
    ran = driver.execute_script(
        "const s = document.createElement('script');"
        "s.textContent = 'window.injected = true';"
        "document.body.appendChild(s);"
        "return window.injected === true;"
    )
    assert ran is False
    assert any("Content Security Policy" in str(e["message"]) for e in severe_logs(driver))


def test_the_key_never_reaches_the_browsers_storage_and_sign_out_clears_it(driver, url):
    """Signed in, the tab holds a session id, never the key (in no storage, no cookie); sign-out
    leaves nothing."""
    open_fresh(driver, url)
    try_key(driver, ADMIN_KEY)
    wait_text(driver, "#who", "admin")
    assert ADMIN_KEY not in stored(driver, "sessionStorage")
    assert "session" in stored(driver, "sessionStorage")
    assert ADMIN_KEY not in stored(driver, "localStorage")
    assert driver.get_cookies() == []
    assert driver.find_element(By.ID, "login-key").get_attribute("value") == ""
    driver.find_element(By.ID, "logout").click()
    WebDriverWait(driver, 10).until(lambda d: d.find_element(By.ID, "login-key").is_displayed())
    assert ADMIN_KEY not in stored(driver, "sessionStorage")
    assert ADMIN_KEY not in stored(driver, "localStorage")
    assert driver.find_element(By.ID, "login-key").get_attribute("value") == ""
    assert driver.get_cookies() == []


def test_repeated_failures_lock_the_address_out(driver, config, billing):
    """After the allowed failures even the right key is refused, with a message saying when to retry."""
    throttle = SignInThrottle(ThrottlePolicy(max_failures=3, lockout_seconds=600))
    with dashboard(config, billing, throttle) as url:
        open_fresh(driver, url)
        try_key(driver, "im-not-a-key")
        wait_text(driver, "#login-error", "2 more tries")
        try_key(driver, "im-not-a-key-either")
        wait_text(driver, "#login-error", "1 more try")
        try_key(driver, "im-still-not-a-key")
        assert "try again in 600 s" in wait_text(driver, "#login-error", "Too many failed")
        try_key(driver, ADMIN_KEY)
        wait_text(driver, "#login-error", "try again in")
        assert driver.find_element(By.ID, "who").text == ""
        assert driver.find_elements(By.CSS_SELECTOR, "#content .page") == []
    assert len(throttle) == 1


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failures_outside_the_window_start_a_new_count():
    """A failure after the window has passed counts as the first of a new window."""
    policy = ThrottlePolicy(max_failures=3, window_seconds=60)
    attempts = after_failure(after_failure(Attempts(), 0, policy), 10, policy)
    assert attempts.failures == 2
    assert after_failure(attempts, 71, policy) == Attempts(1, 71, 0)


def test_the_lockout_ends_after_its_time():
    """A locked address may try again once the lockout has run out, and the count starts afresh."""
    clock = Clock()
    throttle = SignInThrottle(ThrottlePolicy(max_failures=2, lockout_seconds=30), clock)
    assert throttle.failed("10.0.0.1").retry_after(clock()) == 0
    assert throttle.failed("10.0.0.1").retry_after(clock()) == 30
    clock.now += 29.5
    assert throttle.retry_after("10.0.0.1") == pytest.approx(0.5)
    assert locked_message(0.5) == "Too many failed sign-ins from your address: try again in 1 s."
    clock.now += 0.5
    assert throttle.retry_after("10.0.0.1") == 0
    assert throttle.failed("10.0.0.1").retry_after(clock()) == 0


def test_addresses_are_throttled_separately():
    """One address's failures do not lock out another."""
    throttle = SignInThrottle(ThrottlePolicy(max_failures=2), Clock())
    throttle.failed("10.0.0.1")
    throttle.failed("10.0.0.1")
    throttle.failed("10.0.0.2")
    assert throttle.retry_after("10.0.0.1") > 0
    assert throttle.retry_after("10.0.0.2") == 0


def test_signing_in_with_a_key_of_ones_own_clears_no_failures(config, billing):
    """A holder of a valid key who guesses others: four wrong keys, a sign-in with its own,
    four more. Had the sign-in cleared the count, the guesses would go on for ever, four at
    a time; the address is locked out at the fifth wrong key within the window."""
    throttle = SignInThrottle(ThrottlePolicy(max_failures=5, lockout_seconds=60), Clock())
    with dashboard(config, billing, throttle) as url:
        for _ in range(4):
            assert "session" not in (sign_in(url, "im-not-a-key")["auth"]["data"] or {})
        assert "session" in sign_in(url, ADMIN_KEY)["auth"]["data"]
        sign_in(url, "im-not-a-key")
        assert "try again in 60 s" in sign_in(url, ADMIN_KEY)["login-error"]["children"]


def test_remembered_addresses_are_bounded():
    """A flood of addresses keeps at most ``max_addresses``, forgetting the least recent first."""
    throttle = SignInThrottle(ThrottlePolicy(max_addresses=100), Clock())
    for i in range(1000):
        throttle.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(throttle) == 100
    assert throttle.failed("10.0.0.0").failures == 1
    assert throttle.failed("10.0.3.231").failures == 2


# -- no callback is a way around the sign-in form ---------------------------------------------

SUMMARY = "..summary.children...money.data.."
SIGN_IN = "..auth.data...auth.clear_data...login-error.children...login-key.value.."


def callback(
    url: str,
    output: str,
    inputs: list[dict[str, Any]],
    state: list[dict[str, Any]] | None = None,
    changed: str | None = None,
) -> dict[str, Any]:
    """Post one Dash callback the way the browser does (or an attacker's script would);
    ``changed`` is the input that fired it (default the first)."""
    outputs = [
        dict(zip(("id", "property"), o.split("."), strict=True))
        for o in output.strip(".").split("...")
    ]
    body = {
        "output": output,
        "outputs": outputs,
        "inputs": inputs,
        "state": state or [],
        "changedPropIds": [changed or f"{inputs[0]['id']}.{inputs[0]['property']}"],
    }
    r = httpx.post(f"{url}/_dash-update-component", json=body, timeout=30)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()["response"]
    return answer


def summary(url: str, auth: Any) -> dict[str, Any]:
    """The summary row's callback (it reads spend and the statement from billing) for ``auth``."""
    return callback(
        url,
        SUMMARY,
        [
            {"id": "tick", "property": "n_intervals", "value": 1},
            {"id": "range", "property": "value", "value": "24h"},
            {"id": "auth", "property": "data", "value": auth},
            {"id": "tz", "property": "data", "value": "UTC"},
        ],
    )


def sign_in(url: str, key: str) -> dict[str, Any]:
    """The sign-in form's callback, as pressing its button with ``key`` typed sends it."""
    return callback(
        url,
        SIGN_IN,
        [
            {"id": "login-button", "property": "n_clicks", "value": 1},
            {"id": "login-key", "property": "n_submit", "value": None},
            {"id": "logout", "property": "n_clicks", "value": None},
            {"id": "tick", "property": "n_intervals", "value": None},
        ],
        [
            {"id": "login-key", "property": "value", "value": key},
            {"id": "auth", "property": "data", "value": None},
        ],
    )


def tick(url: str, auth: Any) -> dict[str, Any]:
    """The sign-in callback as the refresh interval fires it in a tab holding ``auth``."""
    return callback(
        url,
        SIGN_IN,
        [
            {"id": "login-button", "property": "n_clicks", "value": None},
            {"id": "login-key", "property": "n_submit", "value": None},
            {"id": "logout", "property": "n_clicks", "value": None},
            {"id": "tick", "property": "n_intervals", "value": 1},
        ],
        [
            {"id": "login-key", "property": "value", "value": None},
            {"id": "auth", "property": "data", "value": auth},
        ],
        changed="tick.n_intervals",
    )


SIGNED_OUT = {"summary": {"children": None}, "money": {"data": None}}


def test_a_data_callback_takes_no_key(url):
    """A key put in the session store by hand is not a sign-in: the right key and a wrong one get
    the same signed-out answer, and so does a session id nobody was given."""
    assert summary(url, {"token": ADMIN_KEY, "is_admin": True}) == SIGNED_OUT
    assert summary(url, {"token": "im-not-a-key", "is_admin": True}) == SIGNED_OUT
    assert summary(url, {"session": "made-up-" + "x" * 40}) == SIGNED_OUT
    session = sign_in(url, ADMIN_KEY)["auth"]["data"]
    assert summary(url, session)["money"]["data"]["statement"]["lines"]


def test_while_locked_out_no_callback_looks_anything_up(config, billing):
    """Locked out of sign-in, an address gets the signed-out answer from every callback, even
    with a session that was valid: nothing it sends tells a valid key or session from a wrong
    one until the lockout ends."""
    clock = Clock()
    throttle = SignInThrottle(ThrottlePolicy(max_failures=2, lockout_seconds=60), clock)
    with dashboard(config, billing, throttle) as url:
        session = sign_in(url, ADMIN_KEY)["auth"]["data"]
        assert summary(url, session)["money"]["data"] is not None
        for _ in range(2):
            sign_in(url, "im-not-a-key")
        assert "try again in 60 s" in sign_in(url, ADMIN_KEY)["login-error"]["children"]
        assert summary(url, session) == SIGNED_OUT
        assert summary(url, {"token": ADMIN_KEY, "is_admin": True}) == SIGNED_OUT
        clock.now += 60
        assert summary(url, session)["money"]["data"] is not None


def test_a_key_is_trimmed_before_it_is_checked(url):
    """Spaces, tabs, newlines and invisible characters around a pasted key are not part of it."""
    pasted = f" \t\u00a0\u200b{ADMIN_KEY}\ufeff \n"
    assert clean_key(pasted) == ADMIN_KEY
    assert "session" in sign_in(url, pasted)["auth"]["data"]
    blank = sign_in(url, " \u200b\n")
    assert blank["login-error"]["children"] == "Enter a key."


def test_a_services_key_is_called_known_but_not_allowed(url):
    """The metrics token is known to billing: the form says it is a service's, not unknown."""
    said = sign_in(url, "im-demo-metrics")["login-error"]["children"]
    assert "this key is known, but it is a service's (metrics or ingest)" in said
    assert "not known" not in said
    assert "not known" in sign_in(url, "im-not-a-key")["login-error"]["children"]


def test_sessions_are_bounded_and_end_when_idle():
    """At most max_sessions live (the least recently used goes), and an idle one is over."""
    clock = Clock()
    sessions = Sessions(idle_seconds=100, max_sessions=3, clock=clock)
    ids = [sessions.begin(Session(f"k{i}", f"t{i}", f"t{i}", False)) for i in range(4)]
    assert len(sessions) == 3
    assert sessions.get(ids[0]) is None
    assert sessions.get(ids[3]) == Session("k3", "t3", "t3", False)
    clock.now += 101
    assert sessions.get(ids[3]) is None
    sessions.end(ids[2])
    assert sessions.get(ids[2]) is None


def test_one_key_signing_in_again_and_again_signs_no_one_else_out(config, billing):
    """A team key signed in past the bound ends its own oldest sessions: the admin's, and
    another team's, still read (before, the least recently used of all went: one key signed
    everyone out by signing in max_sessions times)."""
    with dashboard(config, billing, sessions=Sessions(max_sessions=4)) as url:
        admin = sign_in(url, ADMIN_KEY)["auth"]["data"]
        other = sign_in(url, "im-demo-assistant")["auth"]["data"]
        flood = [sign_in(url, "im-demo-search")["auth"]["data"] for _ in range(6)]
        assert summary(url, admin)["money"]["data"] is not None
        assert summary(url, other)["money"]["data"] is not None
        assert summary(url, flood[-1])["money"]["data"] is not None
        assert summary(url, flood[0]) == SIGNED_OUT


def test_past_the_bound_the_caller_holding_the_most_sessions_loses_its_oldest():
    """Eviction takes the least recently used session of the caller holding the most."""
    sessions = Sessions(max_sessions=3, clock=Clock())
    admin = sessions.begin(Session("a", "@admin", None, True))
    first = sessions.begin(Session("k", "search", "search", False))
    second = sessions.begin(Session("k", "search", "search", False))
    third = sessions.begin(Session("k", "search", "search", False))
    assert len(sessions) == 3
    assert sessions.get(admin) is not None
    assert sessions.get(first) is None
    assert sessions.get(second) is not None
    assert sessions.get(third) is not None


def test_a_member_signing_in_again_and_again_signs_no_teammate_out(config, billing):
    """Past the bound, a member key of a team ends its own oldest sessions, not a teammate's
    signed in with a key of their own (before, the caller was the team: the teammate's
    session, the team's least recently used, went first)."""
    ana, ben = issue(billing, "ana")[1], issue(billing, "ben")[1]
    with dashboard(config, billing, sessions=Sessions(max_sessions=4)) as url:
        admin = sign_in(url, ADMIN_KEY)["auth"]["data"]
        teammate = sign_in(url, ben)["auth"]["data"]
        flood = [sign_in(url, ana)["auth"]["data"] for _ in range(6)]
        assert summary(url, admin)["money"]["data"] is not None
        assert summary(url, teammate)["money"]["data"] is not None
        assert summary(url, flood[-1])["money"]["data"] is not None
        assert summary(url, flood[0]) == SIGNED_OUT


def test_a_session_whose_key_billing_revokes_is_signed_out_and_told_why(config, billing):
    """Billing's first 401 to a session's read ends the session; the next refresh sends the tab
    to the sign-in form saying why, and no later callback reads with it (before, the session
    lived on and every refresh showed billing's refusal). A teammate's key is untouched."""
    key_id, key = issue(billing, "cy")
    teammate = issue(billing, "di")[1]
    with dashboard(config, billing) as url:
        auth = sign_in(url, key)["auth"]["data"]
        other = sign_in(url, teammate)["auth"]["data"]
        assert summary(url, auth)["money"]["data"] is not None
        revoked = httpx.post(
            f"{billing}/v1/keys/{key_id}/revoke", json={"reason": "left"}, headers=ADMIN
        )
        assert revoked.status_code == 200, revoked.text
        refused = summary(url, auth)
        assert refused["money"]["data"] is None
        assert "Figures unavailable" in str(refused["summary"]["children"])
        assert summary(url, auth) == SIGNED_OUT
        told = tick(url, auth)
        assert told["auth"] == {"data": None, "clear_data": True}
        assert told["login-error"]["children"] == (
            "Signed out: billing no longer accepts the key you signed in with (it was revoked "
            "or has expired). Sign in with a key in force."
        )
        assert tick(url, auth) == {}  # said once
        assert summary(url, other)["money"]["data"] is not None
        assert tick(url, other) == {}  # a live session: the refresh changes nothing


def test_in_the_browser_a_revoked_keys_tab_is_sent_to_sign_in(driver, config, billing):
    """In Chromium, refreshing every second: once billing revokes the key, the tab shows the
    sign-in form with the reason, and no page or navigation (before, it stayed on the page,
    every figure replaced by billing's refusal)."""
    key_id, key = issue(billing, "fay")
    dashboard_settings = config.dashboard.model_copy(update={"refresh_seconds": 1.0})
    fast = config.model_copy(update={"dashboard": dashboard_settings})
    with dashboard(fast, billing) as url:
        open_fresh(driver, url)
        try_key(driver, key)
        wait_text(driver, "#who", "team search")
        revoked = httpx.post(
            f"{billing}/v1/keys/{key_id}/revoke", json={"reason": "left"}, headers=ADMIN
        )
        assert revoked.status_code == 200, revoked.text
        wait_text(driver, "#login-error", "Signed out: billing no longer accepts the key")
        assert driver.find_element(By.ID, "login-key").is_displayed()
        assert not driver.find_element(By.ID, "nav").is_displayed()
        assert driver.find_elements(By.CSS_SELECTOR, "#content .page") == []
        assert "session" not in stored(driver, "sessionStorage")


def test_a_session_ends_at_its_keys_expiry_without_asking_billing(config, billing):
    """A key issued for 3 s: its session knows the expiry from sign-in and ends then, without a
    read billing refuses, and the next refresh signs the tab out as expired (before, the session
    outlived its key, each read answered by billing's 401)."""
    key = issue(billing, "ed", expires_in_seconds=3)[1]
    with dashboard(config, billing) as url:
        auth = sign_in(url, key)["auth"]["data"]
        assert summary(url, auth)["money"]["data"] is not None
        time.sleep(3.2)
        assert summary(url, auth) == SIGNED_OUT  # no read: billing would have said 401
        told = tick(url, auth)
        assert told["auth"] == {"data": None, "clear_data": True}
        assert told["login-error"]["children"] == (
            "Signed out: the key you signed in with has expired. Sign in with a key in force."
        )


ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def issue(billing: str, member: str, **extra: Any) -> tuple[str, str]:
    """A member key of team search, issued by the admin through billing: its id and secret."""
    body = {"team": "search", "member": member, "reason": "test", **extra}
    made = httpx.post(f"{billing}/v1/keys", json=body, headers=ADMIN)
    assert made.status_code == 201, made.text
    return made.json()["key_id"], made.json()["key"]


CSV_DOWNLOAD = "..chargeback-csv.data...chargeback-csv-error.children.."


def download_csv(url: str, auth: Any, month: str) -> dict[str, Any]:
    """The chargeback page's CSV button, pressed with ``month`` picked."""
    return callback(
        url,
        CSV_DOWNLOAD,
        [{"id": "chargeback-csv-button", "property": "n_clicks", "value": 1}],
        [
            {"id": "auth", "property": "data", "value": auth},
            {"id": "chargeback-month", "property": "value", "value": month},
        ],
    )


def test_a_download_billing_refuses_is_said_on_the_page_not_a_500(config):
    """When billing refuses a file (its read limit spent: 429; a month it does not take: 400)
    the button's callback answers with the reason beside the buttons and no file, where it
    raised and the dashboard answered 500 with nothing shown."""
    limited = config.model_copy(
        update={
            "billing": config.billing.model_copy(
                update={"read_burst": 3, "read_rate_per_second": 0.001}
            )
        }
    )
    ledger = records.open_ledger(limited, ":memory:", records.build(records.recent_start()))
    try:
        with billing_thread(limited, ledger) as billing, dashboard(limited, billing) as url:
            admin = sign_in(url, ADMIN_KEY)["auth"]["data"]
            bad = download_csv(url, admin, "2026-13")
            assert "was not downloaded" in str(bad["chargeback-csv-error"]["children"])
            assert "2026-13" in str(bad["chargeback-csv-error"]["children"])
            assert "chargeback-csv" not in bad
            assert download_csv(url, admin, "2026-10")["chargeback-csv"]["data"]["content"]
            refused = download_csv(url, admin, "2026-10")
            assert "chargeback-csv" not in refused
            assert "was not downloaded" in str(refused["chargeback-csv-error"]["children"])
    finally:
        ledger.close()


# -- request bodies ---------------------------------------------------------------------------


def _raw(url: str, head: bytes, body: bytes = b"", timeout: float = 10) -> bytes:
    """Send ``head`` (and ``body``) on a raw connection; what comes back before it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head)
        with contextlib.suppress(OSError):
            sock.sendall(body)
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def test_a_body_over_the_limit_is_refused_before_it_is_read(config, url):
    """Content-Length 400 MiB: 413, with the security headers, before a byte of the body is sent."""
    head = (
        b"POST /_dash-update-component HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 419430400\r\n\r\n"
    )
    answer = _raw(url, head).decode("latin-1")
    assert answer.startswith("HTTP/1.1 413 "), answer[:200]
    headers = answer.partition("\r\n\r\n")[0].lower()
    for name, value in HEADERS.items():
        assert f"{name}: {value}".lower() in headers
    assert "frame-ancestors 'none'" in headers


def test_a_chunked_body_is_cut_off_at_the_limit(config, url):
    """A chunked body (no length announced) is refused once it passes max_body_bytes."""
    limit = config.dashboard.max_body_bytes
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(limit // len(chunk) + 2))
    head = (
        b"POST /_dash-update-component HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    assert _raw(url, head, body).startswith(b"HTTP/1.1 413 ")


def test_a_body_within_the_limit_still_reaches_dash(url):
    """A callback body of half the limit is read and answered by Dash."""
    assert summary(url, {"session": "x", "padding": "x" * 500_000}) == SIGNED_OUT


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(120)
def test_a_400_mib_post_leaves_the_process_where_it_was(tmp_path):
    """``infermeter dashboard`` sent 400 MiB to /_dash-update-component: its peak memory grows
    by less than 20 MiB (it once reached 941 MiB), and it still answers."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "dashboard",
            "--listen",
            f"127.0.0.1:{port}",
            "--billing-url",
            "http://127.0.0.1:9",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the dashboard did not start"
            time.sleep(0.2)
        before = _peak_rss_mib(proc.pid)
        head = (
            b"POST /_dash-update-component HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 419430400\r\n\r\n"
        )
        host_port = ("127.0.0.1", port)
        with socket.create_connection(host_port, timeout=10) as sock:
            sock.sendall(head)
            sent = 0
            block = b"x" * (1 << 20)
            with contextlib.suppress(OSError):
                while sent < 400 << 20:
                    sock.sendall(block)
                    sent += len(block)
        assert httpx.get(url + "/", timeout=5).status_code == 200
        assert _peak_rss_mib(proc.pid) - before < 20
    finally:
        proc.terminate()
        proc.wait(10)


def test_hand_made_callbacks_with_a_bad_month_or_day_are_answered_not_a_500(url):
    """The month list and the date picker send YYYY-MM and YYYY-MM-DD; a script posting the
    efficiency page's callback with month 2026-13, or the allocation explorer's with a day that
    is not one, gets the page's own answer (a note), where the dashboard raised a 500."""
    from dashboards.pages.efficiency import GROUP_CHARTS

    session = sign_in(url, ADMIN_KEY)["auth"]["data"]
    charts = "...".join(f"{g}.figure" for g, *_ in GROUP_CHARTS)
    efficiency = callback(
        url,
        f"..efficiency-status.children...efficiency-advice.children...efficiency-summary.children...{charts}..",
        [
            {"id": "efficiency-month", "property": "value", "value": "2026-13"},
            {"id": "auth", "property": "data", "value": session},
            {"id": "tz", "property": "data", "value": "UTC"},
        ],
    )
    assert "pick a month" in str(efficiency["efficiency-status"]["children"])
    allocation = callback(
        url,
        "..alloc-status.children...alloc-chart.figure...alloc-events.children...alloc-table.children"
        "...alloc-notes.children...alloc-filter.options...alloc-shown.data..",
        [
            {"id": "alloc-window", "property": "value", "value": "custom"},
            {"id": "alloc-dates", "property": "start_date", "value": "not-a-day"},
            {"id": "alloc-dates", "property": "end_date", "value": None},
            {"id": "alloc-by", "property": "value", "value": "team"},
            {"id": "alloc-then", "property": "value", "value": None},
            {"id": "alloc-filter", "property": "value", "value": []},
            {"id": "auth", "property": "data", "value": session},
            {"id": "tick", "property": "n_intervals", "value": 1},
        ],
        [{"id": "tz", "property": "data", "value": "UTC"}],
    )
    assert "YYYY-MM-DD" in str(allocation["alloc-status"]["children"])


PLAN = "..plan-summary.children...plan-table.children.."


def plan_reply(url: str, auth: Any) -> dict[str, Any]:
    """The planner's callback for a 70B model, as the page sends it, with ``auth``."""
    fields = {"params": 70, "context": 8192, "concurrency": 16, "layers": 80}
    fields |= {"kv-heads": 8, "head-dim": 128}
    return callback(
        url,
        PLAN,
        [
            {"id": "plan-precision", "property": "value", "value": "fp16"},
            {"id": "plan-kv-precision", "property": "value", "value": "fp16"},
            *({"id": f"plan-{k}", "property": "value", "value": v} for k, v in fields.items()),
        ],
        [{"id": "auth", "property": "data", "value": auth}],
    )


def test_the_planner_gives_no_prices_to_a_caller_not_signed_in(url):
    """The price book is the platform's: posted without a session (or with a made-up one), the
    planner's callback says to sign in and gives no table; signed in, its figures."""
    for auth in (None, {"session": "made-up-" + "x" * 40}):
        reply = plan_reply(url, auth)
        assert "Sign in to plan." in str(reply["plan-summary"]["children"])
        assert reply["plan-table"]["children"] is None
    session = sign_in(url, ADMIN_KEY)["auth"]["data"]
    assert "GB per replica" in str(plan_reply(url, session)["plan-summary"]["children"])
