"""Imported invoices in the ledger: one row per (month, pool), run on the ledger's cursor.

An import is idempotent: a row the same file already wrote with the same figures is left as it
is (its ``imported_at`` too). Any other file's rows for a (month, pool) replace the ones there,
which is how a re-issued invoice takes the place of the first; a pool the newer file does not
cover keeps its row. A closed month whose rows change is marked dirty, as late records mark it,
so the next statement carries its adjustment.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import duckdb

from billing import audit
from billing.invoices import Invoice
from billing.keeper import Keeper
from infermeter.audit import AuditEvent

__all__ = [
    "COLUMNS",
    "Stored",
    "by_pool",
    "import_invoice",
    "imports",
    "invoice_imports",
    "invoice_rows",
    "invoices",
    "listing",
    "store",
]

COLUMNS: Final = ("month", "pool", "billed_cents", "line_items", "source", "sha256", "imported_at")


@dataclass(frozen=True, slots=True)
class Stored:
    """What an import changed: the (month, pool) rows written, and the closed months made dirty."""

    changed: tuple[tuple[str, str], ...]
    dirty_months: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The import's answer, beside the invoice's totals."""
        return {
            "unchanged": not self.changed,
            "changed": [{"month": m, "pool": p} for m, p in self.changed],
            "dirty_months": list(self.dirty_months),
        }


def store(cur: duckdb.DuckDBPyConnection, invoice: Invoice, now: float) -> Stored:
    """Write ``invoice``'s totals inside the caller's transaction; what changed."""
    kept = {
        (m, p): (c, n, s)
        for m, p, c, n, s in cur.execute(
            "SELECT month, pool, billed_cents, line_items, sha256 FROM invoices "
            "WHERE list_contains(?, month)",
            [sorted({t.month for t in invoice.totals})],
        ).fetchall()
    }
    fresh = [
        t
        for t in invoice.totals
        if kept.get((t.month, t.pool)) != (t.billed_cents, t.line_items, invoice.sha256)
    ]
    if not fresh:
        return Stored((), ())
    cur.executemany(
        "INSERT OR REPLACE INTO invoices (month, pool, billed_cents, line_items, source, sha256, "
        "imported_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [
            [t.month, t.pool, t.billed_cents, t.line_items, invoice.source, invoice.sha256, now]
            for t in fresh
        ],
    )
    months = sorted({t.month for t in fresh})
    dirty = cur.execute(
        "UPDATE months SET dirty = true WHERE closed_at IS NOT NULL AND list_contains(?, month) "
        "RETURNING month",
        [months],
    ).fetchall()
    return Stored(tuple((t.month, t.pool) for t in fresh), tuple(sorted(str(r[0]) for r in dirty)))


def by_pool(cur: duckdb.DuckDBPyConnection, month: str) -> dict[str, int]:
    """``month``'s invoiced cents per pool."""
    found = cur.execute(
        "SELECT pool, billed_cents FROM invoices WHERE month = ? ORDER BY pool", [month]
    ).fetchall()
    return {str(p): int(c) for p, c in found}


def listing(cur: duckdb.DuckDBPyConnection, month: str | None = None) -> list[dict[str, Any]]:
    """The rows, of ``month`` or all, by month and pool."""
    where, params = ("WHERE month = ?", [month]) if month is not None else ("", [])
    found = cur.execute(
        f"SELECT {', '.join(COLUMNS)} FROM invoices {where} ORDER BY month, pool", params
    ).fetchall()
    return [dict(zip(COLUMNS, row, strict=True)) for row in found]


def imports(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Each file whose rows are in force: its months, pools, cents and items, newest first."""
    found = cur.execute(
        "SELECT sha256, any_value(source), max(imported_at), list(DISTINCT month ORDER BY month), "
        "list(DISTINCT pool ORDER BY pool), sum(billed_cents)::BIGINT, sum(line_items)::BIGINT "
        "FROM invoices GROUP BY sha256 ORDER BY max(imported_at) DESC, sha256"
    ).fetchall()
    names = ("sha256", "source", "imported_at", "months", "pools", "billed_cents", "line_items")
    return [dict(zip(names, row, strict=True)) for row in found]


# -- run through the ledger -----------------------------------------------------------------


def import_invoice(
    ledger: Keeper, invoice: Invoice, now: float | None = None, events: Sequence[AuditEvent] = ()
) -> Stored:
    """Keep ``invoice``'s totals per (month, pool), and ``events`` on the audit trail, in one
    transaction (``store``: the same file again changes nothing; a closed month whose rows
    change is marked dirty)."""
    now = time.time() if now is None else now
    with ledger.writing() as cur:
        stored = store(cur, invoice, now)
        audit.append(cur, events, now)
    return stored


def invoices(ledger: Keeper, month: str) -> dict[str, int]:
    """``month``'s invoiced cost per node pool, in whole cents (pools with no invoice absent)."""
    with ledger.reader() as cur:
        return by_pool(cur, month)


def invoice_rows(ledger: Keeper, month: str | None = None) -> list[dict[str, Any]]:
    """The invoice rows in force, of ``month`` or all (``COLUMNS``)."""
    with ledger.reader() as cur:
        return listing(cur, month)


def invoice_imports(ledger: Keeper) -> list[dict[str, Any]]:
    """Each imported file with rows in force: months, pools, cents, items; newest first."""
    with ledger.reader() as cur:
        return imports(cur)
