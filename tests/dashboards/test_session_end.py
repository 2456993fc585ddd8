"""A dashboard session ends with its key or ID token, and the audit trail says so, once.

Billing runs with single sign-on through an identity provider served over loopback (a key made
in the test signs the ID tokens); the dashboard runs under its production server and its
callbacks are posted as the browser posts them. A single sign-on session is put in the
dashboard's session store as the sign-in route puts it (the provider's sign-in page itself is
``tests/dashboards/test_oidc.py``'s), holding an ID token billing takes, refuses, or cannot
check while the provider's keys cannot be read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dashboards.app import create_app
from dashboards.headers import installed_headers
from dashboards.sessions import Session, Sessions
from dashboards.wsgi import WsgiServer
from infermeter.auth import ADMIN as ADMIN_NAME
from infermeter.config import OidcSettings
from infermeter.oidc import RETRY_SECONDS
from infermeter.serving import free_port
from tests.billing.test_oidc_unavailable import IMPOSTOR, Provider, provider, token
from tests.dashboards import records
from tests.dashboards.stack import billing_thread, dashboard_config, wsgi_thread
from tests.security.test_dashboard_security import (
    ADMIN,
    SIGNED_OUT,
    issue,
    sign_in,
    summary,
    tick,
)

PERSON = "ana@example.com"
Heard = list[tuple[str, str, dict[str, Any]]]


@dataclass
class Stack:
    idp: Provider
    billing: str
    url: str
    sessions: Sessions
    heard: Heard

    def signouts(self) -> list[tuple[str, str, dict[str, Any]]]:
        return [h for h in self.heard if h[0] == "signout"]

    def sso(self, bearer: str, expires_in: float = 600.0) -> dict[str, str]:
        """A single sign-on session holding ``bearer``, as the sign-in route begins one; the
        ``auth`` store naming it."""
        session = Session(
            bearer, ADMIN_NAME, None, True, person=PERSON, expires_at=time.time() + expires_in
        )
        return {"session": self.sessions.begin(session)}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """A provider, billing signing people in through it (group ``ops`` the admin), and the
    dashboard, its audit trail kept in ``heard``."""
    with contextlib.ExitStack() as stack:
        idp = stack.enter_context(provider())
        oidc = OidcSettings(issuer=idp.url, client_id="dash", groups={"ops": "admin"})
        config = dashboard_config(oidc=oidc)
        ledger = records.open_ledger(
            config, tmp_path / "ledger.duckdb", records.build(records.recent_start())
        )
        stack.callback(ledger.close)
        billing = stack.enter_context(billing_thread(config, ledger))
        sessions = Sessions()
        heard: Heard = []

        def record(action: str, actor: str, _role: str, **fields: Any) -> None:
            heard.append((action, actor, fields))

        app = create_app(config, billing, sessions=sessions, audit=record, environ={}).server
        port = free_port()
        server = WsgiServer(app, "127.0.0.1", port, error_headers=installed_headers(app))
        url = stack.enter_context(wsgi_thread(server, port))
        yield Stack(idp, billing, url, sessions, heard)


def test_a_single_sign_on_session_billing_refuses_ends_and_is_told_why(stack: Stack) -> None:
    """Billing's 401 to an ID token's read ends the session signed in with it (before, only a
    key's sessions ended: this one lived on, every refresh showing billing's refusal); the next
    refresh tells the tab why in single sign-on's words. Another person's session, holding a
    token billing takes, reads on."""
    refused = stack.sso(token(stack.idp, IMPOSTOR))
    other = stack.sso(token(stack.idp))
    assert "Figures unavailable" in str(summary(stack.url, refused)["summary"]["children"])
    assert summary(stack.url, refused) == SIGNED_OUT
    told = tick(stack.url, refused)
    assert told["auth"] == {"data": None, "clear_data": True}
    assert told["login-error"]["children"] == (
        "Signed out: billing no longer accepts your single sign-on (it refused the identity "
        "provider's token). Sign in again."
    )
    assert tick(stack.url, refused) == {}
    assert summary(stack.url, other)["money"]["data"] is not None
    assert stack.signouts() == [("signout", PERSON, {"why": "revoked", "detail": {"with": "sso"}})]


def test_a_503_while_the_providers_keys_cannot_be_read_ends_nothing(stack: Stack) -> None:
    """While billing cannot read the provider's keys it answers 503: the session stays (the
    refresh says the figures are unavailable, the tab is not signed out, no sign-out is
    audited), and reads again once the provider answers."""
    auth = stack.sso(token(stack.idp))
    stack.idp.answers["/jwks"] = (500, b"")
    for _ in range(2):
        down = summary(stack.url, auth)
        assert down["money"]["data"] is None
        assert "identity provider" in str(down["summary"]["children"])
        assert tick(stack.url, auth) == {}
    stack.idp.publish()
    time.sleep(RETRY_SECONDS)  # (billing does not ask the provider again sooner)
    assert summary(stack.url, auth)["money"]["data"] is not None
    assert stack.signouts() == []


def test_a_revoked_keys_session_is_audited_as_a_sign_out_once(stack: Stack) -> None:
    """A key billing revokes: its two sessions end on the first 401, and the audit trail has one
    sign-out for each, why "revoked", however many reads billing refused (before, none)."""
    key_id, key = issue(stack.billing, "cy")
    first = sign_in(stack.url, key)["auth"]["data"]
    second = sign_in(stack.url, key)["auth"]["data"]
    revoked = httpx.post(
        f"{stack.billing}/v1/keys/{key_id}/revoke", json={"reason": "left"}, headers=ADMIN
    )
    assert revoked.status_code == 200, revoked.text
    assert summary(stack.url, first)["money"]["data"] is None
    for auth in (first, second, first):
        assert summary(stack.url, auth) == SIGNED_OUT
        tick(stack.url, auth)
    signouts = stack.signouts()
    assert len(signouts) == 2
    assert {s[0] for s in signouts} == {"signout"}
    assert {s[2]["why"] for s in signouts} == {"revoked"}
    assert {s[2]["detail"]["with"] for s in signouts} == {"key"}


def test_expired_sessions_are_audited_as_sign_outs_once(stack: Stack) -> None:
    """A key issued for 3 s and a single sign-on session of 2 s: each session ends at its
    expiry, and the audit trail has one sign-out for each, why "expired" (before, none); the
    single sign-on tab is told in its own words."""
    key = issue(stack.billing, "ed", expires_in_seconds=3)[1]
    keyed = sign_in(stack.url, key)["auth"]["data"]
    person = stack.sso(token(stack.idp), expires_in=2.0)
    time.sleep(3.2)
    assert summary(stack.url, keyed) == SIGNED_OUT
    assert summary(stack.url, person) == SIGNED_OUT
    assert tick(stack.url, keyed)["login-error"]["children"] == (
        "Signed out: the key you signed in with has expired. Sign in with a key in force."
    )
    assert tick(stack.url, person)["login-error"]["children"] == (
        "Signed out: your single sign-on session has ended. Sign in again."
    )
    for auth in (keyed, person):
        assert tick(stack.url, auth) == {}
        assert summary(stack.url, auth) == SIGNED_OUT
    assert sorted((s[1] != PERSON, s[2]["why"], s[2]["detail"]) for s in stack.signouts()) == [
        (False, "expired", {"with": "sso"}),
        (True, "expired", {"with": "key"}),
    ]
