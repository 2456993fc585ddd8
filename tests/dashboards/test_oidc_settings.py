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

    @server.route("/begin")
    def begin() -> str:  # as the sign-in route does: the flow's state in the session
        flask.session["state"] = "x"
        return ""

    cookie = server.test_client().get("/begin").headers["Set-Cookie"]
    flags = {part.strip().split("=")[0].lower() for part in cookie.split(";")[1:]}
    assert ("secure" in flags) is secure
    assert {"httponly", "samesite"} <= flags
    assert "SameSite=Lax" in cookie
