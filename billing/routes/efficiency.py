"""``GET /v1/efficiency/{month}``: the efficiency figures and the advisor's plan.

Team-scoped as the query routes are: the admin sees the whole fleet (or one team, with
``team``); a team key sees its own hourly figures and the changes about its own requests
(routing, off-peak), and asking for another team is 403. Replica groups, engine instances,
fleet-wide changes and the notes on what could not be advised span every team, so they are the
admin's. The plan replays the month's requests (``billing.efficiency.plan``): on a busy month
that takes a while, on a statement thread like the statements'.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from billing.efficiency.store import read_report
from billing.routes.dependencies import Month, Reader, Services, ServicesDep, compute
from billing.routes.openapi import READ, errors
from billing.routes.responses import json_response
from infermeter.auth import Caller

__all__ = ["router"]

router = APIRouter()


def _team(who: Caller, team: str | None) -> str | None:
    """The team view ``who`` gets when asking for ``team`` (None: the whole fleet, readers of all)."""
    if who.reads_all:
        return team
    if team is not None and team != who.team:
        who.require_team(team)
    return who.team


def _report(svc: Services, month: str, team: str | None) -> bytes:
    with svc.ledger.reader() as cursor:
        report = read_report(cursor, svc.config, month, time.time(), team)
    return bytes(json_response(report.to_json()).body)


@router.get("/v1/efficiency/{month}", responses=errors(400, *READ))
async def efficiency(
    who: Reader, month: Month, svc: ServicesDep, team: Annotated[str | None, Query()] = None
) -> Response:
    """A month's efficiency figures per replica group, instance, team and hour, and the plan that
    would save money: each change proven by replay, with its saving within the plan, the replay
    (GPU-hours, cost, each team's SLA before and after), evidence and assumptions."""
    body = await compute(svc, _report, svc, month, _team(who, team))
    return Response(body, media_type="application/json")
