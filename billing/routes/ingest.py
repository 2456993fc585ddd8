"""``POST /v1/ingest`` and ``/v1/ingest/{kind}``: batches from the shippers, kept before the answer.

Each request is sent by a writer (``billing.writers``), and its records are checked against it
as the ledger keeps them. A batch of sealed lines (``SEALED_NDJSON``) is opened line by line
first: each writer's records are kept under that writer, the lines that do not open quarantined.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from billing.ledger import IngestResult
from billing.routes.body import read_body
from billing.routes.dependencies import Services, ServicesDep
from billing.routes.openapi import INGEST_BODY, KIND_BODY, errors
from billing.routes.responses import json_response
from billing.writers import Sender, merge
from infermeter.errors import BadRequest
from infermeter.records import KINDS
from infermeter.wire import ARROW_STREAM
from infermeter.writers import SEALED_NDJSON

__all__ = ["router"]

log = logging.getLogger("infermeter.billing")

router = APIRouter()

# Documented as the kinds there are; an unknown kind is still the ledger's 400.
Kind = Annotated[str, Path(json_schema_extra={"enum": list(KINDS)})]


def sender(svc: ServicesDep, authorization: Annotated[str | None, Header()] = None) -> Sender:
    """Who sends the batch: a writer's credential, or the shared ingest token where it is taken."""
    return svc.writers.sender(authorization)


Sending = Annotated[Sender, Depends(sender)]


async def _keep(keep: Callable[..., IngestResult], *args: Any) -> IngestResult:
    """Run a ledger ingest call in a worker thread (DuckDB blocks).

    A body that is not a batch of the kind is ``BadRequest`` from the ledger (400); any other
    exception is a fault of the service and stays one (500).
    """
    return await run_in_threadpool(keep, *args)


def _acknowledge(svc: Services, result: IngestResult, wire_format: str) -> Response:
    svc.ingest_counters.count(result, wire_format)
    if result.rejected:
        log.warning(
            "ingest: %d %s record(s) rejected, first: %s",
            len(result.rejected),
            result.kind,
            result.rejected[0].reason,
        )
    if result.quarantined:
        log.warning(
            "ingest: %d %s record(s) quarantined, first: %s",
            len(result.quarantined),
            result.kind,
            result.quarantined[0].reason,
        )
    return json_response(result.to_json())


def _sealed(svc: Services, kind: str, body: bytes, who: Sender) -> IngestResult:
    """Keep a batch of sealed lines: each writer's records as that writer's, the rest quarantined."""
    b, ledger = svc.config.billing, svc.ledger
    opened = svc.writers.open(body)
    parts = [
        (
            ledger.ingest_lines(
                kind,
                group.body,
                None,
                b.max_clock_skew_seconds,
                b.max_batch_records,
                writer=group.writer,
            ),
            group.places,
        )
        for group in opened.groups
    ]
    unopened = ledger.quarantine_lines(kind, opened.unopened, who.writer)
    return merge(kind, parts, unopened)


@router.post(
    "/v1/ingest", responses=errors(400, 401, 403, 408, 413, 503), openapi_extra=INGEST_BODY
)
async def ingest(request: Request, who: Sending, svc: ServicesDep) -> Response:
    """Keep a batch of usage records or samples; answer only after it is committed."""
    b = svc.config.billing
    body = await read_body(request, b.max_body_bytes, b.body_read_timeout_seconds)
    result = await _keep(
        svc.ledger.ingest, body, None, b.max_clock_skew_seconds, b.max_batch_records, who.writer
    )
    return _acknowledge(svc, result, "json")


@router.post(
    "/v1/ingest/{kind}",
    responses=errors(400, 401, 403, 408, 413, 422, 503),
    openapi_extra=KIND_BODY,
)
async def ingest_batch(kind: Kind, request: Request, who: Sending, svc: ServicesDep) -> Response:
    """Keep a batch of ``kind`` records as shippers send it: an Arrow IPC stream, NDJSON, or
    sealed NDJSON (a spool's lines as they are on disk).

    Same answer as ``/v1/ingest``. NDJSON is checked record by record when it must be (a
    line that is not JSON is one rejected record); an Arrow stream whose schema is not the
    kind's is refused whole (400).
    """
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    arrow = media == ARROW_STREAM
    ledger = svc.ledger
    b = svc.config.billing
    if media == SEALED_NDJSON:
        if kind not in ledger.kinds:  # a 400 before the body is read, as for the other formats
            raise BadRequest(
                f"unknown record kind {kind!r}; one of: {', '.join(ledger.kinds)}",
                code="invalid_value",
            )
        body = await read_body(request, b.max_body_bytes, b.body_read_timeout_seconds)
        result = await _keep(_sealed, svc, kind, body, who)
        return _acknowledge(svc, result, "sealed")
    # Announced before the body arrives: a transaction about to start small waits briefly
    # for batches still on the wire (group commit), which matters when many shippers send
    # small batches at once.
    with ledger.announce() as ticket:
        body = await read_body(request, b.max_body_bytes, b.body_read_timeout_seconds)
        if arrow:
            result = await _keep(
                ledger.ingest_arrow,
                kind,
                body,
                None,
                b.max_clock_skew_seconds,
                b.max_batch_records,
                ticket,
                b.max_body_bytes,
                who.writer,
            )
        else:
            result = await _keep(
                ledger.ingest_lines,
                kind,
                body,
                None,
                b.max_clock_skew_seconds,
                b.max_batch_records,
                ticket,
                who.writer,
            )
    return _acknowledge(svc, result, "arrow" if arrow else "ndjson")
