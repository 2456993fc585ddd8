"""An ID token billing cannot check because the identity provider's keys cannot be read is a 503.

An identity provider's discovery document and keys are served over loopback (a key made in the
test signs the ID tokens), and made to fail the ways a provider does: an error status, an
answer that is no key set, a keys address nothing listens on. Billing runs under uvicorn. While
the keys cannot be read, nothing is known of a token, so billing answers 503 (retry later), not
401 (the token refused), which its clients take for a revoked credential; a token that is
really wrong stays 401 once the keys are in hand.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

from billing.api import create_app
from billing.routes.errors import IDP_RETRY_SECONDS
from infermeter.config import DashboardSettings, OidcSettings, load_config
from infermeter.oidc import RETRY_SECONDS
from infermeter.serving import free_port, server as serve
from tests.conftest import config_ledger
from tests.dashboards.records import ADMIN_KEY
from tests.dashboards.stack import server_thread
from tests.http_stub import Answer, serving

KEY = RSAKey.generate_key(2048, parameters={"kid": "k1"}, private=True)
# Another key under the same id: its signature does not verify with the published one.
IMPOSTOR = RSAKey.generate_key(2048, parameters={"kid": "k1"}, private=True)
UNPUBLISHED = RSAKey.generate_key(2048, parameters={"kid": "k9"}, private=True)
DISCOVERY = "/.well-known/openid-configuration"


class Provider:
    """What the loopback IdP answers for each path: a status and a body."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, bytes]] = {}
        self.url = ""
        # The paths asked for, in order.
        self.asked: list[str] = []
        # Seconds each answer takes (a provider that hangs).
        self.delay = 0.0

    def publish(self, jwks_uri: str | None = None) -> None:
        """Answer as a working provider does (keys at ``jwks_uri``, default its own)."""
        meta = {"issuer": self.url, "jwks_uri": jwks_uri or f"{self.url}/jwks"}
        self.answers[DISCOVERY] = (200, json.dumps(meta).encode())
        self.answers["/jwks"] = (200, json.dumps(KeySet([KEY]).as_dict(private=False)).encode())


@contextlib.contextmanager
def provider() -> Iterator[Provider]:
    """The IdP on a loopback port, publishing its keys until told otherwise."""
    idp = Provider()

    def answer(path: str) -> Answer:
        idp.asked.append(path)
        time.sleep(idp.delay)
        status, body = idp.answers.get(path, (404, b""))
        return status, body, "application/json"

    with serving(answer, "idp") as url:
        idp.url = url
        idp.publish()
        yield idp


@contextlib.contextmanager
def billing(tmp_path: Path, idp: Provider) -> Iterator[str]:
    """Billing with single sign-on through ``idp`` (group ``ops`` the admin); yields its URL."""
    base = load_config(None, environ={})
    oidc = OidcSettings(issuer=idp.url, client_id="dash", groups={"ops": "admin"})
    config = base.model_copy(update={"dashboard": DashboardSettings(oidc=oidc)})
    ledger = config_ledger(config, tmp_path / "ledger.duckdb")
    try:
        port = free_port()
        app = create_app(config, ledger)
        with server_thread(serve(app, "127.0.0.1", port, lifespan="off"), "billing"):
            yield f"http://127.0.0.1:{port}"
    finally:
        ledger.close()


def token(idp: Provider, key: RSAKey = KEY, **changes: Any) -> str:
    """An ID token of ``idp`` for the dashboard's client, signed with ``key``."""
    claims = {
        "iss": idp.url,
        "aud": "dash",
        "sub": "ana",
        "email": "ana@example.com",
        "groups": ["ops"],
        "exp": int(time.time()) + 600,
    } | changes
    return jwt.encode({"alg": "RS256", "kid": key.kid}, claims, key)


def read(url: str, bearer: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/query", headers={"authorization": f"Bearer {bearer}"}, timeout=30)


def assert_unavailable(answer: httpx.Response) -> None:
    """A 503 in the OpenAI error shape, with Retry-After: ask again, the token is not refused."""
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == str(IDP_RETRY_SECONDS)
    error = answer.json()["error"]
    assert error["type"] == "server_error"
    assert error["code"] == "idp_unavailable"
    assert "identity provider's keys cannot be read" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


FAILURES = {
    "keys answer 500": lambda idp: idp.answers.update({"/jwks": (500, b"oops")}),
    "keys answer 503": lambda idp: idp.answers.update({"/jwks": (503, b"")}),
    "keys are not JSON": lambda idp: idp.answers.update({"/jwks": (200, b"<html>down</html>")}),
    "keys are no key set": lambda idp: idp.answers.update({"/jwks": (200, b'{"keys": "x"}')}),
    "keys are a list": lambda idp: idp.answers.update({"/jwks": (200, b"[]")}),
    "discovery answers 502": lambda idp: idp.answers.update({DISCOVERY: (502, b"")}),
    "discovery names no keys": lambda idp: idp.answers.update({DISCOVERY: (200, b"{}")}),
    "keys unreachable": lambda idp: idp.publish(f"http://127.0.0.1:{free_port()}/jwks"),
}


@pytest.mark.parametrize("fail", FAILURES.values(), ids=FAILURES.keys())
def test_a_token_is_503_while_the_providers_keys_cannot_be_read(tmp_path: Path, fail: Any) -> None:
    """Each way the keys cannot be read is a 503 with Retry-After for a good token, not the 401
    of a refused one (before, a 401: the dashboard could not tell an outage from a token
    refused); once the provider answers, the same token reads."""
    with provider() as idp, billing(tmp_path, idp) as url:
        good = token(idp)
        fail(idp)
        assert_unavailable(read(url, good))
        asked = len(idp.asked)
        assert_unavailable(read(url, good))  # at once: the provider is not asked again so soon
        assert len(idp.asked) == asked
        idp.publish()
        time.sleep(RETRY_SECONDS)
        answer = read(url, good)
        assert answer.status_code == 200, answer.text
        assert answer.json()["caller"]["is_admin"] is True


def test_a_wrong_token_stays_401_with_the_keys_in_hand(tmp_path: Path) -> None:
    """With the keys read, a token signed by another key, expired, for another client or
    issuer, or naming a key the provider does not publish (after reading the keys again) is
    refused with 401, even once the provider has gone down: the keys held are enough to tell."""
    with provider() as idp, billing(tmp_path, idp) as url:
        assert read(url, token(idp)).status_code == 200
        wrong = {
            "another key": token(idp, IMPOSTOR),
            "expired": token(idp, exp=int(time.time()) - 3600),
            "another client": token(idp, aud="other"),
            "another issuer": token(idp, iss="http://127.0.0.1:1"),
            "a key not published": token(idp, UNPUBLISHED),
        }
        for why, bearer in wrong.items():
            answer = read(url, bearer)
            assert answer.status_code == 401, (why, answer.text)
            assert answer.json()["error"]["code"] == "invalid_api_key", why
        idp.answers.update({"/jwks": (500, b""), DISCOVERY: (500, b"")})
        assert read(url, token(idp)).status_code == 200  # the keys held still check
        assert read(url, wrong["another key"]).status_code == 401


def test_a_burst_of_tokens_while_the_provider_hangs_holds_up_no_key(tmp_path: Path) -> None:
    """50 ID tokens at once while the provider takes 6 s to answer (past billing's 5 s read):
    a read with an API key meanwhile is answered at once, and every token within seconds. Before,
    each token waited its turn at the lock for its own 5 s read, filling the threads billing's
    routes run on: the key's read took 106 s, the last token's about as long."""
    with provider() as idp, billing(tmp_path, idp) as url:
        good = token(idp)
        idp.delay = 6.0
        answers: list[int] = []

        def ask() -> None:
            answers.append(read(url, good).status_code)

        burst = [threading.Thread(target=ask) for _ in range(50)]
        began = time.monotonic()
        for thread in burst:
            thread.start()
        time.sleep(1.0)
        keyed = httpx.get(
            f"{url}/v1/query", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=300
        )
        assert keyed.status_code == 200, keyed.text
        assert time.monotonic() - began < 4.0
        for thread in burst:
            thread.join(60)
        assert answers == [503] * 50
        assert time.monotonic() - began < 15.0
