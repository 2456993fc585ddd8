"""The audit trail: the services' events in (``POST /v1/ingest/audit``), the admin's reads out.

A service ships its spooled events as any writer ships records: NDJSON with its own credential,
or the lines as on disk (sealed) for billing to open one by one. Each event is kept once (by
``event_id``) with the writer that sent it as its ``source``; a line that does not open, is
not an event, or is an action its writer's role does not record (``infermeter.audit.may_record``:
no pod records a key revoked or a month closed) is answered as rejected with its reason (the
shipper keeps it in ``rejected.jsonl``). A batch of more than ``MAX_BATCH_EVENTS`` lines is a
413 before any line is read. Reading is the admin's: ``GET /v1/audit`` and ``GET /v1/audit.csv``. No
route updates or deletes an event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Final
from urllib.parse import quote

import orjson
import polars as pl
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from billing import audit
from billing.ledger import BatchTooLargeError
from billing.routes.body import read_body
from billing.routes.dependencies import Auditor, Services, ServicesDep
from billing.routes.ingest import Sending
from billing.routes.openapi import CSV, READ, errors, text
from billing.routes.responses import download, json_response
from exporters.chargeback_csv import defuse, write_csv
from infermeter.audit import (
    ACTIONS,
    MAX_BATCH_EVENTS,
    MAX_TEXT,
    AuditEvent,
    AuditEventError,
    may_record,
    parse_event,
)
from infermeter.errors import BadRequest
from infermeter.wire import NDJSON, line_count
from infermeter.writers import SEALED_NDJSON, Writer

__all__ = ["router"]

router = APIRouter()

_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            NDJSON: {"schema": {"type": "string", "description": "One audit event per line."}}
        },
    }
}


@router.post(
    "/v1/ingest/audit", responses=errors(400, 401, 403, 408, 413, 503), openapi_extra=_BODY
)
async def ingest(request: Request, who: Sending, svc: ServicesDep) -> Response:
    """Keep a batch of a service's audit events; answer only after it is committed."""
    b = svc.config.billing
    body = await read_body(request, b.max_body_bytes, b.body_read_timeout_seconds)
    _check_count(line_count(body), b.max_batch_records)
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    lines: list[tuple[int, bytes, Writer | None]]
    if media == SEALED_NDJSON:
        opened = svc.writers.open(body)
        lines = [
            (pos, line, g.writer)
            for g in opened.groups
            for pos, line in zip(g.places, g.records, strict=True)
        ]
        refused = [{"id": f"#{u.pos}", "reason": u.reason} for u in opened.unopened]
    else:
        parts = body.split(b"\n")
        lines = [(pos, line, who.writer) for pos, line in enumerate(parts, start=1) if line.strip()]
        refused = []
    events: list[AuditEvent] = []
    now = time.time()
    for pos, line, writer in lines:
        source = writer.principal if writer is not None else "@ingest"
        try:
            event = parse_event(orjson.loads(line), source, now, b.max_clock_skew_seconds)
        except (orjson.JSONDecodeError, AuditEventError) as exc:
            refused.append({"id": f"#{pos}", "reason": f"not an audit event: {exc}"})
            continue
        if not may_record(writer, event.action):
            role = f"the {writer.role} role" if writer is not None else "no writer"
            reason = f"{role} records no {event.action} event (written by {source})"
            refused.append({"id": f"#{pos}", "reason": reason})
            continue
        events.append(event)
    kept = await run_in_threadpool(_append, svc, events, now)
    return json_response({"kind": "audit", "kept": kept, "rejected": refused, "quarantined": []})


def _check_count(lines: int, max_batch_records: int) -> None:
    """413 for a batch of more lines than an audit batch may hold, before any line is read."""
    if lines > min(MAX_BATCH_EVENTS, max_batch_records):
        limit, why = (
            (max_batch_records, "billing.max_batch_records")
            if max_batch_records < MAX_BATCH_EVENTS
            else (MAX_BATCH_EVENTS, "audit events per batch")
        )
        raise BatchTooLargeError(f"{lines} lines in one audit batch; at most {limit} ({why})")


def _append(svc: Services, events: list[AuditEvent], now: float) -> int:
    with svc.ledger.writing() as cur:
        return audit.append(cur, events, now)


def _range(start: float | None, end: float | None) -> tuple[float, float]:
    end = time.time() if end is None else end
    start = end - 30 * 86_400.0 if start is None else start
    if end <= start:
        raise BadRequest(
            f"the range must have to > from (from={start}, to={end})", code="invalid_value"
        )
    return start, end


def _read(svc: Services, asked: _Reading) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The events asked for, at most ``audit.MAX_READ``, and where the next read begins
    (``{"from", "after"}``: the last event's time and id) when there are more; None when not."""
    unknown = sorted(set(asked.actions) - ACTIONS)
    if unknown:
        raise BadRequest(f"unknown action(s): {', '.join(unknown)}", code="invalid_value")
    with svc.ledger.reader() as cur:
        found = audit.read(
            cur, asked.start, asked.end, asked.actions, audit.MAX_READ + 1, asked.after
        )
    if len(found) <= audit.MAX_READ:
        return found, None
    found = found[: audit.MAX_READ]
    return found, {"from": found[-1]["occurred_at"], "after": found[-1]["event_id"]}


_CSV_SCHEMA: Final = {c: pl.Float64 if c == "occurred_at" else pl.String for c in audit.COLUMNS}
_TEXT: Final = tuple(c for c in audit.COLUMNS if c != "occurred_at")

From = Annotated[float | None, Query(alias="from", allow_inf_nan=False)]
To = Annotated[float | None, Query(alias="to", allow_inf_nan=False)]
After = Annotated[
    str | None,
    Query(
        max_length=MAX_TEXT,
        description="The id of the last event read: events at ``from`` after it in the order "
        "(``next`` of the answer before)",
    ),
]
Actions = Annotated[
    list[str] | None,
    Query(alias="action", json_schema_extra={"items": {"type": "string", "enum": sorted(ACTIONS)}}),
]


@dataclass(frozen=True)
class _Reading:
    """What a read of the trail asks for: its range, actions and where it reads on from."""

    start: float
    end: float
    actions: list[str]
    after: str | None


def _reading(
    start: From = None, end: To = None, action: Actions = None, after: After = None
) -> _Reading:
    start, end = _range(start, end)
    return _Reading(start, end, action or [], after)


Reading = Annotated[_Reading, Depends(_reading)]


@router.get("/v1/audit", responses=errors(400, *READ))
async def read(_: Auditor, svc: ServicesDep, asked: Reading) -> dict[str, Any]:
    """The events of ``from``..``to`` (Unix seconds; default: the last 30 days), oldest first,
    at most 10,000: when there are more, ``next`` holds the ``from`` and ``after`` that read on
    (never a silent cut; ``next`` is null when every event is in the answer)."""
    found, more = await run_in_threadpool(_read, svc, asked)
    return {"from": asked.start, "to": asked.end, "events": found, "next": more}


@router.get("/v1/audit.csv", responses=text(CSV, "The audit trail as CSV.") | errors(400, *READ))
async def export(_: Auditor, svc: ServicesDep, asked: Reading) -> Response:
    """The same events as a CSV file, for an auditor's spreadsheet (cells that a spreadsheet
    would run as a formula are prefixed with ``'``, as in the chargeback's files). When there are more than 10,000, the
    headers ``x-infermeter-next-from`` and ``x-infermeter-next-after`` (percent-encoded) say
    where the next file begins."""
    found, more = await run_in_threadpool(_read, svc, asked)
    frame = pl.DataFrame(found, schema=_CSV_SCHEMA, orient="row")
    # Every text cell a spreadsheet would run as a formula (after blanks, in any width) is
    # defused as in every other export: the trail holds what callers wrote (reasons, names).
    body = write_csv(frame.with_columns(defuse(c) for c in _TEXT))
    response = download(body, f"audit-{int(asked.start)}-{int(asked.end)}.csv")
    if more is not None:
        response.headers["x-infermeter-next-from"] = repr(more["from"])
        # Percent-encoded: an id is any string a writer gave (a header must be plain ASCII).
        response.headers["x-infermeter-next-after"] = quote(more["after"], safe="")
    return response
