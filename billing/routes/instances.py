"""``GET /v1/instances``: the instance registry, where collectors find the engines to scrape.

Every instance of the dynamic fleet announces itself through its sidecar (start, heartbeats,
stop); the registry answers what those announcements add up to (``billing.lifetimes``): each
instance's group, node, GPUs, where its engine metrics are read, and its state. It reads the
``lifetimes`` table that ingest keeps, one row per lifetime, never the heartbeats. The live
answer is bounded by what the configuration lets each group run (``billing.lifetimes.LiveBound``):
instances announce themselves, and a collector reads every engine listed here. The admin and
the metrics role may read it (a collector runs with the metrics token); teams may not, as it
spans the whole fleet.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from billing import registry
from billing.lifetimes import State, heartbeat_seconds, live_bound
from billing.routes.dependencies import Scraper, ServicesDep
from billing.routes.openapi import errors

__all__ = ["MAX_INSTANCES", "Instance", "Instances", "router"]

router = APIRouter()

# At most this many instances in one answer (``limit``): a fleet has hundreds of live ones; the
# whole history (``state=all``) is for looking things up, a group at a time.
MAX_INSTANCES = 10_000


class Instance(BaseModel):
    """One lifetime of one instance, as the registry answers it."""

    instance: str
    replica: str
    model: str
    node: str
    gpu_model: str
    gpu_count: int
    gpus: list[str]
    namespace: str | None
    pod_uid: str | None
    engine_metrics_url: str | None
    started_at: float
    last_seen: float
    stopped_at: float | None
    state: State


class Instances(BaseModel):
    """The registry's answer."""

    instances: list[Instance]


def _entry(row: dict[str, Any]) -> Instance:
    gpus = [g for g in (row["gpus"] or "").split(",") if g]
    return Instance(**{**row, "gpus": gpus})


@router.get("/v1/instances", responses=errors(401, 403, 422))
async def instances(
    _: Scraper,
    svc: ServicesDep,
    state: Annotated[Literal["live", "all"], Query()] = "live",
    replica: Annotated[str | None, Query(max_length=253)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_INSTANCES)] = 1000,
) -> Instances:
    """Live instances (``state=all``: every lifetime kept), optionally of one replica group."""
    config = svc.config
    rows = await run_in_threadpool(
        registry.lifetimes,
        svc.ledger,
        time.time(),
        heartbeat_seconds(config),
        state,
        replica,
        limit,
        live_bound(config),
    )
    return Instances(instances=[_entry(r) for r in rows])
