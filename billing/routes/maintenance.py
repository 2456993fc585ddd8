"""``POST /v1/admin/retain`` and ``POST /v1/admin/backup``: the ledger's upkeep, by the admin.

Both run in the service because it alone has the ledger open; the commands ``infermeter billing
retain`` and ``backup`` call them. A backup's ``dest`` is a path on billing's own filesystem (a
volume mounted for backups), and must not exist yet: a backup never replaces anything.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from billing import archive, backup
from billing.routes.dependencies import Manager, ServicesDep
from billing.routes.errors import error_response
from billing.routes.openapi import READ, errors

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/admin/retain", responses=errors(*READ, 409), response_model=None)
async def retain(_: Manager, svc: ServicesDep) -> dict[str, Any] | Response:
    """Move raw rows past ``billing.retention.raw_days`` to the Parquet archive now."""
    settings = svc.config.billing.retention
    try:
        report = await run_in_threadpool(
            archive.retain, svc.ledger, settings.archive, settings.raw_days
        )
    except archive.ArchiveError as exc:
        return error_response(409, str(exc), "invalid_request_error", "conflict")
    return report.to_json()


@router.post("/v1/admin/backup", responses=errors(*READ, 409), response_model=None)
async def take_backup(
    _: Manager, svc: ServicesDep, dest: Annotated[str, Query(min_length=1, max_length=4096)]
) -> dict[str, Any] | Response:
    """Snapshot the ledger into the new directory ``dest`` while ingest goes on."""
    try:
        manifest = await run_in_threadpool(backup.backup, svc.ledger, dest)
    except backup.BackupError as exc:
        return error_response(409, str(exc), "invalid_request_error", "conflict", "dest")
    return {"directory": dest, **manifest}
