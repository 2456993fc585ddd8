"""Budget overrides billing's admin grants, and the ones billing serves to every sidecar.

An override granted at a sidecar reaches the others only through Redis; billing is the one
service every sidecar reads (``GET /v1/spend``), so an override the admin grants here reaches
every sidecar with the spend, with or without Redis, and survives Redis losing its keys.

Rows of ``budget_overrides`` are also written by the sidecars (any instance credential ships
them), and billing cannot tell whether the admin really asked a sidecar for one: served to the
fleet, a row of one compromised pod would lift a team's budget everywhere. So billing serves only
the rows it wrote itself, named ``issued_by`` ``billing:<who>`` (``ISSUED_BY_BILLING``), a name
ingest refuses from any writer (``billing.ingest_sql``).
"""

from __future__ import annotations

from typing import Any

import duckdb

from billing import audit
from billing.ledger import Ledger
from infermeter.audit import AuditEvent
from infermeter.overrides import (
    ISSUED_BY_BILLING,
    MAX_OVERRIDE_SECONDS,
    Override,
    override_record,
)
from infermeter.records import BudgetOverride

__all__ = ["ISSUED_BY_BILLING", "grant", "issuer", "keep", "last_grants"]


def issuer(who: str) -> str:
    """The ``issued_by`` of an override granted at billing by ``who`` (as the audit trail names
    the caller: ``@admin``, a person, ``key:<id>``)."""
    return ISSUED_BY_BILLING + who


def grant(
    ledger: Ledger, override: Override, issued_by: str, event: AuditEvent, now: float
) -> BudgetOverride:
    """Keep ``override`` in ``budget_overrides`` and its event on the audit trail, in one
    transaction (both or neither); the row kept."""
    record = override_record(override, issued_by)
    with ledger.writing() as cur:
        keep(cur, record, now)
        audit.append(cur, [event], now)
    return record


def keep(cur: duckdb.DuckDBPyConnection, record: BudgetOverride, now: float) -> None:
    """Insert ``record`` into ``budget_overrides``, kept at ``now``, in the caller's transaction."""
    cur.execute(
        "INSERT INTO budget_overrides (override_id, team, admin_reason, until, issued_at, "
        "issued_by, ingested_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [
            record.override_id,
            record.team,
            record.admin_reason,
            record.until,
            record.issued_at,
            record.issued_by,
            now,
        ],
    )


def last_grants(cur: duckdb.DuckDBPyConnection, now: float) -> dict[str, dict[str, Any]]:
    """Per team, the last override billing's admin granted in the last month, ended or not:
    ``{"until", "issued_at", "reason"}``, as ``GET /v1/spend`` carries it.

    The last grant decides, also once it has ended: a sidecar lets a team past its budget only
    while that grant is in force, and takes no earlier grant (its own, Redis's) in its place.
    So a revocation (``minutes`` 0) or a later, shorter grant ends every earlier one, fleet-wide,
    and an earlier, longer one never comes back after it. Rows issued more than a month ago are
    not read: no override lasts longer (``MAX_OVERRIDE_SECONDS``), so none of them can still be
    in force nor shadow one that is.
    """
    rows = cur.execute(
        "SELECT team, until, issued_at, admin_reason FROM budget_overrides "
        "WHERE starts_with(issued_by, $billing) AND issued_at > $since "
        "QUALIFY row_number() OVER (PARTITION BY team ORDER BY issued_at DESC, override_id DESC) = 1",
        {"billing": ISSUED_BY_BILLING, "since": now - MAX_OVERRIDE_SECONDS},
    ).fetchall()
    return {
        team: {"until": until, "issued_at": issued_at, "reason": reason}
        for team, until, issued_at, reason in rows
    }
