"""Federation routes: a cluster's closed months for a central, and the central's statement
across clusters (``billing.federation``).

A cluster serves ``/v1/federation/months`` to the federation role (a central's credential,
which reads nothing else) and the admin. A central (``billing.role: central``) serves one
statement, one FOCUS file and the closed months' hours (cost, usage and reconciliation per
hour) across its clusters to the readers of every team, and runs a round of pulls at once for
the admin (``POST /v1/federation/pull``); on a cluster these are 404.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import Response

from billing import closing, federation_store as store
from billing.federation import central_focus, central_hours, central_statement
from billing.federation_pull import Puller
from billing.ledger import LedgerError
from billing.routes.dependencies import (
    AllReader,
    Manager,
    Month,
    ServicesDep,
    Who,
    asker,
    compute,
)
from billing.routes.openapi import CSV, READ, errors, text
from billing.routes.responses import download, json_response
from exporters.chargeback_csv import write_csv
from infermeter.auth import FEDERATORS, Caller

__all__ = ["router"]

router = APIRouter(tags=["federation"])


def federator(who: Who, svc: ServicesDep) -> Caller:
    """A central's federation credential, or the admin."""
    who.require(FEDERATORS)
    return asker(who, svc)


Federator = Annotated[Caller, Depends(federator)]


def _puller(request: Request) -> Puller:
    """The central's puller; 404 on a cluster, which has none."""
    puller: Puller | None = getattr(request.app.state, "federation", None)
    if puller is None:
        raise HTTPException(404, "this billing is not a central (billing.role: central)")
    return puller


@router.get("/v1/federation/months", responses=errors(*READ))
async def months(who: Federator, svc: ServicesDep) -> dict[str, Any]:
    """This cluster's closed months, each with the digest of its frozen content."""
    name = svc.config.billing.cluster_name
    listed = await compute(svc, store.closed_months, svc.ledger, name, svc.digests)
    return {"cluster": name, "months": listed}


@router.get("/v1/federation/months/{month}", responses=errors(400, *READ, 409))
async def month(who: Federator, month: Month, svc: ServicesDep) -> Response:
    """A closed month's frozen lines, basis and node pools, with its digest, and this cluster's
    price book; 409 while open."""
    if not closing.month_state(svc.ledger, month)[0]:
        raise LedgerError(f"month {month} is not closed: only closed months are federated")
    name = svc.config.billing.cluster_name
    prices = svc.config.prices.model_dump(mode="json")
    payload = await compute(svc, store.payload_of, svc.ledger, name, month, prices)
    return json_response(payload.to_json())


async def _held(request: Request, svc: ServicesDep, month: str) -> tuple[Any, Any]:
    puller = _puller(request)
    names = [c.name for c in svc.config.billing.clusters]
    return await compute(svc, store.federated_month, svc.ledger, month, names, puller.started_at)


# Declared before ``{month}``, which would otherwise take "2026-10.focus.csv" as the month.
@router.get(
    "/v1/federation/statement/{month}.focus.csv",
    responses=text(CSV, "The FOCUS 1.2 file across clusters.") | errors(400, *READ, 404),
)
async def statement_focus(
    who: AllReader, month: Month, svc: ServicesDep, request: Request
) -> Response:
    """The clusters' closed month as one FOCUS 1.2 file, SubAccountId ``<cluster>/<team>``."""
    lines, states = await _held(request, svc, month)
    frame = await compute(svc, central_focus, month, lines, states, svc.config)
    return download(write_csv(frame), f"focus-1.2-clusters-{month}.csv")


@router.get("/v1/federation/statement/{month}", responses=errors(400, *READ, 404))
async def statement(who: AllReader, month: Month, svc: ServicesDep, request: Request) -> Response:
    """One statement across clusters: lines with their cluster, totals per cluster and overall,
    whether they reconcile, and which clusters are stale and since when."""
    lines, states = await _held(request, svc, month)
    return json_response(central_statement(month, lines, states))


@router.get("/v1/federation/hours/{month}", responses=errors(400, *READ, 404))
async def hours(
    who: AllReader,
    month: Month,
    svc: ServicesDep,
    request: Request,
    cluster: str | None = None,
    rows: bool = True,
) -> Response:
    """The clusters' closed month hour by hour: cost per replica group and GPU model, usage per
    team and model, and the engines' tokens against the ledger's, with the reconciliation
    summed per cluster and across them; ``cluster``: one of them only (404 if not configured);
    ``rows=false``: the figures without the hours' rows (``hours`` null)."""
    puller = _puller(request)
    names = [c.name for c in svc.config.billing.clusters]
    if cluster is not None:
        if cluster not in names:
            raise HTTPException(404, f"no cluster {cluster!r} in billing.clusters")
        names = [cluster]
    lines, states = await compute(
        svc, store.federated_month, svc.ledger, month, names, puller.started_at
    )
    held = await compute(svc, store.federated_hours, svc.ledger, month, names)
    return json_response(central_hours(month, held, lines, states, with_rows=rows))


@router.post("/v1/federation/pull", responses=errors(*READ, 404))
async def pull(who: Manager, request: Request) -> dict[str, Any]:
    """Pull every cluster now (the admin; the central also pulls on its own timer)."""
    reports = await _puller(request).pull()
    return {"pulled_at": time.time(), "clusters": [r.to_json() for r in reports]}
