"""Sign-in with OpenID Connect: two routes on the dashboard's Flask server, beside the key form.

``/auth/oidc/login`` sends the browser to the identity provider (IdP) with the authorization
code flow and PKCE (S256) and a nonce; ``/auth/oidc/callback`` trades the code for tokens and
checks the ID token (signature against the IdP's keys, issuer, audience, expiry, nonce): all of
that is authlib's Flask client, not ours. The person's groups are then mapped to a role
(``infermeter.oidc.caller_for_groups``); a person in no mapped group is refused.

A signed-in person gets a server-side ``Session`` holding their ID token, which the dashboard
presents to billing as the bearer on their behalf (billing checks it again, the same way): so
what a person reads is decided by billing from the IdP's word, and no shared service key can
read more than they may. The browser keeps only the session's id, in Flask's signed, HTTP-only,
SameSite=Lax cookie, which also carries the flow's state and PKCE verifier between the two
routes. The session ends at ``session_seconds`` after sign-in or at the ID token's expiry,
whichever comes first, and at sign-out. Every sign-in and refusal goes on the audit trail.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import flask
from authlib.common.errors import AuthlibBaseError
from authlib.integrations.flask_client import OAuth
from flask.typing import ResponseReturnValue
from joserfc.errors import JoseError
from requests import RequestException

from dashboards.sessions import Session, Sessions
from infermeter.auth import AuthError
from infermeter.config import OidcSettings
from infermeter.oidc import caller_for_groups, groups_of, person_of

__all__ = [
    "CALLBACK_PATH",
    "ERROR_KEY",
    "LOGIN_PATH",
    "SESSION_KEY",
    "end_sso",
    "install_oidc",
    "sso_session_id",
    "take_error",
]

LOGIN_PATH: Final = "/auth/oidc/login"
CALLBACK_PATH: Final = "/auth/oidc/callback"
# Keys of Flask's signed session cookie: the session's id, and why the last sign-in was refused.
SESSION_KEY: Final = "sso_session"
ERROR_KEY: Final = "sso_error"


def sso_session_id() -> str | None:
    """The id of the single sign-on session this request's cookie names, if any."""
    sid = flask.session.get(SESSION_KEY) if flask.has_request_context() else None
    return sid if isinstance(sid, str) else None


def take_error() -> str | None:
    """Why the last single sign-on was refused (once: reading it forgets it)."""
    if not flask.has_request_context() or ERROR_KEY not in flask.session:
        return None
    found = flask.session.pop(ERROR_KEY)
    return found if isinstance(found, str) else None


def install_oidc(
    server: flask.Flask,
    settings: OidcSettings,
    environ: Mapping[str, str],
    sessions: Sessions,
    heard: Callable[..., None],
    clock: Callable[[], float] = time.time,
) -> None:
    """Add the sign-in routes for ``settings``' IdP to ``server``.

    The client secret is ``environ[settings.client_secret_env]``; unset, the dashboard is a
    public client (PKCE alone protects the code, as for any browser-facing client).
    """
    # The flow's state lives only from the click to the callback: a key made per process is
    # enough (a restart in between asks the person to click again).
    server.secret_key = server.secret_key or secrets.token_bytes(32)
    # Secure when the dashboard is reached over https (its redirect URL says so): the cookie
    # names the sign-in under way, and sent on a plain-http request to the same host, anyone
    # watching the network could take it. Not set for http, where no browser would send it.
    secure = (settings.redirect_url or "").startswith("https://")
    server.config.update(
        SESSION_COOKIE_HTTPONLY=True, SESSION_COOKIE_SAMESITE="Lax", SESSION_COOKIE_SECURE=secure
    )
    secret = environ.get(settings.client_secret_env) or None
    oauth = OAuth(server)
    client: Any = oauth.register(
        "idp",
        client_id=settings.client_id,
        client_secret=secret,
        server_metadata_url=f"{settings.issuer.rstrip('/')}/.well-known/openid-configuration",
        client_kwargs={
            "scope": " ".join(settings.scopes),
            "code_challenge_method": "S256",
            "token_endpoint_auth_method": "client_secret_basic" if secret else "none",
            "timeout": 10,
        },
    )

    def refuse(why: str, message: str, actor: str = "unknown") -> ResponseReturnValue:
        address = flask.request.remote_addr or "unknown"
        heard(
            "signin.failed",
            actor,
            "",
            address=address,
            why=why,
            outcome="refused",
            detail={"with": "sso"},
        )
        flask.session.pop(SESSION_KEY, None)
        flask.session[ERROR_KEY] = f"Not signed in: {message}."
        return flask.redirect("/")

    @server.get(LOGIN_PATH)
    def oidc_login() -> ResponseReturnValue:
        redirect_uri = settings.redirect_url or flask.url_for("oidc_callback", _external=True)
        answer: ResponseReturnValue = client.authorize_redirect(redirect_uri)
        return answer

    @server.get(CALLBACK_PATH)
    def oidc_callback() -> ResponseReturnValue:
        if "error" in flask.request.args:
            return refuse(
                f"sso: {flask.request.args['error'][:80]}", "the sign-in was not completed"
            )
        try:
            token = client.authorize_access_token()
        except (AuthlibBaseError, JoseError, RequestException, ValueError) as exc:
            return refuse(
                f"sso: {type(exc).__name__}", "the identity provider's answer was refused"
            )
        claims: dict[str, Any] = dict(token.get("userinfo") or {})
        person = person_of(claims)
        try:
            caller = caller_for_groups(
                groups_of(claims, settings.groups_claim), settings.groups, person
            )
        except AuthError as exc:
            return refuse(str(exc), str(exc), person)
        now = clock()
        expires = min(now + settings.session_seconds, float(claims.get("exp") or now))
        session = Session(
            str(token["id_token"]),
            caller.name,
            caller.team,
            caller.is_admin,
            person=person,
            expires_at=expires,
        )
        old = flask.session.pop(SESSION_KEY, None)
        if isinstance(old, str):
            sessions.end(old)
        flask.session[SESSION_KEY] = sessions.begin(session)
        heard(
            "signin.succeeded",
            person,
            caller.role,
            address=flask.request.remote_addr or "unknown",
            detail={"with": "sso"},
        )
        return flask.redirect("/")


def end_sso(sessions: Sessions, heard: Callable[..., None], address: str) -> None:
    """Sign-out: end the single sign-on session this request's cookie names, and forget its id."""
    sid = sso_session_id()
    if sid is None:
        return
    ended = sessions.get(sid)
    sessions.end(sid)
    flask.session.pop(SESSION_KEY, None)
    if ended is not None:
        heard("signout", ended.person or ended.name, "", address=address, detail={"with": "sso"})
