"""Who is calling, and what it may do: a team API key, a role's credential, or a signed team header.

Keys are only ever held as SHA-256 digests. A configured key's digest is looked up by value: the
lookup hashes the digest again (with the process's secret hash key) and compares only the entry
that hash selects, so its timing depends on a digest no caller can choose or see, never on how
near the key came to a team's, and it is the same for 4 configured keys or 1,000. Wherever a
presented secret is checked against one expected value (an issued key's digest, a signature) the
comparison is ``hmac.compare_digest``.

One role model for every service (the sidecar's admin routes, billing's API, the dashboard). A
caller is a team (a member of it, or its lead) or one of the roles, named with a leading ``@``,
which no team name can have, so a team can never be mistaken for a role:

=================  ==========================================================================
``@admin``         everything: every team's data, months, keys, the audit trail, overrides
``@finance``       reads every team's statements and files, closes and reopens months; no keys
``@viewer``        reads every team's data; changes nothing
``@spend_reader``  what a sidecar needs: every team's month-to-date spend and the issued keys'
                   digests; nothing else (the sidecars hold it instead of the admin token)
``@federation``    what a central billing needs: this cluster's closed months, nothing else
``@metrics``       scrapes ``/metrics``
``@ingest``        the shared ingest token of earlier releases
team member        reads its own team's data
team lead          as a member, and issues, rotates and revokes its own team's keys
=================  ==========================================================================

A credential is a key whose digest is in the configuration (``KeyRing``), a key issued at run
time (``infermeter.keys``: kept in the ledger, with an expiry), or a signed-in person's ID token
(``infermeter.oidc``); each of them becomes a ``Caller``, which is all a route looks at.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = [
    "ADMIN",
    "AUDITORS",
    "CLOSERS",
    "FEDERATION",
    "FEDERATORS",
    "FINANCE",
    "INGEST",
    "INGESTERS",
    "KEY_READERS",
    "MANAGERS",
    "METRICS",
    "READ_ALL",
    "ROLES",
    "SCRAPERS",
    "SIGNATURE_VERSION",
    "SPENDERS",
    "SPEND_READER",
    "VIEWER",
    "AuthError",
    "Caller",
    "Forbidden",
    "GatewayVerifier",
    "Issued",
    "KeyRing",
    "Signed",
    "Unauthenticated",
    "bearer_key",
    "identify",
    "sign_request",
    "string_to_sign",
]

ADMIN: Final = "@admin"
FINANCE: Final = "@finance"
VIEWER: Final = "@viewer"
SPEND_READER: Final = "@spend_reader"
INGEST: Final = "@ingest"
METRICS: Final = "@metrics"
FEDERATION: Final = "@federation"
ROLES: Final = frozenset({ADMIN, FINANCE, VIEWER, SPEND_READER, INGEST, METRICS, FEDERATION})

# Who may do what (besides the teams, who read their own data, and their leads, who also
# manage their own team's keys). One table for every service.
MANAGERS: Final = frozenset({ADMIN})  # ledger exports, keys of any team, overrides, settings
READ_ALL: Final = frozenset({ADMIN, FINANCE, VIEWER})  # every team's data
CLOSERS: Final = frozenset({ADMIN, FINANCE})  # close and reopen months
SPENDERS: Final = READ_ALL | {SPEND_READER}  # every team's month-to-date spend
KEY_READERS: Final = frozenset({ADMIN, SPEND_READER})  # the issued keys' digests (the sidecars)
AUDITORS: Final = frozenset({ADMIN})  # the audit trail
SCRAPERS: Final = frozenset({ADMIN, METRICS})  # /metrics of every service
INGESTERS: Final = frozenset({INGEST})  # records into billing
FEDERATORS: Final = frozenset({ADMIN, FEDERATION})  # a cluster's closed months, for a central

# Unix seconds as the gateway writes them: int() alone would also take signs, spaces, "_",
# other scripts' digits and numbers too large to compare with the clock.
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


class AuthError(Exception):
    """The caller could not be identified; ``code`` is the OpenAI error code to return."""

    def __init__(self, message: str, code: str = "invalid_api_key") -> None:
        super().__init__(message)
        self.code = code


class Issued(Protocol):
    """Keys issued at run time (``infermeter.keys.IssuedKeys``), asked before the static ring."""

    def caller_for(self, key: str, now: float) -> Caller | None:
        """The caller ``key`` makes (None: not an issued key); AuthError if revoked or expired."""
        ...


class KeyRing:
    """API key digests from the configuration, looked up in constant time, and the keys issued
    at run time beside them (``issued``: replaced whole when the set changes)."""

    def __init__(
        self, teams: Iterable[tuple[str, Iterable[str]]], issued: Issued | None = None
    ) -> None:
        # By digest, not a list walked with a comparison each: every request signs in, and the
        # walk cost 42-48 µs a request at 1,000 configured keys (docs/benchmarks.md). A digest
        # held by two principals is refused at start-up (``config.shared_credentials``).
        self._by_digest = {bytes.fromhex(d): team for team, digests in teams for d in digests}
        self.issued = issued

    def with_issued(self, issued: Issued | None) -> KeyRing:
        """The same configured digests with ``issued`` as the run-time keys."""
        ring = KeyRing(())
        ring._by_digest = self._by_digest
        ring.issued = issued
        return ring

    def caller_for(self, key: str, now: float | None = None) -> Caller:
        """The caller ``key`` makes; AuthError if nobody issued it (or it expired, or was revoked)."""
        if self.issued is not None:
            found = self.issued.caller_for(key, time.time() if now is None else now)
            if found is not None:
                return found
        return Caller(self._configured(key))

    def team_for(self, key: str) -> str:
        """The team (or role) owning ``key``; AuthError if none does."""
        return self.caller_for(key).name

    def _configured(self, key: str) -> str:
        digest = hashlib.sha256(key.encode()).digest()
        found = self._by_digest.get(digest)
        if found is None:
            raise AuthError("Incorrect API key provided.")
        return found


def bearer_key(authorization: str | None) -> str:
    """The key of an ``Authorization: Bearer <key>`` header; AuthError when absent."""
    if not authorization:
        raise AuthError(
            "You didn't provide an API key. Use 'Authorization: Bearer <key>'.", "missing_api_key"
        )
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthError(
            "Malformed Authorization header; expected 'Bearer <key>'.", "invalid_api_key"
        )
    return key.strip()


SIGNATURE_VERSION: Final = "infermeter-gateway-v3"
_NONCE = re.compile(r"[A-Za-z0-9_.-]{16,128}")
_HEX_SIGNATURE = re.compile(r"[0-9a-fA-F]{64}")


def string_to_sign(
    *, team: str, timestamp: int, nonce: str, audience: str, method: str, path: str, body: bytes
) -> bytes:
    """The exact bytes a gateway signs: eight lines joined by ``\n``, UTF-8 encoded.

    ::

        infermeter-gateway-v3
        <timestamp: Unix seconds, decimal>
        <nonce: 16-128 of A-Z a-z 0-9 _ . ->
        <team>
        <audience: the configured model the request is sent to, such as chat-small>
        <method, upper case>
        <path, as sent, without the query string>
        <SHA-256 of the request body, lower-case hex (of b"" when there is none)>

    Binding the audience, method, path and body means a signature is good for one request to one
    model's sidecars only; the nonce, remembered for the skew window (``sidecar.nonces``), means
    that request is served once.
    """
    digest = hashlib.sha256(body).hexdigest()
    lines = (SIGNATURE_VERSION, str(timestamp), nonce, team, audience, method.upper(), path, digest)
    return "\n".join(lines).encode()


def sign_request(
    secret: bytes,
    *,
    team: str,
    timestamp: int,
    nonce: str,
    audience: str,
    method: str,
    path: str,
    body: bytes,
) -> str:
    """Hex HMAC-SHA256 of ``string_to_sign(...)`` under ``secret``: what a trusted gateway sends."""
    message = string_to_sign(
        team=team,
        timestamp=timestamp,
        nonce=nonce,
        audience=audience,
        method=method,
        path=path,
        body=body,
    )
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Signed:
    """A request a gateway signed: its team, and the nonce and timestamp that make it good once."""

    team: str
    nonce: str
    timestamp: int


@dataclass(frozen=True)
class GatewayVerifier:
    """Checks a gateway's signature over one request to ``audience`` and its timestamp window.

    Whether its nonce was used before is for the caller to ask (``sidecar.nonces``): that memory
    is kept on disk and shared in Redis, which a pure check cannot reach.
    """

    secret: bytes
    team_header: str
    timestamp_header: str
    signature_header: str
    max_skew_seconds: float
    known_teams: frozenset[str]
    # The configured model this verifier's sidecar serves: a signature names the one it is for.
    audience: str
    nonce_header: str = "x-infermeter-nonce"

    @property
    def headers(self) -> frozenset[str]:
        """The header names of gateway mode, none of which may reach vLLM."""
        return frozenset(
            {self.team_header, self.timestamp_header, self.signature_header, self.nonce_header}
        )

    def verify(
        self,
        headers: Mapping[str, str],
        method: str,
        path: str,
        body: bytes,
        now: float | None = None,
    ) -> Signed:
        """The signed request; AuthError if unsigned, malformed, stale, forged or of an unknown team."""
        team = headers.get(self.team_header)
        stamp = headers.get(self.timestamp_header)
        signature = headers.get(self.signature_header)
        nonce = headers.get(self.nonce_header)
        if not team or not stamp or not signature or not nonce:
            raise AuthError(
                "Missing signed team header from the trusted gateway.", "missing_team_signature"
            )
        # Bounded forms before any arithmetic: a 400-digit timestamp must not reach float().
        if not _TIMESTAMP.fullmatch(stamp):
            raise AuthError("Malformed gateway timestamp.", "invalid_team_signature")
        if not _NONCE.fullmatch(nonce):
            raise AuthError("Malformed gateway nonce.", "invalid_team_signature")
        if not _HEX_SIGNATURE.fullmatch(signature):
            raise AuthError("Invalid gateway signature.", "invalid_team_signature")
        ts = int(stamp)
        now = time.time() if now is None else now
        if abs(now - ts) > self.max_skew_seconds:
            raise AuthError("Stale gateway signature.", "invalid_team_signature")
        expected = sign_request(
            self.secret,
            team=team,
            timestamp=ts,
            nonce=nonce,
            audience=self.audience,
            method=method,
            path=path,
            body=body,
        ).encode()
        if not hmac.compare_digest(expected, signature.lower().encode()):
            raise AuthError("Invalid gateway signature.", "invalid_team_signature")
        if team not in self.known_teams:
            raise AuthError("Unknown team.", "invalid_team_signature")
        return Signed(team, nonce, ts)


class Unauthenticated(Exception):
    """No credential, or one nobody issued: HTTP 401."""


class Forbidden(Exception):
    """A known credential asking for something it may not see or do: HTTP 403."""


@dataclass(frozen=True, slots=True)
class Caller:
    """An identified caller: a team (a member, or its ``lead``), or one of the roles.

    ``key_id``: the issued key it presented (None: a configured key, or a person signed in);
    ``person``: who signed in (the ID token's subject or e-mail), for the audit trail.
    """

    name: str
    lead: bool = False
    key_id: str | None = None
    person: str | None = None

    @property
    def is_admin(self) -> bool:
        """The admin credential reads everything, manages keys and the settings."""
        return self.name == ADMIN

    @property
    def reads_all(self) -> bool:
        """Whether the caller reads every team's data (the admin, finance, a viewer)."""
        return self.name in READ_ALL

    @property
    def team(self) -> str | None:
        """The team this caller is, or None for a role."""
        return None if self.name.startswith("@") else self.name

    @property
    def scope(self) -> str | None:
        """The one team whose data the caller sees, None for every team (a reader of all)."""
        return None if self.reads_all else self.team

    @property
    def role(self) -> str:
        """The caller's role in one word: admin, finance, viewer, ..., lead or member."""
        if self.team is None:
            return self.name.removeprefix("@")
        return "lead" if self.lead else "member"

    @property
    def who(self) -> str:
        """Who acted, as the audit trail names them: the person, the key, or the role."""
        if self.person:
            return self.person
        return f"key:{self.key_id}" if self.key_id else self.name

    def require(self, allowed: frozenset[str]) -> None:
        """Forbidden unless the caller is one of the ``allowed`` roles."""
        if self.name not in allowed:
            raise Forbidden("this credential may not do that")

    def require_reader(self) -> None:
        """Forbidden unless the caller may read the ledger: a reader of all, or a team (its own)."""
        if not (self.reads_all or self.team is not None):
            raise Forbidden("this credential may not read the ledger")

    def require_team(self, team: str) -> None:
        """Forbidden unless the caller is ``team`` or reads every team."""
        if not (self.reads_all or self.name == team):
            raise Forbidden(f"this credential may not read team {team!r}")

    def require_spend(self) -> None:
        """Forbidden unless the caller may read month-to-date spend (every team's, or its own)."""
        if not (self.name in SPENDERS or self.team is not None):
            raise Forbidden("this credential may not read spend")

    def may_manage_keys(self, team: str | None) -> bool:
        """Whether the caller issues and revokes keys of ``team`` (None: a role's key)."""
        return self.is_admin or (self.lead and team is not None and self.name == team)


def identify(ring: KeyRing, authorization: str | None, now: float | None = None) -> Caller:
    """The caller named by an ``Authorization: Bearer`` header; Unauthenticated if none is."""
    try:
        return ring.caller_for(bearer_key(authorization), now)
    except AuthError as exc:
        raise Unauthenticated(str(exc)) from None
