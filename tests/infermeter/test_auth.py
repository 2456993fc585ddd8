"""Callers are identified by a team API key or by a team header signed by a trusted gateway."""

from __future__ import annotations

import hashlib

import pytest

from infermeter.auth import (
    ADMIN,
    INGEST,
    INGESTERS,
    MANAGERS,
    METRICS,
    SCRAPERS,
    AuthError,
    Caller,
    Forbidden,
    GatewayVerifier,
    KeyRing,
    Signed,
    Unauthenticated,
    bearer_key,
    identify,
    sign_request,
    string_to_sign,
)
from sidecar.seen_nonces import ReplayCache

KEYS = {"sk-search-1": "search", "sk-search-2": "search", "sk-research": "research"}
SECRET = b"gateway-secret"
NOW = 1_800_000_000
SKEW = 300
PATH = "/v1/chat/completions"
BODY = b'{"model":"chat-small"}'
NONCE = "nonce-0123456789abcdef"
MODEL = "chat-small"


def digest(key: str) -> str:
    """The SHA-256 hex digest of a key, as the configuration holds it."""
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def ring() -> KeyRing:
    """Two teams, one of them with two keys."""
    teams: dict[str, list[str]] = {}
    for key, team in KEYS.items():
        teams.setdefault(team, []).append(digest(key))
    return KeyRing(teams.items())


@pytest.fixture
def gateway() -> GatewayVerifier:
    """A verifier for the default gateway headers, knowing teams search and research."""
    return GatewayVerifier(
        secret=SECRET,
        team_header="x-infermeter-team",
        timestamp_header="x-infermeter-timestamp",
        signature_header="x-infermeter-signature",
        max_skew_seconds=SKEW,
        known_teams=frozenset(KEYS.values()),
        audience=MODEL,
    )


def signed(
    team: str,
    timestamp: int = NOW,
    secret: bytes = SECRET,
    nonce: str = NONCE,
    audience: str = MODEL,
) -> dict[str, str]:
    """The headers a gateway holding ``secret`` sends for ``team``'s POST of BODY to PATH of
    ``audience``'s sidecars."""
    signature = sign_request(
        secret,
        team=team,
        timestamp=timestamp,
        nonce=nonce,
        audience=audience,
        method="POST",
        path=PATH,
        body=BODY,
    )
    return {
        "x-infermeter-team": team,
        "x-infermeter-timestamp": str(timestamp),
        "x-infermeter-nonce": nonce,
        "x-infermeter-signature": signature,
    }


@pytest.mark.parametrize(("key", "team"), KEYS.items())
def test_key_maps_to_its_team(ring, key, team):
    """Each configured key identifies the team whose digest list holds it."""
    assert ring.team_for(key) == team


@pytest.mark.parametrize("key", ["sk-unknown", "", "SK-SEARCH-1", "sk-search-1 "])
def test_unknown_key_is_refused(ring, key):
    """A key with no matching digest is refused as an invalid API key."""
    with pytest.raises(AuthError, match=r"^Incorrect API key provided\.$") as caught:
        ring.team_for(key)
    assert caught.value.code == "invalid_api_key"


def test_every_key_of_a_thousand_configured_finds_its_own_team():
    """A large configuration is looked up by digest: each of 1,000 keys (upper- or lower-case
    hex in the file) names its own team, a near miss of one names none, and a ring given issued
    keys keeps every configured one."""
    keys = {f"sk-team-{i:04d}": f"team-{i:04d}" for i in range(1000)}
    teams = [
        (team, [digest(key).upper() if i % 2 else digest(key)])
        for i, (key, team) in enumerate(keys.items())
    ]
    big = KeyRing(teams)
    for ring_ in (big, big.with_issued(None)):
        assert all(ring_.team_for(key) == team for key, team in keys.items())
        for near in ("sk-team-0999x", "sk-team-1000", "sk-team-0500 ", "sk-team-05"):
            with pytest.raises(AuthError, match=r"^Incorrect API key provided\.$"):
                ring_.team_for(near)


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("Bearer sk-a", "sk-a"),
        ("bearer sk-a", "sk-a"),
        ("BEARER sk-a", "sk-a"),
        ("Bearer  sk-a ", "sk-a"),
    ],
)
def test_bearer_key_is_read_from_the_header(header, key):
    """The key is what follows the Bearer scheme, case-insensitively, without surrounding spaces."""
    assert bearer_key(header) == key


@pytest.mark.parametrize(
    ("header", "code", "message"),
    [
        (
            None,
            "missing_api_key",
            "You didn't provide an API key. Use 'Authorization: Bearer <key>'.",
        ),
        (
            "",
            "missing_api_key",
            "You didn't provide an API key. Use 'Authorization: Bearer <key>'.",
        ),
        ("Bearer", "invalid_api_key", "Malformed Authorization header; expected 'Bearer <key>'."),
        (
            "Bearer   ",
            "invalid_api_key",
            "Malformed Authorization header; expected 'Bearer <key>'.",
        ),
        (
            "Basic c2stYQ==",
            "invalid_api_key",
            "Malformed Authorization header; expected 'Bearer <key>'.",
        ),
        ("sk-a", "invalid_api_key", "Malformed Authorization header; expected 'Bearer <key>'."),
    ],
    ids=["absent", "empty", "no-key", "blank-key", "basic", "no-scheme"],
)
def test_missing_or_malformed_authorization_is_refused(header, code, message):
    """An absent header is a missing key; any other shape than ``Bearer <key>`` is malformed."""
    with pytest.raises(AuthError) as caught:
        bearer_key(header)
    assert (str(caught.value), caught.value.code) == (message, code)


@pytest.mark.parametrize(
    "header", ["Bearer sk-secret-value", "Token sk-secret-value", "sk-secret-value"]
)
def test_key_never_appears_in_an_error(ring, header):
    """Neither a malformed header nor an unknown key puts the presented key into the error."""
    with pytest.raises(AuthError) as caught:
        ring.team_for(bearer_key(header))
    assert "sk-secret-value" not in f"{caught.value} {caught.value.args!r}"


@pytest.mark.parametrize("now", [NOW, NOW - SKEW, NOW + SKEW], ids=["fresh", "oldest", "newest"])
def test_gateway_header_signed_within_the_window_is_accepted(gateway, now):
    """A correctly signed header is accepted up to ``max_skew_seconds`` either side of now."""
    assert gateway.verify(signed("search"), "POST", PATH, BODY, now=now) == Signed(
        "search", NONCE, NOW
    )


def test_gateway_signature_is_accepted_in_upper_case_hex(gateway):
    """Hex case does not matter in the signature."""
    headers = signed("search")
    headers["x-infermeter-signature"] = headers["x-infermeter-signature"].upper()
    assert gateway.verify(headers, "POST", PATH, BODY, now=NOW).team == "search"


def _without(name: str) -> dict[str, str]:
    return {k: v for k, v in signed("search").items() if k != f"x-infermeter-{name}"}


def _tampered_team() -> dict[str, str]:
    return {**signed("search"), "x-infermeter-team": "research"}


def _with(name: str, value: str) -> dict[str, str]:
    return {**signed("search"), f"x-infermeter-{name}": value}


@pytest.mark.parametrize(
    ("headers", "code", "message"),
    [
        (
            _without("team"),
            "missing_team_signature",
            "Missing signed team header from the trusted gateway.",
        ),
        (
            _without("timestamp"),
            "missing_team_signature",
            "Missing signed team header from the trusted gateway.",
        ),
        (
            _without("signature"),
            "missing_team_signature",
            "Missing signed team header from the trusted gateway.",
        ),
        (
            _without("nonce"),
            "missing_team_signature",
            "Missing signed team header from the trusted gateway.",
        ),
        (_with("timestamp", "9" * 400), "invalid_team_signature", "Malformed gateway timestamp."),
        (_with("nonce", "short"), "invalid_team_signature", "Malformed gateway nonce."),
        (_with("timestamp", "soon"), "invalid_team_signature", "Malformed gateway timestamp."),
        (signed("search", NOW - SKEW - 1), "invalid_team_signature", "Stale gateway signature."),
        (signed("search", NOW + SKEW + 1), "invalid_team_signature", "Stale gateway signature."),
        (
            signed("search", secret=b"not-the-secret"),
            "invalid_team_signature",
            "Invalid gateway signature.",
        ),
        (_tampered_team(), "invalid_team_signature", "Invalid gateway signature."),
        (
            signed("search", audience="chat-large"),
            "invalid_team_signature",
            "Invalid gateway signature.",
        ),
        (_with("signature", "é" * 64), "invalid_team_signature", "Invalid gateway signature."),
        (signed("marketing"), "invalid_team_signature", "Unknown team."),
    ],
    ids=[
        "no-team",
        "no-timestamp",
        "unsigned",
        "no-nonce",
        "400-digit-timestamp",
        "short-nonce",
        "bad-timestamp",
        "stale-past",
        "stale-future",
        "forged",
        "tampered-team",
        "other-model",
        "non-ascii-signature",
        "unknown-team",
    ],
)
def test_gateway_header_is_refused(gateway, headers, code, message):
    """Unsigned, stale, forged, tampered, other-model or unknown-team headers are refused with a
    specific error."""
    with pytest.raises(AuthError) as caught:
        gateway.verify(headers, "POST", PATH, BODY, now=NOW)
    assert (str(caught.value), caught.value.code) == (message, code)


def test_string_to_sign_is_the_documented_eight_lines():
    """The signed string is version, timestamp, nonce, team, audience, method, path and body
    digest, one a line."""
    assert string_to_sign(
        team="search",
        timestamp=NOW,
        nonce=NONCE,
        audience=MODEL,
        method="post",
        path=PATH,
        body=b"",
    ) == (
        b"infermeter-gateway-v3\n1800000000\nnonce-0123456789abcdef\nsearch\nchat-small\nPOST\n"
        b"/v1/chat/completions\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("GET", PATH, BODY), ("POST", "/v1/embeddings", BODY), ("POST", PATH, b"{}")],
    ids=["method", "path", "body"],
)
def test_gateway_signature_covers_method_path_and_body(gateway, method, path, body):
    """A signature made for one request does not verify another method, path or body."""
    with pytest.raises(AuthError, match="Invalid gateway signature"):
        gateway.verify(signed("search"), method, path, body, now=NOW)


def test_replay_cache_stays_bounded_and_refuses_what_it_forgot():
    """Past its size the cache forgets the oldest nonces and refuses anything stamped no later."""
    cache = ReplayCache(window_seconds=SKEW, max_entries=3)
    for i in range(5):
        assert cache.admit(f"n{i}", NOW + i, now=NOW + 5) is None
    assert len(cache) == 3
    assert cache.admit("n0", NOW, now=NOW + 5) == "stale"
    assert cache.admit("n4", NOW + 4, now=NOW + 5) == "replayed"


def test_replay_cache_refuses_a_nonce_older_than_its_own_window():
    """A timestamp past the memory's window is stale, whatever window the signature check had."""
    cache = ReplayCache(window_seconds=SKEW, max_entries=3)
    assert cache.admit("n0", NOW - SKEW - 1, now=NOW) == "stale"
    assert cache.admit("n1", NOW - SKEW, now=NOW) is None


def test_replay_cache_forgets_nonces_past_the_window():
    """A nonce older than the window is dropped, since the clock check refuses it anyway."""
    cache = ReplayCache(window_seconds=SKEW, max_entries=3)
    assert cache.admit("n0", NOW, now=NOW) is None
    assert cache.admit("n1", NOW + SKEW + 1, now=NOW + SKEW + 1) is None
    assert len(cache) == 1


@pytest.mark.parametrize(
    ("name", "allowed", "may"),
    [
        (ADMIN, MANAGERS, True),
        (METRICS, MANAGERS, False),
        ("search", MANAGERS, False),
        (ADMIN, SCRAPERS, True),
        (METRICS, SCRAPERS, True),
        (INGEST, SCRAPERS, False),
        ("search", SCRAPERS, False),
        (INGEST, INGESTERS, True),
        (ADMIN, INGESTERS, False),
    ],
)
def test_each_role_may_do_only_its_own_work(name, allowed, may):
    """The admin manages and scrapes, metrics scrapes, ingest ingests; a team does none of it."""
    if may:
        Caller(name).require(allowed)
    else:
        with pytest.raises(Forbidden):
            Caller(name).require(allowed)


@pytest.mark.parametrize(
    ("name", "reads"), [(ADMIN, True), ("search", True), (METRICS, False), (INGEST, False)]
)
def test_the_admin_and_teams_read_the_ledger_and_the_other_roles_do_not(name, reads):
    """require_reader lets the admin and any team through, and refuses metrics and ingest."""
    if reads:
        Caller(name).require_reader()
    else:
        with pytest.raises(Forbidden):
            Caller(name).require_reader()


def test_a_caller_is_a_team_or_a_role(ring):
    """A team key names its team; a missing or unknown key is Unauthenticated."""
    assert identify(ring, "Bearer sk-research") == Caller("research")
    assert Caller("research").team == "research"
    assert Caller(ADMIN).team is None
    with pytest.raises(Unauthenticated):
        identify(ring, None)
    with pytest.raises(Unauthenticated):
        identify(ring, "Bearer sk-nobody")
