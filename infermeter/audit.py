"""The audit trail: who changed what that matters, when, from where and why.

An ``AuditEvent`` is appended, never edited: billing writes the events of the changes it makes
itself (keys, months) in the same transaction as the change, and every other service (the
sidecars, the dashboard, the collector, the autoscaler) spools its own events, sealed like any
record, and ships them to billing's ``POST /v1/ingest/audit`` (``AuditSpool``), so an event
made while billing is down is kept until billing has it. Billing keeps each event once (by
``event_id``) and names the writer that sent it as its ``source``, whatever the line says; a
writer may send only the actions its role records (``ACTIONS_BY_ROLE``), at most
``MAX_BATCH_EVENTS`` to a batch.

No route of the product edits or deletes an event: the admin reads them (``GET /v1/audit``)
and exports them (``GET /v1/audit.csv``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

import orjson

from infermeter.writers import Role, Writer

__all__ = [
    "ACTIONS",
    "ACTIONS_BY_ROLE",
    "MAX_BATCH_EVENTS",
    "MAX_TEXT",
    "AuditEvent",
    "AuditEventError",
    "audit_event",
    "may_record",
    "parse_event",
]

# Every action the product records. A writer may send no other: the trail's vocabulary is fixed.
ACTIONS: Final = frozenset(
    {
        "key.created",
        "key.revoked",
        "key.rotated",
        "budget.override",
        "month.closed",
        "month.reopened",
        "prices.imported",
        "invoice.imported",
        "config.reloaded",
        "config.refused",
        "signin.succeeded",
        "signin.failed",
        "signout",
    }
)
# The actions each writer role records itself (``infermeter.audit_spool``); every other action
# (keys, months, prices, invoices) is billing's own, written in the transaction of its change, so a
# pod that sends one is claiming a change billing never made.
ACTIONS_BY_ROLE: Final[Mapping[Role, frozenset[str]]] = {
    Role.INSTANCE: frozenset({"budget.override", "config.reloaded", "config.refused"}),
    Role.COLLECTOR: frozenset(),
    Role.AUTOSCALER: frozenset({"config.reloaded", "config.refused"}),
    Role.DASHBOARD: frozenset({"signin.succeeded", "signin.failed", "signout"}),
}
# How long a text field may be, in characters: a sentence or a small JSON object.
MAX_TEXT: Final = 2000
# The most events one shipped batch may hold. Events are made by hand (a sign-in, an override) or
# by a reload: a service's spool rolls every 2 s, and a thousand in one segment would be a sign-in
# every 2 ms, far past the dashboard's throttle. A backlog after billing was down arrives in
# batches of this size (the audit shipper sends no more), each kept in one INSERT of milliseconds;
# a bound is what keeps any one pod from holding the ledger's writer lock for long.
MAX_BATCH_EVENTS: Final = 1_000
_OUTCOMES: Final = frozenset({"ok", "refused", "failed"})
_STRINGS: Final = (
    "event_id",
    "action",
    "actor",
    "actor_role",
    "source",
    "target",
    "detail",
    "why",
    "outcome",
)


class AuditEventError(ValueError):
    """An event that is not one; the message names the field."""


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One change that matters."""

    event_id: str
    occurred_at: float
    # What happened, one of ``ACTIONS``.
    action: str
    # Who did it: a person signed in, ``key:<id>``, a role (``@admin``) or a service.
    actor: str
    actor_role: str
    # The service that recorded it: ``billing``, or the writer's principal that shipped it.
    source: str
    # From where: the client's address, when there was a client.
    address: str | None = None
    # What it was done to: ``key:<id>``, ``month:2026-05``, ``team:search``, a file.
    target: str = ""
    # What exactly, as a small JSON object (the key's team and role, the override's until...).
    detail: str = "{}"
    # Why, in the actor's words (or the error that refused it).
    why: str = ""
    outcome: str = "ok"

    def to_json(self) -> dict[str, Any]:
        """The spool line and the API's row."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def audit_event(
    action: str,
    actor: str,
    actor_role: str,
    source: str,
    *,
    target: str = "",
    detail: Mapping[str, Any] | None = None,
    why: str = "",
    address: str | None = None,
    outcome: str = "ok",
    at: float | None = None,
) -> AuditEvent:
    """A new event with a fresh id; AuditEventError for an action not in ``ACTIONS``."""
    found = AuditEvent(
        event_id=f"ae-{secrets.token_hex(12)}",
        occurred_at=time.time() if at is None else at,
        action=action,
        actor=actor,
        actor_role=actor_role,
        source=source,
        address=address,
        target=target,
        detail=orjson.dumps(dict(detail or {})).decode(),
        why=why,
        outcome=outcome,
    )
    return parse_event(found.to_json(), source)


def may_record(writer: Writer | None, action: str) -> bool:
    """Whether ``writer`` may send an event of ``action``; None, the shared ingest token of
    earlier releases, may send what any writer may (it stands for every writer)."""
    if writer is None:
        return any(action in actions for actions in ACTIONS_BY_ROLE.values())
    return action in ACTIONS_BY_ROLE[writer.role]


def parse_event(
    data: Any, source: str, now: float | None = None, skew: float = 300.0
) -> AuditEvent:
    """The event ``data`` holds, as ``source`` recorded it; AuditEventError naming what is wrong.

    ``source`` replaces whatever the line claims: billing knows who sent it.
    """
    if not isinstance(data, dict):
        raise AuditEventError("an audit event is a JSON object")
    names = {f.name for f in fields(AuditEvent)}
    unknown = set(data) - names - {"seal"}
    if unknown:
        raise AuditEventError(f"unknown field(s): {', '.join(sorted(unknown))}")
    values = {k: v for k, v in data.items() if k in names} | {"source": source}
    for name in ("event_id", "occurred_at", "action", "actor", "actor_role"):
        if name not in values:
            raise AuditEventError(f"{name}: missing")
    for name in _STRINGS:
        value = values.get(name, "")
        if not isinstance(value, str):
            raise AuditEventError(f"{name}: a string expected")
        if len(value) > MAX_TEXT:
            raise AuditEventError(f"{name}: longer than {MAX_TEXT} characters")
    address = values.get("address")
    if address is not None and (not isinstance(address, str) or len(address) > 256):
        raise AuditEventError("address: a string of at most 256 characters expected")
    at = values["occurred_at"]
    if isinstance(at, bool) or not isinstance(at, int | float) or not at >= 946684800:
        raise AuditEventError("occurred_at: Unix seconds expected")
    if at > (time.time() if now is None else now) + skew:
        raise AuditEventError("occurred_at: in the future")
    if not values["event_id"] or not values["actor"]:
        raise AuditEventError("event_id and actor: must not be empty")
    if values["action"] not in ACTIONS:
        raise AuditEventError(f"action {values['action'][:80]!r}: not an action the trail records")
    if values.get("outcome", "ok") not in _OUTCOMES:
        raise AuditEventError(f"outcome: one of {', '.join(sorted(_OUTCOMES))}")
    values["occurred_at"] = float(at)
    return AuditEvent(**values)
