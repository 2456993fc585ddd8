"""Statements and what is made of them: months, closing, the JSON, CSV and FOCUS files, spend.

The admin sees every team's lines; a team sees its own (the same rule for the JSON and for
the files); the metrics and ingest roles see none. Months, closing and the Parquet export of
the whole ledger are the admin's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from billing.routes.dependencies import Manager, Month, Reader, Services, ServicesDep, compute
from billing.routes.openapi import CSV, READ, errors, text
from billing.routes.responses import download, fields_of, json_response
from exporters.chargeback_csv import chargeback_frame, write_csv
from exporters.focus import focus_frame
from infermeter.auth import Caller
from infermeter.statement import Statement, for_team, statement_json

__all__ = ["router"]

router = APIRouter()


async def _statement(svc: Services, month: str, who: Caller) -> Statement:
    """``month``'s statement computed now, as ``who`` may see it.

    Computed through the statement cache, which keeps it: requests for a month already being
    computed share that computation instead of starting their own.
    """
    return for_team(await compute(svc, svc.statements.recompute, month), who.team)


@router.get("/v1/months", responses=errors(*READ))
async def months(_: Manager, svc: ServicesDep) -> list[dict[str, Any]]:
    """Months the ledger has data for, and whether each is closed (admin)."""
    return await run_in_threadpool(svc.ledger.months)


@router.post("/v1/months/{month}/close", responses=errors(400, *READ, 409))
async def close(_: Manager, month: Month, svc: ServicesDep) -> dict[str, Any]:
    """Freeze a month's statement (admin)."""
    statement = await compute(svc, svc.chargeback.close, month)
    await compute(svc, svc.statements.recompute, month)
    return statement_json(statement, None)


# Declared before ``{month}.csv``, which would otherwise take "2026-12.focus.csv" with the
# month "2026-12.focus" (routes match in order and a path parameter takes any text).
@router.get("/v1/chargeback/{month}.focus.csv",
            responses=text(CSV, "The FOCUS file.") | errors(400, *READ))  # fmt: skip
async def chargeback_focus(who: Reader, month: Month, svc: ServicesDep,
                           version: Annotated[str, Query(pattern=r"^1\.[02]$")] = "1.0") -> Response:  # fmt: skip
    """The FinOps FOCUS file, a row per line and instance: every line for the admin, a team's own for a team."""
    statement = await _statement(svc, month, who)
    statement = await compute(svc, svc.chargeback.by_instance, statement)
    text = write_csv(focus_frame(statement, svc.config, version))
    return download(text, f"focus-{version}-{month}.csv")


@router.get("/v1/chargeback/{month}.csv",
            responses=text(CSV, "The chargeback CSV.") | errors(400, *READ))  # fmt: skip
async def chargeback_csv(who: Reader, month: Month, svc: ServicesDep) -> Response:
    """The chargeback CSV: every line for the admin, a team's own lines for a team."""
    statement = await _statement(svc, month, who)
    budgets = {t.name: t.budget_usd_per_month for t in svc.config.teams}
    return download(write_csv(chargeback_frame(statement, budgets)), f"chargeback-{month}.csv")


@router.get("/v1/chargeback/{month}", responses=errors(400, *READ))
async def chargeback_json(who: Reader, month: Month, svc: ServicesDep) -> Response:
    """A month's statement: every line for the admin, a team's own lines for a team."""
    statement = await compute(svc, svc.statements.recompute, month)
    return json_response(statement_json(statement, who.team))


@router.get("/v1/spend", responses=errors(*READ))
async def spend(who: Reader, svc: ServicesDep) -> list[dict[str, Any]]:
    """Month-to-date spend, budget and forecast: every team for the admin, its own for a team."""
    rows = await compute(svc, svc.chargeback.spend)
    return [fields_of(s) for s in rows if who.is_admin or s.team == who.team]


@router.post("/v1/admin/export", responses=errors(*READ))
async def export(_: Manager, svc: ServicesDep, partitioned: bool = False) -> dict[str, Any]:
    """Write the whole ledger to Parquet under ``billing.export_dir`` (admin)."""
    stamp = time.strftime("ledger-%Y%m%dT%H%M%SZ", time.gmtime())
    target = Path(svc.config.billing.export_dir) / stamp
    paths = await run_in_threadpool(svc.ledger.export_parquet, target, partitioned)
    return {"directory": str(target), "tables": [p.name for p in paths]}
