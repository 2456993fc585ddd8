"""The dashboard's pages and sign-in hold against the browser-side attacks on a key typed into them.

Adversaries: a page elsewhere that frames the dashboard to overlay its sign-in form, markup or
script injected into a page (the Content-Security-Policy must stop it while Dash still works, in
real Chromium), the next person at the same browser (the key must not outlive the tab or the
sign-out), and a guesser of keys at the sign-in form (failures from one address are throttled).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from dashboards.app import create_app
from dashboards.throttle import (
    Attempts,
    SignInThrottle,
    ThrottlePolicy,
    after_failure,
    locked_message,
)
from dashboards.wsgi import WsgiServer
from infermeter.config import Config, DashboardSettings, load_config
from infermeter.serving import free_port
from tests.dashboards import records
from tests.dashboards.records import ADMIN_KEY
from tests.dashboards.stack import billing_thread, chromium

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
    config: Config, billing: str, throttle: SignInThrottle | None = None
) -> Iterator[str]:
    """The dashboard app under its production server (waitress) on a loopback port; yields its URL."""
    port = free_port()
    app = create_app(config, billing, throttle=throttle).server
    server = WsgiServer(app, "127.0.0.1", port)
    thread = threading.Thread(target=server.serve, name="dashboard", daemon=True)
    thread.start()
    server.started.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        thread.join(10)


@pytest.fixture(scope="module")
def config() -> Config:
    config = load_config(None, environ={})
    return config.model_copy(update={"dashboard": DashboardSettings(refresh_seconds=3600)})


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


def test_the_key_lives_only_in_the_tab_and_sign_out_clears_it(driver, url):
    """The key is never in local storage or a cookie, and sign-out leaves it nowhere."""
    open_fresh(driver, url)
    try_key(driver, ADMIN_KEY)
    wait_text(driver, "#who", "admin")
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


def test_addresses_are_throttled_separately_and_success_forgets():
    """One address's failures do not lock out another, and a success clears its own count."""
    throttle = SignInThrottle(ThrottlePolicy(max_failures=2), Clock())
    throttle.failed("10.0.0.1")
    throttle.failed("10.0.0.1")
    throttle.failed("10.0.0.2")
    assert throttle.retry_after("10.0.0.1") > 0
    assert throttle.retry_after("10.0.0.2") == 0
    throttle.succeeded("10.0.0.2")
    assert throttle.failed("10.0.0.2").failures == 1


def test_remembered_addresses_are_bounded():
    """A flood of addresses keeps at most ``max_addresses``, forgetting the least recent first."""
    throttle = SignInThrottle(ThrottlePolicy(max_addresses=100), Clock())
    for i in range(1000):
        throttle.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(throttle) == 100
    assert throttle.failed("10.0.0.0").failures == 1
    assert throttle.failed("10.0.3.231").failures == 2
