"""Keys issued at run time, kept in the ledger (``api_keys``), and the ring billing checks them in.

``KeyBook`` is billing's one holder of them: it issues, rotates and revokes (each change and its
audit event in one transaction), lists them for who may see them, and keeps ``ring`` (the
configured keys and the issued ones in force) current, replacing it whole after each change. A
``Publisher`` then tells the sidecars (``billing.key_publish``: Redis); without one they poll
``GET /v1/keys/active``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import fields, replace
from typing import Any, Final, Protocol

import duckdb

from billing import audit
from billing.ledger import Ledger
from infermeter.audit import audit_event
from infermeter.auth import Caller, Forbidden, KeyRing
from infermeter.errors import BadRequest
from infermeter.keys import IssuedKey, IssuedKeys, KeyRequestError, new_key, rotated

__all__ = ["KeyBook", "KeyNotFoundError", "Publisher"]

log = logging.getLogger("infermeter.billing")

_COLUMNS: Final = tuple(f.name for f in fields(IssuedKey))
_NAMES: Final = ", ".join(_COLUMNS)
# The longest a rotated key may keep working beside its successor.
MAX_GRACE_SECONDS: Final = 7 * 86400.0


class KeyNotFoundError(LookupError):
    """No issued key has that id (or not one the caller may see): HTTP 404."""


class Publisher(Protocol):
    """Where the sidecars read the set from, besides billing itself."""

    # The public key (hex) the set written there verifies with: billing's route tells the
    # sidecars (``infermeter.key_set_seal``).
    signer_hex: str

    def publish(self, keys: IssuedKeys) -> None:
        """Make ``keys`` the set the sidecars read; never raises (a failure is retried later)."""
        ...


class KeyBook:
    """The issued keys: the ledger's rows, and the ring of the ones in force."""

    def __init__(
        self,
        ledger: Ledger,
        configured: KeyRing,
        teams: Iterable[str],
        publisher: Publisher | None = None,
        max_per_team: int = 100,
    ) -> None:
        self._ledger = ledger
        # Reentrant: a revocation finds the keys that go with it under the lock it writes under.
        self._lock = threading.RLock()
        self._configured = configured
        self.teams = frozenset(teams)
        self.publisher = publisher
        # ``billing.max_keys_per_team``: keys in force at once per team (the roles' keys count
        # as one team of their own).
        self.max_per_team = max_per_team
        self.issued = self._load()
        self.ring = configured.with_issued(self.issued)

    def reconfigure(
        self, configured: KeyRing, teams: Iterable[str], max_per_team: int | None = None
    ) -> None:
        """Adopt the configured keys, teams and bound of a reloaded configuration (keys beyond a
        lowered bound stay in force; no new one is issued until the team is below it)."""
        with self._lock:
            self._configured = configured
            self.teams = frozenset(teams)
            if max_per_team is not None:
                self.max_per_team = max_per_team
            self.ring = configured.with_issued(self.issued)

    # -- changes ---------------------------------------------------------------------------

    def create(
        self, request: dict[str, Any], creator: Caller, address: str | None
    ) -> tuple[IssuedKey, str]:
        """Issue the key ``request`` asks for; the key and its secret (shown once, never kept).

        BadRequest for a request that cannot be issued, Forbidden for a key the creator may not.
        """
        why = _why(request.pop("reason", ""))
        now = time.time()
        try:
            issued, secret = new_key(request, self.teams, creator, now)
        except KeyRequestError as exc:
            raise BadRequest(str(exc), code="invalid_value") from None
        bound = self._issuer_expiry(creator)
        if bound is not None:
            if issued.expires_at is not None and issued.expires_at > bound:
                raise BadRequest(
                    f"expiry: a key a lead issues ends no later than the lead's own key "
                    f"(key {creator.key_id}, at {bound:.0f})",
                    code="invalid_value",
                )
            issued = replace(issued, expires_at=min(issued.expires_at or bound, bound))
        event = _event("key.created", creator, issued, why, address, now)
        self._write([issued], [event], grows=issued, issuer=creator)
        return issued, secret

    def revoke(self, key_id: str, caller: Caller, address: str | None, why: str) -> IssuedKey:
        """Revoke ``key_id`` now (a key revoked already is returned as it is, with no event)."""
        old = self._managed(key_id, caller)
        if old.revoked_at is not None:
            return old
        now = time.time()
        why = _why(why)
        gone = replace(old, revoked_at=now)
        events = [_event("key.revoked", caller, gone, why, address, now)]
        # The keys it issued (or rotated) go with it: a lead's acts end with the lead's key.
        because = f"its issuer key:{old.key_id} was revoked" + (f": {why}" if why else "")
        extra = {"issuer": f"key:{old.key_id}"}
        with self._lock:  # so that no key this one issues meanwhile is left out
            issued = [replace(k, revoked_at=now) for k in self._issued_by(old, now)]
            events += [
                _event("key.revoked", caller, k, because, address, now, extra) for k in issued
            ]
            self._write([gone, *issued], events)
        return gone

    def rotate(
        self, key_id: str, caller: Caller, address: str | None, why: str, grace_seconds: float = 0.0
    ) -> tuple[IssuedKey, str]:
        """A new key in place of ``key_id``, and its secret; the old one is revoked now, or
        expires after ``grace_seconds`` (at most a week) so clients can move over."""
        old = self._managed(key_id, caller)
        now = time.time()
        if not old.active(now):
            raise BadRequest(
                f"key {key_id} is revoked or expired: issue a new one", code="invalid_value"
            )
        if not 0 <= grace_seconds <= MAX_GRACE_SECONDS:
            raise BadRequest(
                "grace_seconds: from 0 to 604800 (a week)",
                param="grace_seconds",
                code="invalid_value",
            )
        fresh, secret = rotated(old, caller, now)
        bound = self._issuer_expiry(caller)
        if bound is not None:
            fresh = replace(fresh, expires_at=min(fresh.expires_at or bound, bound))
        if grace_seconds:
            until = now + grace_seconds
            ending = min(old.expires_at or until, until)
            done = replace(old, expires_at=ending, replaced_by=fresh.key_id)
        else:
            done = replace(old, revoked_at=now, replaced_by=fresh.key_id)
        event = _event(
            "key.rotated",
            caller,
            done,
            _why(why),
            address,
            now,
            {"new_key_id": fresh.key_id, "grace_seconds": grace_seconds},
        )
        # Without a grace period the old key is revoked in the same change: the count stays.
        self._write([done, fresh], [event], grows=fresh if grace_seconds else None, issuer=caller)
        return fresh, secret

    def _issuer_expiry(self, creator: Caller) -> float | None:
        """When the issued key ``creator`` presents expires (None: never, or not an issued
        key's holder): the keys a lead issues or rotates end no later than the lead's own."""
        if creator.is_admin or creator.key_id is None:
            return None
        own = self.issued.by_id.get(creator.key_id)
        if own is None:
            raise Forbidden("this credential was revoked or has expired")
        return own.expires_at

    def _issued_by(self, key: IssuedKey, now: float) -> list[IssuedKey]:
        """The keys in force that ``key``, or a key it replaced, issued or rotated."""
        with self._ledger.reader() as cur:
            rows = cur.execute(
                f"SELECT {_NAMES} FROM api_keys WHERE team IS NOT DISTINCT FROM ?", [key.team]
            ).fetchall()
        keys = [IssuedKey(**dict(zip(_COLUMNS, r, strict=True))) for r in rows]
        lineage = {key.key_id}
        while True:
            more = {k.key_id for k in keys if k.replaced_by in lineage} - lineage
            if not more:
                break
            lineage |= more
        makers = {f"key:{i}" for i in lineage}
        return [
            k for k in keys if k.created_by in makers and k.key_id not in lineage and k.active(now)
        ]

    def _managed(self, key_id: str, caller: Caller) -> IssuedKey:
        """The key ``key_id`` if ``caller`` manages it; KeyNotFoundError, else Forbidden."""
        with self._ledger.reader() as cur:
            row = cur.execute(
                f"SELECT {_NAMES} FROM api_keys WHERE key_id = ?", [key_id]
            ).fetchone()
        if row is None:
            raise KeyNotFoundError(f"no issued key {key_id!r}")
        key = IssuedKey(**dict(zip(_COLUMNS, row, strict=True)))
        if not caller.may_manage_keys(key.team) or (not caller.is_admin and key.role != "member"):
            raise Forbidden(f"this credential may not manage key {key_id}")
        return key

    def _write(
        self,
        keys: list[IssuedKey],
        events: list[Any],
        grows: IssuedKey | None = None,
        issuer: Caller | None = None,
    ) -> None:
        """Keep ``keys`` (new or changed) and ``events`` in one transaction, then swap the ring.

        ``grows``: the change adds this key to its team's keys in force; BadRequest (nothing
        written) when the team already holds ``max_per_team``. ``issuer``: who issues a key in
        it, Forbidden (nothing written) when its own issued key is no longer in force. Counted under the lock that
        serialises every change, so two requests at once cannot both take the last place.
        """
        with self._lock:
            if issuer is not None:
                # Again under the lock: a lead revoked since it asked issues nothing.
                self._issuer_expiry(issuer)
            if grows is not None:
                self._check_room(grows.team, time.time())
            with self._ledger.writing() as cur:
                seq = _next_seq(cur)
                for key in keys:
                    cur.execute(
                        f"INSERT OR REPLACE INTO api_keys ({_NAMES}, changed_seq) "
                        f"VALUES ({', '.join('?' * (len(_COLUMNS) + 1))})",
                        [*(getattr(key, c) for c in _COLUMNS), seq],
                    )
                audit.append(cur, events, time.time())
            self.issued = self._load()
            self.ring = self._configured.with_issued(self.issued)
        if self.publisher is not None:
            self.publisher.publish(self.issued)

    def _check_room(self, team: str | None, now: float) -> None:
        held = sum(1 for k in self.issued.by_id.values() if k.team == team and k.active(now))
        if held >= self.max_per_team:
            whose = f"team {team!r}" if team is not None else "the roles"
            raise BadRequest(
                f"{whose} already has {held} keys in force, the most billing.max_keys_per_team "
                f"({self.max_per_team}) allows: revoke one, or rotate one without a grace "
                "period, first",
                code="too_many_keys",
            )

    # -- reading ---------------------------------------------------------------------------

    def listing(self, caller: Caller, revoked: bool = False) -> list[IssuedKey]:
        """The keys ``caller`` manages: every key for the admin, its team's for a lead."""
        if not (caller.is_admin or caller.lead):
            raise Forbidden("this credential may not list keys")
        where = "" if revoked else "WHERE revoked_at IS NULL"
        with self._ledger.reader() as cur:
            rows = cur.execute(
                f"SELECT {_NAMES} FROM api_keys {where} ORDER BY created_at, key_id"
            ).fetchall()
        keys = [IssuedKey(**dict(zip(_COLUMNS, r, strict=True))) for r in rows]
        return [k for k in keys if caller.is_admin or k.team == caller.team]

    def _load(self) -> IssuedKeys:
        """The keys in force (not revoked, not expired), at the version of the last change.

        An expired key leaves the set at the next change (until then it is refused for its
        expiry), so the set every sidecar holds is bounded by ``max_per_team`` per team, not
        by every key a team ever issued.
        """
        with self._ledger.reader() as cur:
            rows = cur.execute(
                f"SELECT {_NAMES} FROM api_keys WHERE revoked_at IS NULL "
                "AND (expires_at IS NULL OR expires_at > ?) ORDER BY key_id",
                [time.time()],
            ).fetchall()
            version = _version(cur)
        return IssuedKeys.of(
            version, (IssuedKey(**dict(zip(_COLUMNS, r, strict=True))) for r in rows)
        )


def _version(cur: duckdb.DuckDBPyConnection) -> int:
    row = cur.execute("SELECT coalesce(max(changed_seq), 0) FROM api_keys").fetchone()
    return int(row[0]) if row else 0


def _next_seq(cur: duckdb.DuckDBPyConnection) -> int:
    return _version(cur) + 1


def _why(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 500:
        raise BadRequest("reason: a string of at most 500 characters", code="invalid_value")
    return value


def _event(
    action: str,
    caller: Caller,
    key: IssuedKey,
    why: str,
    address: str | None,
    now: float,
    extra: dict[str, Any] | None = None,
) -> Any:
    detail = {
        "team": key.team,
        "role": key.role,
        "member": key.member,
        "project": key.project,
        "expires_at": key.expires_at,
    } | (extra or {})
    return audit_event(
        action,
        caller.who,
        caller.role,
        "billing",
        target=f"key:{key.key_id}",
        detail=detail,
        why=why,
        address=address,
        at=now,
    )
