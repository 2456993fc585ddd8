"""Statements and what is made of them: months, closing, the JSON, CSV and FOCUS files, spend.

A reader of every team (admin, finance, viewer) sees every team's lines; a team sees its own
(the same rule for the JSON and for the files); the metrics, ingest and spend_reader roles see
none. The months are for readers of every team, closing one is the admin's and finance's (and
audited), the Parquet export of the whole ledger the admin's. Spend is also the sidecars'
(spend_reader).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from billing import audit, closing, parquet_export
from billing.breakdown import with_tags
from billing.routes.breakdown import with_projects
from billing.routes.dependencies import (
    AllReader,
    Closer,
    Manager,
    Month,
    Reader,
    Services,
    ServicesDep,
    Spender,
    compute,
)
from billing.routes.openapi import CSV, READ, errors, text
from billing.routes.overrides import with_overrides
from billing.routes.responses import download, json_response, spend_rows
from exporters.chargeback_csv import chargeback_frame, write_csv
from exporters.focus import focus_frame
from infermeter.audit import AuditEvent, audit_event
from infermeter.auth import Caller
from infermeter.statement import Statement, for_team, statement_json

__all__ = ["router"]

router = APIRouter()


async def _statement(svc: Services, month: str, who: Caller) -> Statement:
    """``month``'s statement as ``who`` may see it, at most ``billing.statement_ttl_seconds`` old.

    Read through the statement cache: the files, the pages and ``/v1/spend`` within one refresh
    are made from one computation, and requests for a month being computed share it.
    """
    return for_team(await compute(svc, svc.statements.statement, month), who.team)


@router.get("/v1/months", responses=errors(*READ))
async def months(_: AllReader, svc: ServicesDep) -> list[dict[str, Any]]:
    """Months the ledger has data for, and whether each is closed (readers of every team)."""
    return await run_in_threadpool(closing.months, svc.ledger)


@router.post("/v1/months/{month}/close", responses=errors(400, *READ, 409))
async def close(who: Closer, month: Month, svc: ServicesDep, request: Request) -> dict[str, Any]:
    """Freeze a month's statement (admin, finance); the close is on the audit trail."""
    statement = await compute(svc, svc.chargeback.close, month)
    await compute(svc, svc.statements.recompute, month)
    address = request.client.host if request.client else None
    event = audit_event(
        "month.closed",
        who.who,
        who.role,
        "billing",
        target=f"month:{month}",
        detail={"total_cents": statement.total_cents},
        address=address,
    )
    await run_in_threadpool(_audited, svc, event)
    return statement_json(statement, None)


def _audited(svc: Services, event: AuditEvent) -> None:
    with svc.ledger.writing() as cur:
        audit.append(cur, [event], time.time())


# Declared before ``{month}.csv``, which would otherwise take "2026-12.focus.csv" with the
# month "2026-12.focus" (routes match in order and a path parameter takes any text).
@router.get(
    "/v1/chargeback/{month}.focus.csv", responses=text(CSV, "The FOCUS file.") | errors(400, *READ)
)
async def chargeback_focus(
    who: Reader,
    month: Month,
    svc: ServicesDep,
    version: Annotated[str, Query(pattern=r"^1\.[023]$")] = "1.0",
) -> Response:
    """The FinOps FOCUS file, a row per line and instance: every line for the admin, a team's own
    for a team (cut from the whole file: its allocation ratios are of the instances' whole cost)."""
    statement = await compute(svc, svc.statements.statement, month)
    statement = await compute(svc, svc.chargeback.by_instance, statement)
    statement = await compute(svc, with_tags, svc.ledger, statement, svc.config)
    text = write_csv(focus_frame(statement, svc.config, version, who.team))
    return download(text, f"focus-{version}-{month}.csv")


@router.get(
    "/v1/chargeback/{month}.csv", responses=text(CSV, "The chargeback CSV.") | errors(400, *READ)
)
async def chargeback_csv(who: Reader, month: Month, svc: ServicesDep) -> Response:
    """The chargeback CSV: every line for the admin, a team's own lines for a team."""
    statement = await _statement(svc, month, who)
    if svc.config.prices.pools:  # a row per node pool a line ran in (the file sums instances)
        statement = await compute(svc, svc.chargeback.by_instance, statement)
    statement = await compute(svc, with_tags, svc.ledger, statement, svc.config)  # and project
    budgets = {t.name: t.budget_usd_per_month for t in svc.config.teams}
    return download(write_csv(chargeback_frame(statement, budgets)), f"chargeback-{month}.csv")


@router.get("/v1/chargeback/{month}", responses=errors(400, *READ))
async def chargeback_json(who: Reader, month: Month, svc: ServicesDep) -> Response:
    """A month's statement computed now: every line for the admin, a team's own lines for a team."""
    entry = await compute(svc, svc.statements.compute, month)
    return json_response(statement_json(entry.statement, who.team) | {"as_of": entry.as_of})


@router.get("/v1/spend", responses=errors(*READ))
async def spend(who: Spender, svc: ServicesDep, request: Request) -> list[dict[str, Any]]:
    """Month-to-date spend, budget and forecast: every team for readers of every team and the
    sidecars' spend_reader, its own for a team.

    From the cached statement of the month, at most ``billing.statement_ttl_seconds`` old (the
    sidecars of a large fleet all ask for it). Each row's ``as_of`` is when the ledger was read;
    the forecast is extrapolated from then. A team that budgets its projects has ``projects``
    too: USD per project (``billing.breakdown``), what the sidecars refuse a project by. A team
    billing's admin granted an override in the last month has ``override`` too, the last one,
    ended or not (``billing.overrides.last_grants``: an ended one ends the earlier ones): read
    from the ledger at each ask, so every sidecar takes a grant or a revocation at its next
    refresh.
    """
    entry = await compute(svc, svc.statements.current)
    rows = await with_projects(request, svc, entry, spend_rows(entry, svc.config, who.team))
    return await with_overrides(svc, rows)


@router.post("/v1/admin/export", responses=errors(*READ))
async def export(_: Manager, svc: ServicesDep, partitioned: bool = False) -> dict[str, Any]:
    """Write the whole ledger to Parquet under ``billing.export_dir`` (admin)."""
    stamp = time.strftime("ledger-%Y%m%dT%H%M%SZ", time.gmtime())
    target = Path(svc.config.billing.export_dir) / stamp
    paths = await run_in_threadpool(parquet_export.export_parquet, svc.ledger, target, partitioned)
    return {"directory": str(target), "tables": [p.name for p in paths]}
