"""A configuration reload changes which role a person's group gives on billing's read routes.

An identity provider's discovery document and keys are served over loopback (a key made in the
test signs the ID tokens); billing runs under uvicorn and is reconfigured as a reload does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

from billing.api import create_app
from billing.reload import reconfigure
from infermeter.config import Config, DashboardSettings, OidcSettings, load_config
from infermeter.serving import free_port, server as serve
from tests.conftest import config_ledger
from tests.dashboards.stack import server_thread
from tests.http_stub import Answer, serving

KEY = RSAKey.generate_key(2048, parameters={"kid": "k1"}, private=True)


@contextlib.contextmanager
def issuer() -> Iterator[str]:
    """An IdP's discovery document and public keys on a loopback port; yields its issuer URL."""
    documents: dict[str, bytes] = {}

    def answer(path: str) -> Answer:
        body = documents.get(path)
        return 200 if body else 404, body or b"", "application/json"

    with serving(answer, "idp") as url:
        documents["/.well-known/openid-configuration"] = json.dumps(
            {"issuer": url, "jwks_uri": f"{url}/jwks"}
        ).encode()
        documents["/jwks"] = json.dumps(KeySet([KEY]).as_dict(private=False)).encode()
        yield url


def with_groups(config: Config, url: str, groups: dict[str, str]) -> Config:
    oidc = OidcSettings(issuer=url, client_id="dash", groups=groups)
    return config.model_copy(update={"dashboard": DashboardSettings(oidc=oidc)})


def test_a_reload_maps_groups_anew(tmp_path: Path) -> None:
    """A group that gave a viewer gives the admin once the reloaded file says so, at once."""
    base = load_config(None, environ={})
    with issuer() as url:
        config = with_groups(base, url, {"ops": "viewer"})
        ledger = config_ledger(config, tmp_path / "ledger.duckdb")
        try:
            app = create_app(config, ledger)
            port = free_port()
            with server_thread(serve(app, "127.0.0.1", port, lifespan="off"), "billing"):
                token = jwt.encode(
                    {"alg": "RS256", "kid": "k1"},
                    {
                        "iss": url,
                        "aud": "dash",
                        "sub": "ana",
                        "groups": ["ops"],
                        "exp": 4_000_000_000,
                    },
                    KEY,
                )
                headers = {"authorization": f"Bearer {token}"}
                audit = f"http://127.0.0.1:{port}/v1/audit"
                assert httpx.get(audit, headers=headers).status_code == 403
                reconfigure(app, with_groups(base, url, {"ops": "admin"}))
                assert httpx.get(audit, headers=headers).status_code == 200
                reconfigure(app, base)  # single sign-on switched off: the token is no key
                assert httpx.get(audit, headers=headers).status_code == 401
        finally:
            ledger.close()
