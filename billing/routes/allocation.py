"""``GET /v1/allocation[.csv]``: the allocation explorer, over the months' statements.

Read-only. The admin sees every team; a team key sees its own team's cells only (asking to
filter on another team is 403). A window of whole months gives the statement's lines, to the
cent (``billing.explorer_view``); the answer says, per month, when the ledger was read for it
(``as_of``), whether it is closed and the adjustments for earlier months its statement also
carries, which are no use of the window.

Query parameters: ``from`` and ``to`` (Unix seconds, widened to whole hours; default: the month
so far), ``by`` (one or two of team, model, replica, instance, node, gpu_model, comma-separated;
default team), and any key again as a filter, repeatable (``?model=chat-small&node=node-a``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from billing.explorer import KEYS
from billing.explorer_cache import Month
from billing.explorer_view import ExplorerQuery, View, csv_text, months_of, view
from billing.queries import FIRST_SECOND, LAST_SECOND
from billing.routes.dependencies import Reader, ServicesDep, compute
from billing.routes.openapi import CSV, READ, errors, text
from billing.routes.responses import download, json_response
from infermeter.auth import Caller
from infermeter.errors import BadRequest
from infermeter.months import month_bounds, month_of

__all__ = ["router"]

router = APIRouter()

# The window's ends (``billing.queries.FIRST_SECOND``..``LAST_SECOND``); anything else is a 422
# naming the parameter, not a date no calendar holds.
From = Annotated[float | None, Query(alias="from", ge=FIRST_SECOND, le=LAST_SECOND)]
To = Annotated[float | None, Query(alias="to", ge=FIRST_SECOND, le=LAST_SECOND)]


def _query(
    who: Caller, request: Request, start: float | None, end: float | None, by: str
) -> ExplorerQuery:
    """The checked query: the caller's scope, the window, the grouping and the filters."""
    now = time.time()
    end = now if end is None else end
    if start is None:
        # The month ``to`` falls in, from no earlier than the calendar served.
        start = max(FIRST_SECOND, month_bounds(month_of(end - 1e-6))[0])
    filters = {k: request.query_params.getlist(k) for k in KEYS if k in request.query_params}
    team = who.scope
    for asked in filters.get("team", []):
        if team is not None and asked != team:
            who.require_team(asked)
    try:
        return ExplorerQuery.checked(
            start, end, [b.strip() for b in by.split(",") if b.strip()], filters, team
        )
    except ValueError as exc:
        raise BadRequest(str(exc), code="invalid_value") from None


async def _view(svc: Any, query: ExplorerQuery) -> tuple[View, list[Month]]:
    months = [await compute(svc, svc.explorer.get, m) for m in months_of(query)]
    return view([m.cells for m in months], query), months


def _month(month: Month, team: str | None) -> dict[str, Any]:
    adjust = month.adjustments if team is None else {team: month.adjustments.get(team, 0)}
    return {
        "month": month.month,
        "as_of": month.as_of,
        "closed": month.closed,
        "adjustment_cents": sum(adjust.values()),
    }


@router.get(
    "/v1/allocation.csv", responses=text(CSV, "The rows shown, as CSV.") | errors(400, *READ)
)
async def allocation_csv(
    who: Reader,
    svc: ServicesDep,
    request: Request,
    start: From = None,
    end: To = None,
    by: str = "team",
) -> Response:
    """The explorer's rows for the window and their total, as a spreadsheet-safe CSV file."""
    query = _query(who, request, start, end, by)
    shown, _ = await _view(svc, query)
    first, last = query.first_hour * 3600, query.end_hour * 3600
    return download(csv_text(shown, first, last), f"allocation-{'-'.join(query.by)}.csv")


@router.get("/v1/allocation", responses=errors(400, *READ))
async def allocation(
    who: Reader,
    svc: ServicesDep,
    request: Request,
    start: From = None,
    end: To = None,
    by: str = "team",
) -> Response:
    """Cost, GPU-hours, tokens, efficiency and idle per group over the window, with its total,
    the cost of each group over time (``series``), the values each key takes (``values``) and
    the CSV file of the rows (``csv``)."""
    query = _query(who, request, start, end, by)
    shown, months = await _view(svc, query)
    first, last = query.first_hour * 3600, query.end_hour * 3600
    body = {
        "from": first,
        "to": last,
        "by": list(query.by),
        "filters": {k: sorted(v) for k, v in query.filters.items()},
        "team": query.team,
        "months": [_month(m, query.team) for m in months],
        "as_of": min((m.as_of for m in months), default=time.time()),
        "columns": shown.rows.columns,
        "rows": shown.rows.rows(),
        "total": shown.total,
        "step": query.step,
        "series": {"columns": shown.series.columns, "rows": shown.series.rows()},
        "values": shown.values,
        "csv": csv_text(shown, first, last),
    }
    return json_response(body)
