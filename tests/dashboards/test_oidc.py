"""Single sign-on end to end: a real OpenID Connect provider process, billing and the dashboard on
loopback, and real headless Chromium clicking through the provider's sign-in page.

The provider is ``oidc-provider-mock`` (a real authorization server built on authlib: code flow,
PKCE, signed ID tokens, JWKS), started once for the module with one user per case: an admin,
a member of team search, and a person whose only group is mapped to nothing. The ID tokens the
billing tests present are obtained from that same provider with the code flow, as a browser
would.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from billing.ledger import Ledger
from dashboards.app import create_app
from dashboards.headers import installed_headers
from dashboards.sessions import Sessions
from dashboards.wsgi import WsgiServer
from infermeter.config import Config, OidcSettings
from infermeter.http_guard import DEFAULT_LIMITS
from infermeter.serving import free_port
from tests.dashboards import records
from tests.dashboards.stack import billing_thread, chromium, dashboard_config, wsgi_thread

CLIENT_ID = "infermeter-dashboard"
SECRET_ENV = "TEST_OIDC_CLIENT_SECRET"
ADMIN = "ana@example.com"
MEMBER = "sam@example.com"
STRANGER = "eve@example.com"
LEAD = "lia@example.com"
USERS = {
    ADMIN: ["platform-admins", "everyone"],
    MEMBER: ["search-devs", "everyone"],
    STRANGER: ["marketing"],
    LEAD: ["search-leads", "search-devs"],
}
GROUPS = {"platform-admins": "admin", "search-devs": "member:search", "search-leads": "lead:search"}


@dataclass
class Stack:
    issuer: str
    billing: str
    url: str
    config: Config
    sessions: Sessions
    heard: list[tuple[str, str, dict[str, Any]]]
    driver: webdriver.Chrome
    artifacts: Path


@contextlib.contextmanager
def provider() -> Iterator[str]:
    """``oidc-provider-mock`` as a process of its own on a free port; yields its issuer URL."""
    port = free_port()
    claims = [json.dumps({"sub": s, "email": s, "groups": g}) for s, g in USERS.items()]
    args = [sys.executable, "-m", "oidc_provider_mock", "--port", str(port)]
    for c in claims:
        args += ["--user-claims", c]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    issuer = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{issuer}/.well-known/openid-configuration").status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                ended = process.poll() is not None and process.stderr is not None
                said = process.stderr.read().decode()[-2000:] if ended and process.stderr else ""
                raise RuntimeError(f"the OIDC provider did not start: {said}")
            time.sleep(0.1)
        yield issuer
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        if process.stderr is not None:
            process.stderr.close()


@contextlib.contextmanager
def dashboard(
    config: Config, billing: str, sessions: Sessions, heard: list[tuple[str, str, dict[str, Any]]]
) -> Iterator[str]:
    """The dashboard served as ``infermeter dashboard`` serves it, its sign-ins told to ``heard``."""

    def record(action: str, actor: str, _role: str, **fields: Any) -> None:
        heard.append((action, actor, fields))

    app = create_app(
        config, billing, sessions=sessions, audit=record, environ={SECRET_ENV: "s3cret"}
    ).server
    port = free_port()
    server = WsgiServer(
        app, "127.0.0.1", port, DEFAULT_LIMITS, error_headers=installed_headers(app)
    )
    with wsgi_thread(server, port) as url:
        yield url


def sso_config(issuer: str, session_seconds: float = 3600) -> Config:
    """The demo configuration with single sign-on through ``issuer``."""
    oidc = OidcSettings(
        issuer=issuer,
        client_id=CLIENT_ID,
        client_secret_env=SECRET_ENV,
        display_name="Example IdP",
        groups=GROUPS,
        session_seconds=session_seconds,
    )
    return dashboard_config(oidc=oidc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("sso")
    artifacts = tmp / "artifacts"
    artifacts.mkdir()
    with contextlib.ExitStack() as stack:
        issuer = stack.enter_context(provider())
        config = sso_config(issuer)
        ledger: Ledger = records.open_ledger(
            config, tmp / "ledger.duckdb", records.build(records.recent_start())
        )
        stack.callback(ledger.close)
        billing = stack.enter_context(billing_thread(config, ledger))
        sessions = Sessions()
        heard: list[tuple[str, str, dict[str, Any]]] = []
        url = stack.enter_context(dashboard(config, billing, sessions, heard))
        driver = stack.enter_context(chromium(tmp / "downloads"))
        yield Stack(issuer, billing, url, config, sessions, heard, driver, artifacts)


def wait(driver: webdriver.Chrome, css: str, text: str | None = None, timeout: float = 20) -> str:
    """The text of the first element matching ``css`` once it shows (containing ``text``)."""

    def ready(d: webdriver.Chrome) -> str | bool:
        found = d.find_elements(By.CSS_SELECTOR, css)
        if not found or not found[0].is_displayed():
            return False
        if text is not None and text not in found[0].text:
            return False
        return found[0].text or True

    result = WebDriverWait(driver, timeout, poll_frequency=0.1).until(ready)
    return result if isinstance(result, str) else ""


def sign_in_as(driver: webdriver.Chrome, url: str, sub: str) -> dict[str, list[str]]:
    """Click "Sign in with Example IdP" and pick ``sub`` on the provider's page; the query of
    the authorization request the dashboard sent the browser to."""
    driver.delete_all_cookies()
    driver.get(url + "/")
    wait(driver, "#sso-login", "Sign in with Example IdP").strip()
    driver.find_element(By.ID, "sso-login").click()
    button = f"button[name='sub'][value='{sub}']"
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, button))
    asked = parse_qs(urlparse(driver.current_url).query)
    driver.find_element(By.CSS_SELECTOR, button).click()
    return asked


def id_token(issuer: str, sub: str) -> str:
    """An ID token for ``sub`` from the provider, by the code flow with PKCE."""
    verifier = secrets.token_urlsafe(48)
    digest = hashlib.sha256(verifier.encode()).digest()
    challenge = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    redirect = "http://127.0.0.1/callback"
    params = {
        "client_id": CLIENT_ID,
        "response_type": "code",
        "redirect_uri": redirect,
        "scope": "openid email profile",
        "state": "s",
        "nonce": secrets.token_hex(8),
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    answer = httpx.post(f"{issuer}/oauth2/authorize", params=params, data={"sub": sub})
    code = parse_qs(urlparse(answer.headers["location"]).query)["code"][0]
    token = httpx.post(
        f"{issuer}/oauth2/token",
        data={
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": redirect,
            "client_id": CLIENT_ID,
            "client_secret": "s3cret",
            "code_verifier": verifier,
        },
    )
    token.raise_for_status()
    found: str = token.json()["id_token"]
    return found


def _get(stack: Stack, path: str, token: str) -> httpx.Response:
    return httpx.get(stack.billing + path, headers={"authorization": f"Bearer {token}"})


def test_admin_group_signs_in_as_admin(stack: Stack) -> None:
    """A person in the admin group signs in through the IdP (the code flow with PKCE, S256) and
    sees the admin's views."""
    asked = sign_in_as(stack.driver, stack.url, ADMIN)
    assert asked["response_type"] == ["code"]
    assert asked["code_challenge_method"] == ["S256"]
    assert len(asked["code_challenge"][0]) == 43  # base64url of a SHA-256
    assert asked["client_id"] == [CLIENT_ID]
    assert "nonce" in asked
    assert wait(stack.driver, "#who", ADMIN) == f"{ADMIN} (admin)"
    stack.driver.get(stack.url + "/teams")
    wait(stack.driver, "#teams-table")
    teams = stack.driver.find_elements(By.CSS_SELECTOR, "#teams-table tbody td[data-column='team']")
    assert {t.text for t in teams} >= set(records.TEAMS)
    assert (
        "signin.succeeded",
        ADMIN,
        {"address": "127.0.0.1", "detail": {"with": "sso"}},
    ) in stack.heard
    stack.driver.save_screenshot(str(stack.artifacts / "sso-admin.png"))


def test_team_group_sees_only_its_team(stack: Stack) -> None:
    """A person in search's group reads search's figures only, through billing with their token."""
    sign_in_as(stack.driver, stack.url, MEMBER)
    assert wait(stack.driver, "#who", MEMBER) == f"{MEMBER} (team search)"
    stack.driver.get(stack.url + "/teams")
    wait(stack.driver, "#teams-table")
    teams = stack.driver.find_elements(By.CSS_SELECTOR, "#teams-table tbody td[data-column='team']")
    assert [t.text for t in teams] == ["search"]


def test_group_mapped_to_nothing_is_refused(stack: Stack) -> None:
    """A person whose groups map to no role stays signed out, told why, and it is on the trail."""
    sign_in_as(stack.driver, stack.url, STRANGER)
    message = wait(stack.driver, "#sso-error", "Not signed in")
    assert (
        message
        == "Not signed in: none of your groups (marketing) is given a role here; ask an admin."
    )
    assert not stack.driver.find_element(By.ID, "nav").is_displayed()
    refused = [h for h in stack.heard if h[0] == "signin.failed" and h[1] == STRANGER]
    assert refused
    assert refused[-1][2]["outcome"] == "refused"


def test_a_denied_or_forged_callback_signs_nobody_in(stack: Stack) -> None:
    """Denying at the IdP, or a callback whose state the browser never sent, is a refusal."""
    driver = stack.driver
    driver.delete_all_cookies()
    driver.get(stack.url + "/")
    wait(driver, "#sso-login").strip()
    driver.find_element(By.ID, "sso-login").click()
    deny = "button[name='action'][value='deny']"
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, deny))
    driver.find_element(By.CSS_SELECTOR, deny).click()
    assert wait(driver, "#sso-error", "Not signed in") == (
        "Not signed in: the sign-in was not completed."
    )
    driver.get(stack.url + "/auth/oidc/callback?code=stolen&state=made-up")
    assert wait(driver, "#sso-error", "Not signed in") == (
        "Not signed in: the identity provider's answer was refused."
    )
    assert not driver.find_element(By.ID, "nav").is_displayed()
    assert [h[2]["why"] for h in stack.heard[-2:]] == [
        "sso: access_denied",
        "sso: MismatchingStateError",
    ]


def test_sign_out_ends_the_session_on_the_server(stack: Stack) -> None:
    """After sign-out, the browser's old cookie, put back, names no session."""
    sign_in_as(stack.driver, stack.url, ADMIN)
    wait(stack.driver, "#who", ADMIN)
    cookie = stack.driver.get_cookie("session")
    assert cookie is not None
    live = len(stack.sessions)
    stack.driver.find_element(By.ID, "logout").click()
    wait(stack.driver, "#sso-login")
    assert len(stack.sessions) == live - 1
    stack.driver.add_cookie({"name": "session", "value": cookie["value"], "path": "/"})
    stack.driver.get(stack.url + "/teams")
    wait(stack.driver, "#sso-login")
    assert not stack.driver.find_element(By.ID, "nav").is_displayed()
    assert stack.heard[-1][:2] == ("signout", ADMIN)


def test_session_expires(stack: Stack) -> None:
    """A session configured to last 3 s is over after 3 s: the next page load is signed out."""
    sessions = Sessions()
    with dashboard(sso_config(stack.issuer, 3), stack.billing, sessions, []) as url:
        sign_in_as(stack.driver, url, MEMBER)
        wait(stack.driver, "#who", MEMBER)
        started = time.monotonic()
        time.sleep(max(0.0, 3.2 - (time.monotonic() - started)))
        stack.driver.get(url + "/teams")
        wait(stack.driver, "#sso-login")
        assert not stack.driver.find_element(By.ID, "nav").is_displayed()
        # The form shows before the page's first callback has looked the session up.
        WebDriverWait(stack.driver, 10, poll_frequency=0.1).until(lambda _: len(sessions) == 0)


def test_an_open_tab_is_sent_to_sign_in_when_its_session_ends(stack: Stack) -> None:
    """Refreshing every second, a tab whose 3 s session ends shows the sign-in form saying so,
    without a page load (before, it stayed on the page: the session named by its cookie, not
    its store, was never told), and the audit trail has the sign-out, why "expired"."""
    sessions = Sessions()
    heard: list[tuple[str, str, dict[str, Any]]] = []
    short = sso_config(stack.issuer, 3)
    fast = short.model_copy(
        update={"dashboard": short.dashboard.model_copy(update={"refresh_seconds": 1.0})}
    )
    with dashboard(fast, stack.billing, sessions, heard) as url:
        sign_in_as(stack.driver, url, MEMBER)
        wait(stack.driver, "#who", MEMBER)
        wait(stack.driver, "#login-error", "your single sign-on session has ended")
        wait(stack.driver, "#sso-login")
        assert not stack.driver.find_element(By.ID, "nav").is_displayed()
    assert [h for h in heard if h[0] == "signout"] == [
        ("signout", MEMBER, {"why": "expired", "detail": {"with": "sso"}})
    ]


def test_billing_reads_with_an_id_token_scoped_by_group(stack: Stack) -> None:
    """Billing's read routes take an ID token as the bearer, scoped by the person's group."""
    member = id_token(stack.issuer, MEMBER)
    spend = _get(stack, "/v1/spend", member)
    assert spend.status_code == 200, spend.text
    assert {row["team"] for row in spend.json()} == {"search"}
    assert _get(stack, "/v1/audit", member).status_code == 403
    admin = id_token(stack.issuer, ADMIN)
    assert _get(stack, "/v1/audit", admin).status_code == 200


def test_tampered_id_token_is_refused(stack: Stack) -> None:
    """A token with a changed signature, or with its groups rewritten, is a 401 from billing."""
    token = id_token(stack.issuer, MEMBER)
    header, payload, signature = token.split(".")
    flipped = signature[:10] + ("A" if signature[10] != "A" else "B") + signature[11:]
    assert _get(stack, "/v1/spend", f"{header}.{payload}.{flipped}").status_code == 401
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["groups"] = ["platform-admins"]
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    answer = _get(stack, "/v1/audit", f"{header}.{forged}.{signature}")
    assert answer.status_code == 401
    assert "ID token refused" in answer.text


def test_id_token_closes_no_month_and_unmapped_is_forbidden(stack: Stack) -> None:
    """Even the admin's ID token may not close a month (403); a stranger's token reads nothing."""
    admin = id_token(stack.issuer, ADMIN)
    closed = httpx.post(
        stack.billing + "/v1/months/2020-01/close", headers={"authorization": f"Bearer {admin}"}
    )
    assert closed.status_code == 403
    assert "other changes take an API key" in closed.text
    stranger = id_token(stack.issuer, STRANGER)
    refused = _get(stack, "/v1/spend", stranger)
    assert refused.status_code == 403
    assert "none of your groups" in refused.text


def _fill(driver: webdriver.Chrome, element_id: str, text: str) -> None:
    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(text)


def test_a_lead_issues_and_revokes_a_key_on_the_keys_page(stack: Stack) -> None:
    """A team lead signed in with single sign-on issues a member key of their team on the keys
    page, sees its secret once, the key reads that team from billing, and once revoked it is
    refused; the audit trail names the person."""
    driver = stack.driver
    sign_in_as(driver, stack.url, LEAD)
    assert wait(driver, "#who", LEAD) == f"{LEAD} (team search)"
    driver.get(stack.url + "/keys")
    wait(driver, "#keys-issue")
    _fill(driver, "keys-member", "rag-service")
    _fill(driver, "keys-reason", "a service of ours")
    driver.find_element(By.ID, "keys-issue").click()
    secret = wait(driver, "#keys-secret-value").strip()
    assert secret.startswith("imk_")
    key_id = secret.split("_")[1]
    spend = _get(stack, "/v1/spend", secret)
    assert spend.status_code == 200
    assert {row["team"] for row in spend.json()} == {"search"}
    wait(driver, "#keys-list", key_id)
    row = driver.find_element(By.XPATH, f"//table[@id='keys-list']//tr[td[text()='{key_id}']]")
    assert "rag-service" in row.text
    assert "active" in row.text

    _fill(driver, "keys-id", key_id)
    _fill(driver, "keys-change-reason", "done with it")
    driver.find_element(By.ID, "keys-revoke").click()
    wait(driver, "#keys-secret", f"Revoked key {key_id}.")
    assert _get(stack, "/v1/spend", secret).status_code == 401
    driver.refresh()
    wait(driver, "#keys-list", key_id)
    assert "revoked" in driver.find_element(By.ID, "keys-list").text

    trail = _get(stack, "/v1/audit", id_token(stack.issuer, ADMIN)).json()
    events = trail["events"] if isinstance(trail, dict) else trail
    made = {(e["action"], e["actor"]) for e in events if e.get("target") == f"key:{key_id}"}
    assert made == {("key.created", LEAD), ("key.revoked", LEAD)}


def test_a_member_is_told_only_leads_manage_keys(stack: Stack) -> None:
    """A team member sees why the keys page lists nothing, and a click issues nothing."""
    driver = stack.driver
    sign_in_as(driver, stack.url, MEMBER)
    wait(driver, "#who", MEMBER)
    driver.get(stack.url + "/keys")
    wait(driver, "#keys-status", "Only the admin and team leads manage keys.")
    driver.find_element(By.ID, "keys-issue").click()
    assert "Refused:" in wait(driver, "#keys-secret", "Refused")
    assert driver.find_elements(By.ID, "keys-secret-value") == []
