"""``GET /v1/events``: what happened to the fleet and its money in a range, for marking charts.

Each event has a time (``at``, Unix seconds), a ``kind``, a one-line ``title`` and a ``detail``
that says why:

- ``scale_up`` / ``scale_down``: the autoscaler changed a model's desired count
  (``scaling_decisions``); the detail is the policy's reasons. Fleet-wide: readers of all only.
- ``month_close``: a month's statement was frozen (``months.closed_at``); any caller.
- ``price_change``: the price book changed. The price book (``prices``) carries no dates, so
  there are none; ``price_changes`` in the answer says so.

Alerts that fired come from Prometheus, which the dashboard asks itself (``dashboard.prometheus_url``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Final

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from billing.fleet import MAX_DECISIONS, recent_decisions_sql
from billing.ledger import Ledger
from billing.routes.dependencies import Reader, ServicesDep
from billing.routes.openapi import READ, errors
from infermeter.errors import BadRequest

__all__ = ["NO_PRICE_CHANGES", "router"]

router = APIRouter()

NO_PRICE_CHANGES: Final = "none: the price book (prices) carries no dates"


@router.get("/v1/events", responses=errors(400, *READ))
async def events(
    who: Reader,
    svc: ServicesDep,
    start: Annotated[float | None, Query(alias="from", allow_inf_nan=False)] = None,
    end: Annotated[float | None, Query(alias="to", allow_inf_nan=False)] = None,
) -> dict[str, Any]:
    """The events of ``from``..``to`` (Unix seconds; default: the last day), oldest first."""
    end = time.time() if end is None else end
    start = end - 86_400.0 if start is None else start
    if end <= start:
        raise BadRequest(
            f"the range must have to > from (from={start}, to={end})", code="invalid_value"
        )
    found = await run_in_threadpool(_read, svc.ledger, start, end, who.reads_all)
    return {"from": start, "to": end, "events": found, "price_changes": NO_PRICE_CHANGES}


def _read(ledger: Ledger, start: float, end: float, admin: bool) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    with ledger.reader() as cur:
        if admin:
            sql, params = recent_decisions_sql(start, end, MAX_DECISIONS)
            for model, at, previous, _, desired, reasons in cur.execute(sql, params).fetchall():
                found.append(
                    {
                        "at": at,
                        "kind": "scale_up" if desired > previous else "scale_down",
                        "model": model,
                        "title": f"{model}: {previous} -> {desired} replicas",
                        "detail": reasons,
                    }
                )
        closes = cur.execute(
            "SELECT month, closed_at FROM months WHERE closed_at >= ? AND closed_at < ? "
            "ORDER BY closed_at",
            [start, end],
        ).fetchall()
    for month, at in closes:
        found.append(
            {
                "at": at,
                "kind": "month_close",
                "model": None,
                "title": f"{month} closed",
                "detail": f"the statement of {month} is frozen; later records for it are adjustments",
            }
        )
    return sorted(found, key=lambda e: (e["at"], e["kind"]))
