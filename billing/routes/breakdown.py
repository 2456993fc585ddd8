"""A month's statement below the team: its lines split by project and end user.

``GET /v1/chargeback/{month}/breakdown``: a reader of every team (admin, finance, viewer) gets
every team's rows, a team (a member's or a lead's key, or person) only its own team's; the
metrics, ingest and spend_reader roles none. Rows are ``billing.breakdown.BREAKDOWN_SCHEMA``,
from the same cached statement as the other statement routes, and at most ``limit`` of them
(``truncated`` says when more there were): users past a team's ``max_users`` are already one
"(other users)" row per line and project.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from billing.breakdown import Breakdowns, ProjectSpends
from billing.routes.dependencies import Month, Reader, Services, ServicesDep, compute
from billing.routes.openapi import READ, errors
from billing.routes.responses import json_response
from billing.statement_cache import Cached

__all__ = ["MAX_ROWS", "router", "with_projects"]

router = APIRouter()
T = TypeVar("T")

# What one answer may carry; a fleet's month is far below it unless teams have very many
# projects (each team's users are bounded by its max_users already).
MAX_ROWS = 50_000


@router.get("/v1/chargeback/{month}/breakdown", responses=errors(400, *READ))
async def chargeback_breakdown(
    who: Reader,
    month: Month,
    svc: ServicesDep,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_ROWS)] = 10_000,
) -> Response:
    """The month's lines by team, model, project and user: every team's for a reader of every
    team, its own for a team."""
    entry = await compute(svc, svc.statements.cached, month)
    memo = _memo(request, "breakdowns", Breakdowns)
    rows = await compute(svc, memo.of, svc.ledger, entry.statement, svc.config, who.scope)
    body: dict[str, Any] = {
        "month": month,
        "as_of": entry.as_of,
        "rows": rows.head(limit).to_dicts(),
        "total_rows": rows.height,
        "truncated": rows.height > limit,
    }
    return json_response(body)


async def with_projects(
    request: Request, svc: Services, entry: Cached, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``/v1/spend``'s rows, each team that budgets its projects with ``projects`` (project ->
    USD spent this month). A key the rows had before is never changed, so a sidecar of the
    previous version reads the answer as it did."""
    if not any(t.project_budgets_usd_per_month for t in svc.config.teams):
        return rows
    memo = _memo(request, "project_spends", ProjectSpends)
    projects = await compute(svc, memo.of, svc.ledger, entry.statement, svc.config)
    return [
        row | {"projects": projects[row["team"]]} if row["team"] in projects else row
        for row in rows
    ]


def _memo(request: Request, name: str, kind: type[T]) -> T:
    """The app's ``kind`` memo (on ``app.state``), made at first use: two made at once only
    compute one statement's rows twice."""
    state = request.app.state
    memo: T | None = getattr(state, name, None)
    if memo is None:
        memo = kind()
        setattr(state, name, memo)
    return memo
