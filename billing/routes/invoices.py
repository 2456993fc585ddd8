"""``/v1/invoices``: a cloud provider's FOCUS billing export, imported and matched to node pools.

The body is the file itself (CSV or Parquet, told by ``format``, else by the content type, else
by the ``source`` name's suffix), at most ``billing.max_body_bytes``. Importing is the admin's
and finance's (as closing a month is), audited in the transaction that keeps the rows; the rows
in force are for the readers of every team.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from billing import invoice_store
from billing.invoices import Format, format_for, parse_invoice
from billing.routes.body import read_body
from billing.routes.dependencies import AllReader, Closer, ServicesDep
from billing.routes.openapi import READ, errors
from infermeter.audit import audit_event
from infermeter.errors import BadRequest
from infermeter.months import MONTH_PATTERN

__all__ = ["router"]

router = APIRouter()

_TYPES: Final[dict[str, Format]] = {
    "text/csv": "csv",
    "application/csv": "csv",
    "application/vnd.apache.parquet": "parquet",
    "application/x-parquet": "parquet",
    "application/parquet": "parquet",
}
_EXTRA = {
    "requestBody": {
        "required": True,
        "content": {
            "text/csv": {"schema": {"type": "string", "minLength": 1}},
            "application/vnd.apache.parquet": {
                "schema": {"type": "string", "format": "binary", "minLength": 1}
            },
        },
    }
}


def _format(request: Request, explicit: str | None, source: str) -> Format:
    """The body's format: ``format``, else its content type, else ``source``'s suffix."""
    if explicit is not None:
        return format_for(source, explicit)
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    found = _TYPES.get(media)
    if found is not None:
        return found
    if source.lower().endswith((".csv", ".parquet", ".pq")):
        return format_for(source)
    raise BadRequest(
        f"content type {media or '(none)'!r}: send text/csv or "
        "application/vnd.apache.parquet, or say format=csv|parquet",
        code="invalid_invoice",
    )


@router.post("/v1/invoices", responses=errors(400, *READ, 408, 413), openapi_extra=_EXTRA)
async def import_invoice(
    who: Closer,
    request: Request,
    svc: ServicesDep,
    fmt: Annotated[Literal["csv", "parquet"] | None, Query(alias="format")] = None,
    source: Annotated[str, Query(min_length=1, max_length=256)] = "upload",
    include_tax: bool = False,
) -> dict[str, Any]:
    """Import a FOCUS billing export (admin, finance): its totals per month and pool, what no
    pool claimed, and which rows changed (none when the same file was imported before)."""
    kind = _format(request, fmt, source)
    b = svc.config.billing
    body = await read_body(request, b.max_body_bytes, b.body_read_timeout_seconds)
    if not body:
        raise BadRequest("the body is empty: send the invoice file", code="invalid_invoice")
    invoice = await run_in_threadpool(
        lambda: parse_invoice(body, source, svc.config.prices.pools, kind, include_tax=include_tax)
    )
    months = sorted({t.month for t in invoice.totals})
    event = audit_event(
        "invoice.imported",
        who.who,
        who.role,
        "billing",
        target=f"invoice:{invoice.sha256}",
        detail={
            "source": source,
            "rows": invoice.rows,
            "months": months[:24],
            "billed_cents": sum(t.billed_cents for t in invoice.totals),
            "unmatched_cents": invoice.unmatched.billed_cents,
        },
        address=request.client.host if request.client else None,
    )
    stored = await run_in_threadpool(
        invoice_store.import_invoice, svc.ledger, invoice, time.time(), [event]
    )
    svc.statements.forget()  # the next statement is on the invoice's basis, not a kept one
    return invoice.to_json() | stored.to_json()


@router.get("/v1/invoices", responses=errors(*READ))
async def invoices(
    _: AllReader,
    svc: ServicesDep,
    month: Annotated[str | None, Query(pattern=MONTH_PATTERN)] = None,
) -> dict[str, Any]:
    """The invoice rows in force per month and pool (of ``month``, or all), and the files they
    came from (readers of every team)."""
    rows = await run_in_threadpool(invoice_store.invoice_rows, svc.ledger, month)
    imports = await run_in_threadpool(invoice_store.invoice_imports, svc.ledger)
    return {"invoices": rows, "imports": imports}
