"""Each model's cost per weighted token, for the sidecars' cost estimates (``billing.rates``).

Read as ``/v1/spend`` is: by the sidecars' spend_reader and every reader of spend. The answer is
kept for a minute (``billing.rates.RateCache``), so a fleet of sidecars polling it costs the
ledger a few small reads a minute.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from billing.rates import RateCache
from billing.routes.dependencies import ServicesDep, Spender, compute
from billing.routes.openapi import READ, errors

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/rates", responses=errors(*READ))
async def rates(_: Spender, svc: ServicesDep, request: Request) -> dict[str, Any]:
    """Per configured model, USD per weighted token (the last complete hour's measured cost over
    its weighted tokens, else the month's so far, else null) and the weights that weigh them."""
    cache: RateCache = request.app.state.rates
    models = [m.name for m in svc.config.models]
    body: dict[str, Any] = await compute(svc, cache.get, svc.ledger, svc.chargeback.policy, models)
    return body
