"""``GET /v1/fleet``: each replica group's live instances and the autoscaler's decisions, at once.

What the Fleet page shows of the fleet's life: the instances live now (from the lifetimes ingest
keeps, ``billing.lifetimes``), each model's latest desired count and the change that set it, and
the decisions of a range for marking charts (``billing.fleet``). Like the instance registry it
spans every team, so the admin and the metrics role may read it; teams may not.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from billing import registry
from billing.fleet import (
    DECISION_COLUMNS,
    MAX_DECISIONS,
    FleetView,
    fleet_view,
    latest_decisions_sql,
    recent_decisions_sql,
)
from billing.ledger import Ledger
from billing.lifetimes import heartbeat_seconds, live_bound
from billing.routes.dependencies import Scraper, ServicesDep
from billing.routes.instances import MAX_INSTANCES
from billing.routes.openapi import errors
from infermeter.config import Config
from infermeter.errors import BadRequest

__all__ = ["DEFAULT_WINDOW_SECONDS", "router"]

router = APIRouter()

# The recent decisions, when no range is asked for: the last day.
DEFAULT_WINDOW_SECONDS = 86_400.0


@router.get("/v1/fleet", responses=errors(400, 401, 403, 422))
async def fleet(
    _: Scraper,
    svc: ServicesDep,
    start: Annotated[float | None, Query(alias="from", allow_inf_nan=False)] = None,
    end: Annotated[float | None, Query(alias="to", allow_inf_nan=False)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_DECISIONS)] = 200,
) -> FleetView:
    """Models, replica groups with their live instances, and the decisions of ``from``..``to``.

    The range (Unix seconds; default: the last day) only bounds the recent decisions, newest
    first and at most ``limit``; each model's latest decision is its latest whenever made.
    """
    now = time.time()
    end = now if end is None else end
    start = end - DEFAULT_WINDOW_SECONDS if start is None else start
    if end <= start:
        raise BadRequest(
            f"the range must have to > from (from={start}, to={end})", code="invalid_value"
        )
    return await run_in_threadpool(_read, svc.ledger, svc.config, now, start, end, limit)


def _read(
    ledger: Ledger, config: Config, now: float, start: float, end: float, limit: int
) -> FleetView:
    live = registry.lifetimes(
        ledger,
        now,
        heartbeat_seconds(config),
        "live",
        limit=MAX_INSTANCES,
        bound=live_bound(config),
    )
    sql, params = recent_decisions_sql(start, end, limit + 1)
    with ledger.reader() as cur:
        latest = _rows(cur.execute(latest_decisions_sql()).fetchall())
        recent = _rows(cur.execute(sql, params).fetchall())
    window = (start, end, len(recent) > limit)
    return fleet_view(config, live, latest, recent[:limit], window, now)


def _rows(rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [dict(zip(DECISION_COLUMNS, row, strict=True)) for row in rows]
