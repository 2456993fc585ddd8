"""``GET /v1/usage/records``: a usage record found by any id its request is known by.

The sidecar's ``request_id``, vLLM's response id (``chatcmpl-...``) and the caller's own
``x-request-id`` each find the record (``billing.lookup``). A team key sees only its own team's
records, so an id of another team's request finds nothing rather than a 403: whether an id
exists elsewhere is not the team's to learn. A reader of every team (admin, finance, viewer) sees every team's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from fastapi import APIRouter, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from billing import archive
from billing.ledger import Ledger
from billing.lookup import ID_FIELDS, MAX_ID_CHARS, MAX_RECORDS, Lookup, lookup_sql
from billing.routes.dependencies import Reader, ServicesDep
from billing.routes.openapi import READ, errors, usage_records
from billing.routes.responses import json_response
from infermeter.records import USAGE

__all__ = ["router"]

router = APIRouter()

By = Literal["any", "request_id", "response_id", "client_request_id"]
assert set(get_args(By)) == {"any", *ID_FIELDS}


@router.get("/v1/usage/records", responses=usage_records() | errors(*READ))
async def usage_records_by_id(
    who: Reader,
    svc: ServicesDep,
    id: Annotated[str, Query(min_length=1, max_length=MAX_ID_CHARS)],
    by: Annotated[By, Query()] = "any",
    limit: Annotated[int, Query(ge=1, le=MAX_RECORDS)] = 20,
) -> Response:
    """The usage records whose ``by`` id (any of the three, by default) is ``id``, newest first."""
    lookup = Lookup(id, by, who.scope, limit)
    rows = await run_in_threadpool(_run, svc.ledger, lookup)
    return json_response({"records": rows})


def _run(ledger: Ledger, lookup: Lookup) -> list[dict[str, Any]]:
    """The ledger's records, and the archive's too when the ledger has fewer than ``limit``:
    archived records are older than what the ledger holds, and reading the archive scans it."""
    sql, params = lookup_sql(lookup)
    names = [f.name for f in USAGE.fields]
    with ledger.reader() as cursor:
        rows = cursor.execute(sql, params).fetchall()
    if len(rows) < lookup.limit and archive.archived_files(ledger):
        with archive.reader(ledger) as cursor:  # records that left for the archive too
            rows = cursor.execute(sql, params).fetchall()
    return [dict(zip(names, row, strict=True)) for row in rows]
