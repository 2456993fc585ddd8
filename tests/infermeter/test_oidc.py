"""Single sign-on's pure parts: groups to a caller, and the configuration's checks with their messages."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet, OctKey, OKPKey, RSAKey

from infermeter.auth import ADMIN, FINANCE, VIEWER, AuthError, Caller
from infermeter.config import DEFAULT_CONFIG, ConfigError, OidcSettings, load_config
from infermeter.oidc import (
    JWKS_REFRESH_SECONDS,
    RETRY_SECONDS,
    WAIT_SECONDS,
    IdTokens,
    KeysUnavailable,
    Unmapped,
    caller_for_groups,
    groups_of,
    looks_like_jwt,
    person_of,
)

MAPPING = {
    "ops": "admin",
    "money": "finance",
    "auditors": "viewer",
    "search-leads": "lead:search",
    "search": "member:search",
    "analytics": "member:analytics",
}


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        (["ops"], Caller(ADMIN, person="p")),
        (["money"], Caller(FINANCE, person="p")),
        (["auditors", "search"], Caller(VIEWER, person="p")),
        (["search"], Caller("search", person="p")),
        (["search", "search-leads", "unrelated"], Caller("search", lead=True, person="p")),
        (["search", "ops"], Caller(ADMIN, person="p")),
    ],
)
def test_groups_map_to_the_strongest_role(groups: list[str], expected: Caller) -> None:
    """A person gets the strongest role their mapped groups give; unmapped groups add nothing."""
    assert caller_for_groups(groups, MAPPING, "p") == expected


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([], r"none of your groups \(none\) is given a role here"),
        (["marketing"], r"none of your groups \(marketing\) is given a role here"),
        (["search", "analytics"], r"more than one team \(analytics, search\)"),
    ],
)
def test_groups_that_give_no_single_role_are_refused(groups: list[str], message: str) -> None:
    """No mapped group, or groups naming two teams, is a refusal that says which."""
    with pytest.raises(Unmapped, match=message):
        caller_for_groups(groups, MAPPING, "p")


def test_claims_read_as_idps_send_them() -> None:
    """Groups may be a list or one string; the person is the e-mail, else user name, else subject."""
    assert groups_of({"groups": ["a", 3, "b"]}, "groups") == ["a", "b"]
    assert groups_of({"roles": "a"}, "roles") == ["a"]
    assert groups_of({}, "groups") == []
    assert person_of({"sub": "s1", "preferred_username": "ana"}) == "ana"
    assert person_of({"sub": "s1", "email": "ana@example.com"}) == "ana@example.com"
    assert person_of({"sub": "s1"}) == "s1"


def test_a_jwt_is_told_from_an_api_key() -> None:
    """Only a three-part token starting like a JSON header is taken for an ID token."""
    assert looks_like_jwt("eyJhbGciOi.eyJzdWIi.c2ln")
    assert not looks_like_jwt("imk_k3x9q2m1a8zt_secret")
    assert not looks_like_jwt("im-demo-admin")


def _config_error(tmp_path: Path, oidc: dict[str, Any]) -> str:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data.setdefault("dashboard", {})["oidc"] = oidc
    path = tmp_path / "infermeter.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    return str(info.value)


def test_a_group_mapped_to_an_unknown_team_names_the_file_key_and_value(tmp_path: Path) -> None:
    """A mapping to a team the configuration lacks is refused naming the group and the role."""
    message = _config_error(
        tmp_path,
        {"issuer": "https://idp.example", "client_id": "c", "groups": {"g": "member:nobody"}},
    )
    assert "infermeter.yaml" in message
    assert "dashboard.oidc.groups['g'] = 'member:nobody': no such team" in message


def test_a_group_mapped_to_no_role_is_refused(tmp_path: Path) -> None:
    """A role other than admin, finance, viewer, lead:<team>, member:<team> is refused at its key."""
    message = _config_error(
        tmp_path, {"issuer": "https://idp.example", "client_id": "c", "groups": {"g": "root"}}
    )
    assert "dashboard.oidc.groups.g = 'root'" in message
    assert "must be admin, finance, viewer, lead:<team> or member:<team>" in message


def test_scopes_without_openid_are_refused(tmp_path: Path) -> None:
    """Without the openid scope there is no ID token to check: refused, naming the scopes."""
    message = _config_error(
        tmp_path, {"issuer": "https://idp.example", "client_id": "c", "scopes": ["email"]}
    )
    assert "must include 'openid'" in message


def test_single_sign_on_is_off_by_default() -> None:
    """The embedded configuration signs in with keys only."""
    assert load_config(DEFAULT_CONFIG, environ={}).dashboard.oidc is None


ISSUER = "https://idp.example"
KEY = RSAKey.generate_key(2048, parameters={"kid": "k1"}, private=True)
OTHER = RSAKey.generate_key(2048, parameters={"kid": "k1"}, private=True)
NOW = 1_800_000_000


def _published(url: str) -> dict[str, Any]:
    """The IdP's discovery document and public keys, as ``IdTokens`` fetches them."""
    if url == f"{ISSUER}/.well-known/openid-configuration":
        return {"issuer": ISSUER, "jwks_uri": f"{ISSUER}/jwks"}
    assert url == f"{ISSUER}/jwks"
    return dict(KeySet([KEY]).as_dict(private=False))


def _tokens() -> IdTokens:
    settings = OidcSettings(issuer=ISSUER, client_id="dash", groups={"ops": "admin"})
    return IdTokens(settings, fetch=_published, clock=lambda: NOW)


def _signed(key: RSAKey = KEY, alg: str = "RS256", **changes: Any) -> str:
    claims = {
        "iss": ISSUER,
        "aud": "dash",
        "sub": "s1",
        "email": "ana@example.com",
        "groups": ["ops"],
        "iat": NOW,
        "exp": NOW + 300,
    } | changes
    return jwt.encode({"alg": alg, "kid": "k1"}, claims, key)


def test_an_id_token_of_the_issuer_makes_the_caller() -> None:
    """A token signed by the issuer's key, for this client, in date, is its person's mapped role."""
    assert _tokens().caller(_signed()) == Caller(ADMIN, person="ana@example.com")


@pytest.mark.parametrize(
    ("token", "why"),
    [
        (lambda: _signed(key=OTHER), "bad_signature"),
        (lambda: _signed(aud="another-client"), "Invalid claim: 'aud'"),
        (lambda: _signed(iss="https://evil.example"), "Invalid claim: 'iss'"),
        (lambda: _signed(exp=NOW - 120), "expired"),
    ],
    ids=["signed by another key", "for another client", "another issuer", "expired"],
)
def test_an_id_token_not_of_the_issuer_for_this_client_in_date_is_refused(
    token: Callable[[], str], why: str
) -> None:
    """Each broken property is an AuthError that says the ID token was refused, and why."""
    with pytest.raises(AuthError, match="ID token refused") as info:
        _tokens().caller(token())
    assert why in str(info.value)


def test_an_hmac_token_keyed_with_public_material_is_refused() -> None:
    """An HS256 token is refused whatever its key: only the issuer's asymmetric keys sign."""
    forged = jwt.encode(
        {"alg": "HS256", "kid": "k1"},
        {"iss": ISSUER, "aud": "dash", "sub": "x", "exp": NOW + 60, "groups": ["ops"]},
        OctKey.generate_key(256),
    )
    with pytest.raises(AuthError, match="ID token refused"):
        _tokens().caller(forged)


def test_a_token_signed_by_a_new_key_reads_the_keys_again() -> None:
    """After the IdP rotates its signing key, a token naming the new key id is checked with it."""
    rotated = RSAKey.generate_key(2048, parameters={"kid": "k2"}, private=True)
    published: list[OctKey | RSAKey | ECKey | OKPKey] = [KEY]
    asked: list[str] = []
    now = [float(NOW)]

    def fetch(url: str) -> dict[str, Any]:
        asked.append(url)
        if url.endswith("/jwks"):
            return dict(KeySet(published).as_dict(private=False))
        return _published(url)

    settings = OidcSettings(issuer=ISSUER, client_id="dash", groups={"ops": "admin"})
    tokens = IdTokens(settings, fetch=fetch, clock=lambda: now[0])
    assert tokens.caller(_signed()).name == ADMIN
    published.append(rotated)
    claims = {"iss": ISSUER, "aud": "dash", "sub": "s1", "groups": ["ops"], "exp": NOW + 600}
    fresh = jwt.encode({"alg": "RS256", "kid": "k2"}, claims, rotated)
    # A burst of tokens naming unknown keys reads the keys at most every JWKS_REFRESH_SECONDS.
    with pytest.raises(AuthError, match="No key for kid"):
        tokens.caller(fresh)
    now[0] += JWKS_REFRESH_SECONDS
    assert tokens.caller(fresh).name == ADMIN
    assert sum(url.endswith("/jwks") for url in asked) == 2


def test_after_a_failed_read_the_keys_are_not_tried_again_for_a_while() -> None:
    """A provider that does not answer is asked once per ``RETRY_SECONDS``, not once per token:
    the tokens that come meanwhile are KeysUnavailable at once, so a burst of them (anyone can
    send one) does not queue each behind its own read of an unanswering provider."""
    reads: list[str] = []
    now = [float(NOW)]

    def fetch(url: str) -> dict[str, Any]:
        reads.append(url)
        raise httpx.ReadTimeout("timed out")

    settings = OidcSettings(issuer=ISSUER, client_id="dash", groups={"ops": "admin"})
    tokens = IdTokens(settings, fetch=fetch, clock=lambda: now[0])
    for _ in range(50):
        with pytest.raises(KeysUnavailable, match="keys cannot be read"):
            tokens.caller(_signed())
    assert len(reads) == 1
    now[0] += RETRY_SECONDS
    with pytest.raises(KeysUnavailable):
        tokens.caller(_signed())
    assert len(reads) == 2


def test_a_read_under_way_holds_up_no_token_the_held_keys_check() -> None:
    """A token naming a new key has the keys read again, and the provider hangs: meanwhile a
    token the held keys check passes at once, and another that needs the keys read waits at most
    ``WAIT_SECONDS`` for the read under way before it is KeysUnavailable."""
    rotated = RSAKey.generate_key(2048, parameters={"kid": "k2"}, private=True)
    hang, entered, released = threading.Event(), threading.Event(), threading.Event()
    now = [float(NOW)]

    def fetch(url: str) -> dict[str, Any]:
        if hang.is_set():
            entered.set()
            released.wait(30)
            raise httpx.ReadTimeout("timed out")
        return _published(url)

    settings = OidcSettings(issuer=ISSUER, client_id="dash", groups={"ops": "admin"})
    tokens = IdTokens(settings, fetch=fetch, clock=lambda: now[0])
    assert tokens.caller(_signed()).name == ADMIN  # the keys are read and held
    now[0] += JWKS_REFRESH_SECONDS
    claims = {"iss": ISSUER, "aud": "dash", "sub": "s1", "groups": ["ops"], "exp": NOW + 600}
    fresh = jwt.encode({"alg": "RS256", "kid": "k2"}, claims, rotated)
    hang.set()
    outcome: list[BaseException] = []

    def read_again() -> None:
        try:
            tokens.caller(fresh)
        except KeysUnavailable as exc:
            outcome.append(exc)

    reading = threading.Thread(target=read_again)
    reading.start()
    try:
        assert entered.wait(10)
        began = time.monotonic()
        assert tokens.caller(_signed()).name == ADMIN
        assert time.monotonic() - began < 0.5
        began = time.monotonic()
        with pytest.raises(KeysUnavailable, match="another read"):
            tokens.caller(fresh)
        assert WAIT_SECONDS <= time.monotonic() - began < WAIT_SECONDS + 1.0
    finally:
        released.set()
        reading.join(35)
    assert len(outcome) == 1  # the hung read's own token, unjudged


def test_keys_that_cannot_be_read_leave_a_token_unjudged() -> None:
    """A provider that times out is KeysUnavailable, not the AuthError of a refused token (which
    billing answers 401, and its clients take for a revoked credential); the next token reads
    the keys again. Once held, the keys stay held when a token naming a new key cannot have the
    keys read again: that token is unjudged, and one the held keys check still passes."""
    rotated = RSAKey.generate_key(2048, parameters={"kid": "k2"}, private=True)
    down = [True]
    now = [float(NOW)]

    def fetch(url: str) -> dict[str, Any]:
        if down[0]:
            raise httpx.ReadTimeout("timed out")
        return _published(url)

    settings = OidcSettings(issuer=ISSUER, client_id="dash", groups={"ops": "admin"})
    tokens = IdTokens(settings, fetch=fetch, clock=lambda: now[0])
    with pytest.raises(KeysUnavailable, match="keys cannot be read"):
        tokens.caller(_signed())
    down[0] = False
    now[0] += RETRY_SECONDS
    assert tokens.caller(_signed()).name == ADMIN
    down[0] = True
    now[0] += JWKS_REFRESH_SECONDS
    claims = {"iss": ISSUER, "aud": "dash", "sub": "s1", "groups": ["ops"], "exp": NOW + 600}
    fresh = jwt.encode({"alg": "RS256", "kid": "k2"}, claims, rotated)
    with pytest.raises(KeysUnavailable):
        tokens.caller(fresh)
    assert tokens.caller(_signed()).name == ADMIN
    with pytest.raises(AuthError, match="bad_signature"):
        tokens.caller(_signed(key=OTHER))
