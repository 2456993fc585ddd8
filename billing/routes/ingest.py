"""``POST /v1/ingest`` and ``/v1/ingest/{kind}``: batches from the shippers, kept before the answer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from billing.ledger import IngestResult
from billing.routes.body import read_body
from billing.routes.dependencies import Ingester, Services, ServicesDep
from billing.routes.openapi import INGEST_BODY, KIND_BODY, errors
from billing.routes.responses import json_response
from infermeter.records import KINDS
from infermeter.wire import ARROW_STREAM

__all__ = ["router"]

log = logging.getLogger("infermeter.billing")

router = APIRouter()

# Documented as the kinds there are; an unknown kind is still the ledger's 400.
Kind = Annotated[str, Path(json_schema_extra={"enum": list(KINDS)})]


async def _keep(keep: Callable[..., IngestResult], *args: Any) -> IngestResult:
    """Run a ledger ingest call in a worker thread (DuckDB blocks).

    A body that is not a batch of the kind is ``BadRequest`` from the ledger (400); any other
    exception is a fault of the service and stays one (500).
    """
    return await run_in_threadpool(keep, *args)


def _acknowledge(svc: Services, result: IngestResult, wire_format: str) -> Response:
    svc.ingest_counters.count(result, wire_format)
    if result.rejected:
        log.warning("ingest: %d %s record(s) rejected, first: %s", len(result.rejected),
                    result.kind, result.rejected[0].reason)  # fmt: skip
    return json_response(result.to_json())


@router.post(
    "/v1/ingest", responses=errors(400, 401, 403, 408, 413, 503), openapi_extra=INGEST_BODY
)
async def ingest(request: Request, _: Ingester, svc: ServicesDep) -> Response:
    """Keep a batch of usage records or samples; answer only after it is committed."""
    b = svc.config.billing
    body = await read_body(request, b.max_body_bytes, b.body_read_timeout_seconds)
    result = await _keep(
        svc.ledger.ingest, body, None, b.max_clock_skew_seconds, b.max_batch_records
    )
    return _acknowledge(svc, result, "json")


@router.post("/v1/ingest/{kind}", responses=errors(400, 401, 403, 408, 413, 422, 503),
             openapi_extra=KIND_BODY)  # fmt: skip
async def ingest_batch(kind: Kind, request: Request, _: Ingester, svc: ServicesDep) -> Response:
    """Keep a batch of ``kind`` records as shippers send it: an Arrow IPC stream, or NDJSON.

    Same answer as ``/v1/ingest``. NDJSON is checked record by record when it must be (a
    line that is not JSON is one rejected record); an Arrow stream whose schema is not the
    kind's is refused whole (400).
    """
    content_type = request.headers.get("content-type", "")
    arrow = content_type.split(";")[0].strip().lower() == ARROW_STREAM
    ledger = svc.ledger
    b = svc.config.billing
    # Announced before the body arrives: a transaction about to start small waits briefly
    # for batches still on the wire (group commit), which matters when many shippers send
    # small batches at once.
    with ledger.announce() as ticket:
        body = await read_body(request, b.max_body_bytes, b.body_read_timeout_seconds)
        if arrow:
            result = await _keep(ledger.ingest_arrow, kind, body, None, b.max_clock_skew_seconds,
                                 b.max_batch_records, ticket, b.max_body_bytes)  # fmt: skip
        else:
            result = await _keep(ledger.ingest_lines, kind, body, None,
                                 b.max_clock_skew_seconds, b.max_batch_records, ticket)  # fmt: skip
    return _acknowledge(svc, result, "arrow" if arrow else "ndjson")
