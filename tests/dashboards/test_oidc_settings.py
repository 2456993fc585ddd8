"""How the single sign-on routes set the cookie that carries a sign-in under way."""

from __future__ import annotations

import flask
import pytest

from dashboards.oidc import install_oidc
from dashboards.sessions import Sessions
from infermeter.config import OidcSettings


@pytest.mark.parametrize(
    ("redirect", "secure"),
    [
        ("https://dash.example.com/oidc/callback", True),
        ("http://127.0.0.1:8050/oidc/callback", False),
        (None, False),
    ],
)
def test_the_sign_in_cookie_is_secure_when_the_dashboard_is_reached_over_https(redirect, secure):
    """Over https the cookie is Secure (never sent on a plain-http request, where anyone
    watching the network could take the sign-in); HttpOnly and SameSite=Lax always."""
    server = flask.Flask("dashboard")
    settings = OidcSettings(
        issuer="https://idp.example.com",
        client_id="infermeter",
        redirect_url=redirect,
        groups={"platform": "admin"},
    )
    install_oidc(server, settings, {}, Sessions(), lambda *a, **k: None)
    assert server.config["SESSION_COOKIE_SECURE"] is secure
    assert server.config["SESSION_COOKIE_HTTPONLY"] is True
    assert server.config["SESSION_COOKIE_SAMESITE"] == "Lax"
