"""Budget overrides as an admin asks for them: one parser for every service that grants them.

An admin grants an override at billing (served to every sidecar with the spend) or at a sidecar
(passed on to billing with the admin's credential, and applied there at once). Both take the
same body, ``{"team": ..., "minutes": ..., "reason": ...}``, with the same bounds, so the rule
lives here, in the core, which both may import (billing never imports the sidecar).

Per team the last grant decides, wherever it was made, also once it has ended: a grant of
``minutes`` 0 (a revocation) or a short grant that ran out ends every grant made before it, so
a mistaken month-long override is taken back by granting again, not by waiting for its end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import orjson

from infermeter.ids import sample_id
from infermeter.records import MAX_OVERRIDE_REASON, BudgetOverride

__all__ = [
    "ISSUED_BY_BILLING",
    "MAX_OVERRIDE_SECONDS",
    "OVERRIDE_FIELDS",
    "Override",
    "grant_state",
    "latest",
    "override_field",
    "override_record",
    "parse_override",
]

# How the ledger rows of the overrides billing's admin granted begin their ``issued_by``
# (``billing:@admin``); billing ingests no record so named, whoever ships it.
ISSUED_BY_BILLING: Final = "billing:"
# The fields of an override's body, all required.
OVERRIDE_FIELDS: Final = ("team", "minutes", "reason")
# The longest override an admin may grant (``parse_override``): one month.
MAX_OVERRIDE_SECONDS: Final = 44640 * 60


@dataclass(frozen=True)
class Override:
    """An admin's permission for a team to spend past its budget until ``until`` (epoch s)."""

    team: str
    until: float
    reason: str
    granted_at: float

    def in_force(self, now: float) -> bool:
        """True while the override lets its team past its budget (a revocation never does)."""
        return self.until > now

    def to_json(self) -> bytes:
        """The stored form."""
        return orjson.dumps(self.__dict__)


def parse_override(raw: bytes, teams: frozenset[str], now: float) -> Override:
    """An override from an admin's request body; ValueError naming what is wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    team, minutes, reason = body.get("team"), body.get("minutes"), body.get("reason")
    if not isinstance(team, str) or team not in teams:
        raise ValueError(f"team: {team!r} is not a configured team")
    if (
        isinstance(minutes, bool)
        or not isinstance(minutes, int | float)
        or not 0 <= minutes * 60 <= MAX_OVERRIDE_SECONDS
    ):
        raise ValueError(
            f"minutes: {minutes!r} must be a number in [0, 44640] (one month; 0 revokes: the "
            "team's override ends now)"
        )
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("reason: an override needs a reason, for the record")
    if len(reason.strip()) > MAX_OVERRIDE_REASON:
        # Refused, not cut: the record would otherwise keep a reason the admin did not write.
        raise ValueError(
            f"reason: {len(reason.strip())} characters; at most {MAX_OVERRIDE_REASON} are kept"
        )
    return Override(team, now + float(minutes) * 60, reason.strip(), now)


def override_field(message: str) -> str | None:
    """The body field a ``parse_override`` message names (it begins ``<field>:``), if any: the
    ``param`` of the error answered for it."""
    name = message.partition(":")[0]
    return name if name in OVERRIDE_FIELDS else None


def override_record(override: Override, issued_by: str) -> BudgetOverride:
    """The ledger's record of ``override``, issued by ``issued_by`` (an instance, or billing)."""
    return BudgetOverride(
        override_id=sample_id(override.granted_at, issued_by, override.team),
        team=override.team,
        admin_reason=override.reason,
        until=override.until,
        issued_at=override.granted_at,
        issued_by=issued_by,
    )


def latest(*sources: dict[str, Override]) -> dict[str, Override]:
    """Per team, the override granted last among ``sources`` (by ``granted_at``; on a tie the
    later source's): wherever an admin granted them, the last grant decides."""
    out: dict[str, Override] = {}
    for source in sources:
        for team, found in source.items():
            held = out.get(team)
            if held is None or found.granted_at >= held.granted_at:
                out[team] = found
    return out


def grant_state(grant: object, now: float) -> tuple[str, float] | None:
    """What a team's last grant as billing serves it (a spend row's ``override``: ``{"until",
    "issued_at", "reason"}``) means at ``now``: ``("until", end)`` while it lets the team past
    its budget, ``("revoked", when)`` for a revocation (``minutes`` 0), ``("ended", when)`` for
    one that ran out; None for no grant, or anything that is not one."""
    if not isinstance(grant, dict):
        return None
    until, issued = grant.get("until"), grant.get("issued_at")
    if not isinstance(until, int | float) or not isinstance(issued, int | float):
        return None
    if until > now:
        return "until", float(until)
    return ("revoked" if until <= issued else "ended"), float(until)
