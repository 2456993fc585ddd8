"""Who may read or write what in billing: one credential per role, teams see only themselves.

Every credential is held as a SHA-256 digest and checked through the sidecar's ``KeyRing``
(constant-time comparison against every digest). Roles are named with a leading ``@``, which no
team name can have, so a team can never be mistaken for a role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from infermeter.auth import AuthError, KeyRing, bearer_key
from infermeter.config import Config

__all__ = [
    "ADMIN",
    "INGEST",
    "METRICS",
    "Caller",
    "Forbidden",
    "Unauthenticated",
    "identify",
    "keyring",
]

ADMIN: Final = "@admin"
INGEST: Final = "@ingest"
METRICS: Final = "@metrics"


class Unauthenticated(Exception):
    """No credential, or one nobody issued: HTTP 401."""


class Forbidden(Exception):
    """A known credential asking for something it may not see or do: HTTP 403."""


@dataclass(frozen=True, slots=True)
class Caller:
    """An identified caller: a team, or one of the roles."""

    name: str

    @property
    def is_admin(self) -> bool:
        """The admin credential reads everything and closes months."""
        return self.name == ADMIN

    @property
    def team(self) -> str | None:
        """The team this caller is, or None for a role."""
        return None if self.name.startswith("@") else self.name

    def require(self, *roles: str) -> None:
        """Forbidden unless the caller holds one of ``roles``."""
        if self.name not in roles:
            raise Forbidden("this credential may not do that")

    def require_team(self, team: str) -> None:
        """Forbidden unless the caller is ``team`` or the admin."""
        if not (self.is_admin or self.name == team):
            raise Forbidden(f"this credential may not read team {team!r}")


def keyring(config: Config) -> KeyRing:
    """Every credential billing accepts, with the role or team it stands for."""
    entries = [(t.name, t.api_key_sha256) for t in config.teams]
    entries += [(ADMIN, config.admin_token_sha256), (METRICS, config.metrics_token_sha256),
                (INGEST, config.billing.ingest_token_sha256)]  # fmt: skip
    return KeyRing(entries)


def identify(ring: KeyRing, authorization: str | None) -> Caller:
    """The caller named by an ``Authorization: Bearer`` header."""
    try:
        return Caller(ring.team_for(bearer_key(authorization)))
    except AuthError as exc:
        raise Unauthenticated(str(exc)) from None
