"""``/healthz``, ``/readyz`` and ``/metrics``: what the orchestrator and Prometheus ask."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import generate_latest
from starlette.concurrency import run_in_threadpool

from billing import closing
from billing.routes.dependencies import Scraper, ServicesDep
from billing.routes.openapi import errors, text

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process answers."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(svc: ServicesDep) -> dict[str, str]:
    """The ledger answers a read."""
    await run_in_threadpool(closing.months, svc.ledger)
    return {"status": "ready"}


@router.get(
    "/metrics", responses=text("text/plain", "Prometheus text exposition.") | errors(401, 403)
)
async def metrics(_: Scraper, svc: ServicesDep) -> Response:
    """Prometheus text: spend per team (from the cached statement) and ingest counters.

    A statement older than ``billing.statement_ttl_seconds`` is recomputed during the scrape.
    """
    body = await run_in_threadpool(generate_latest, svc.registry)
    return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")
