"""API keys issued at run time: what one is, how its secret looks, and the set every service holds.

Billing issues a key (``infermeter keys create``, ``POST /v1/keys``, the dashboard's Keys page),
keeps only its SHA-256 digest in the ledger, and shows the secret once. Every service that takes
keys holds the current set as one frozen ``IssuedKeys``, replaced whole when it changes (billing
when it writes one, a sidecar when it reads a newer version: ``sidecar.keysync``), so a lookup in
flight sees one set.

A key is ``imk_<id>_<secret>``: the id (12 of ``a-z0-9``) names its row, so a presented key is
found with one dictionary lookup and one constant-time digest comparison, however many keys there
are; the secret is 256 random bits. The id is not secret: it is what listings, the audit trail
and ``revoke`` name.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Final

from infermeter.auth import AuthError, Caller, Forbidden

__all__ = [
    "KEY_PREFIX",
    "KEY_ROLES",
    "TEAM_ROLES",
    "IssuedKey",
    "IssuedKeys",
    "KeyRequestError",
    "key_digest",
    "key_id_of",
    "new_key",
    "new_secret",
    "redis_keys",
    "rotated",
]

KEY_PREFIX: Final = "imk_"
# The roles a key may be issued for. The admin's is not among them: it stays in the
# configuration (or with a signed-in administrator), where no key issued at run time reaches it.
TEAM_ROLES: Final = frozenset({"member", "lead"})
KEY_ROLES: Final = TEAM_ROLES | {"finance", "viewer", "spend_reader"}
_ID: Final = re.compile(r"[a-z0-9]{12}")
_ID_ALPHABET: Final = "abcdefghijklmnopqrstuvwxyz0123456789"
_LABEL: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:/+-]{0,127}")
# A key may live at most this long (about 10 years), so an expiry typo cannot be "forever" by
# accident while looking like a date.
MAX_LIFETIME_SECONDS: Final = 10 * 366 * 86400.0


class KeyRequestError(ValueError):
    """A key request that cannot be issued; the message names the field and why."""


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """One issued key as the ledger keeps it: never its secret, only the secret's digest."""

    key_id: str
    role: str
    team: str | None
    digest: str
    created_at: float
    created_by: str
    member: str | None = None
    project: str | None = None
    expires_at: float | None = None
    revoked_at: float | None = None
    # The key that replaced this one (``rotate``).
    replaced_by: str | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    budget_usd_per_month: float | None = None

    def active(self, now: float) -> bool:
        """Not revoked and not expired at ``now``."""
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    @property
    def caller(self) -> Caller:
        """Who a request with this key is."""
        if self.team is not None:
            return Caller(self.team, lead=self.role == "lead", key_id=self.key_id)
        return Caller(f"@{self.role}", key_id=self.key_id)

    @property
    def limited(self) -> bool:
        """Whether the key has limits of its own, beside its team's."""
        return any(
            v is not None
            for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent)
        )

    def to_json(self) -> dict[str, Any]:
        """Every field, for the API and the sidecars' copy (the digest, never a secret)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IssuedKey:
        """Rebuild from ``to_json``; unknown keys are ignored (a newer billing may add some)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True, slots=True)
class IssuedKeys:
    """The keys in force, by id, at one ``version`` of the set (it only grows)."""

    version: int
    by_id: Mapping[str, IssuedKey]

    @classmethod
    def of(cls, version: int, keys: Iterable[IssuedKey]) -> IssuedKeys:
        """The set holding ``keys``."""
        return cls(version, {k.key_id: k for k in keys})

    def caller_for(self, key: str, now: float) -> Caller | None:
        """The caller ``key`` makes; None when it is not an issued key; AuthError when it names
        a key that is not in force (unknown, revoked, expired) or whose secret is wrong."""
        key_id = key_id_of(key)
        if key_id is None:
            return None
        found = self.by_id.get(key_id)
        presented = hashlib.sha256(key.encode()).hexdigest().encode()
        expected = found.digest.encode() if found is not None else b"0" * 64
        if not hmac.compare_digest(presented, expected) or found is None:
            raise AuthError("Incorrect API key provided.")
        if not found.active(now):
            raise AuthError("This API key has expired or was revoked.", "invalid_api_key")
        return found.caller

    def to_json(self) -> dict[str, Any]:
        """The wire form the sidecars read (``GET /v1/keys/active``, Redis)."""
        return {"version": self.version, "keys": [k.to_json() for k in self.by_id.values()]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IssuedKeys:
        """Rebuild from ``to_json``; KeyRequestError when it is not one."""
        try:
            version = int(data["version"])
            keys = [IssuedKey.from_json(k) for k in data["keys"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise KeyRequestError(f"not a key set: {exc}") from None
        return cls.of(version, keys)


def key_id_of(key: str) -> str | None:
    """The id an issued key's text names, or None when the text is not shaped like one."""
    if not key.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = key[len(KEY_PREFIX) :].partition("_")
    if not sep or not secret or not _ID.fullmatch(key_id):
        return None
    return key_id


def redis_keys(prefix: str) -> tuple[str, str]:
    """The Redis keys of the set and of its version under ``prefix`` (billing writes both,
    ``billing.key_publish``; the sidecars read them, ``sidecar.keysync``)."""
    return f"{prefix}:keys", f"{prefix}:keys:version"


def key_digest(key: str) -> str:
    """The SHA-256 hex digest kept for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_secret() -> tuple[str, str]:
    """A fresh ``(key id, key)``: the key is shown once and never kept."""
    key_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def new_key(
    request: Mapping[str, Any], teams: Iterable[str], creator: Caller, now: float
) -> tuple[IssuedKey, str]:
    """The key ``request`` asks for, made by ``creator``, and its secret (shown once).

    ``request``: role (default member), team, member, project, expires_at (Unix seconds) or
    expires_in_seconds, requests_per_minute, tokens_per_minute, max_concurrent,
    budget_usd_per_month. KeyRequestError naming the field for anything wrong, and for a key the
    creator may not issue (Forbidden: a lead issues member keys of its own team only).
    """
    unknown = set(request) - _REQUEST_FIELDS
    if unknown:
        raise KeyRequestError(f"unknown field(s): {', '.join(sorted(unknown))}")
    role = _text(request, "role") or "member"
    if role not in KEY_ROLES:
        raise KeyRequestError(f"role {role!r}: one of {', '.join(sorted(KEY_ROLES))}")
    team = _text(request, "team")
    known = set(teams)
    if role in TEAM_ROLES:
        if team is None:
            raise KeyRequestError(f"team: required for a {role} key")
        if team not in known:
            raise KeyRequestError(f"team {team!r}: no such team in the configuration")
    elif team is not None:
        raise KeyRequestError(f"team: a {role} key belongs to no team")
    if not creator.may_manage_keys(team) or (not creator.is_admin and role != "member"):
        raise Forbidden(
            f"this credential may not issue a {role} key" + (f" of team {team!r}" if team else "")
        )
    key_id, secret = new_secret()
    issued = IssuedKey(
        key_id=key_id,
        role=role,
        team=team,
        digest=key_digest(secret),
        created_at=now,
        created_by=creator.who,
        member=_label(request, "member"),
        project=_label(request, "project"),
        expires_at=_expiry(request, now),
        requests_per_minute=_positive_int(request, "requests_per_minute"),
        tokens_per_minute=_positive_int(request, "tokens_per_minute"),
        max_concurrent=_positive_int(request, "max_concurrent"),
        budget_usd_per_month=_budget(request),
    )
    return issued, secret


def rotated(old: IssuedKey, creator: Caller, now: float) -> tuple[IssuedKey, str]:
    """A new key with ``old``'s team, role, labels, limits and expiry, and its secret."""
    key_id, secret = new_secret()
    fresh = replace(
        old,
        key_id=key_id,
        digest=key_digest(secret),
        created_at=now,
        created_by=creator.who,
        revoked_at=None,
        replaced_by=None,
    )
    return fresh, secret


_REQUEST_FIELDS: Final = frozenset(
    {
        "role",
        "team",
        "member",
        "project",
        "expires_at",
        "expires_in_seconds",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent",
        "budget_usd_per_month",
        "reason",
    }
)


def _text(request: Mapping[str, Any], name: str) -> str | None:
    value = request.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise KeyRequestError(f"{name}: a string expected")
    return value


def _label(request: Mapping[str, Any], name: str) -> str | None:
    value = _text(request, name)
    if value is not None and not _LABEL.fullmatch(value):
        raise KeyRequestError(
            f"{name} {value[:80]!r}: 1-128 of letters, digits and . _ @ : / + - expected"
        )
    return value


def _number(request: Mapping[str, Any], name: str) -> float | None:
    value = request.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise KeyRequestError(f"{name}: a number expected")
    return float(value)


def _positive_int(request: Mapping[str, Any], name: str) -> int | None:
    value = request.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 10**9:
        raise KeyRequestError(f"{name}: a whole number from 1 to 1,000,000,000 expected")
    return value


def _budget(request: Mapping[str, Any]) -> float | None:
    value = _number(request, "budget_usd_per_month")
    if value is not None and not 0 <= value <= 1e9:
        raise KeyRequestError("budget_usd_per_month: from 0 to 1,000,000,000 expected")
    return value


def _expiry(request: Mapping[str, Any], now: float) -> float | None:
    at = _number(request, "expires_at")
    within = _number(request, "expires_in_seconds")
    if at is not None and within is not None:
        raise KeyRequestError("expires_at and expires_in_seconds: give one of them")
    if within is not None:
        at = now + within
    if at is None:
        return None
    if not now < at <= now + MAX_LIFETIME_SECONDS:
        raise KeyRequestError("expiry: in the future and within 10 years expected")
    return at
