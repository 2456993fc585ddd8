"""``POST /v1/admin/retain`` and ``POST /v1/admin/backup``: the ledger's upkeep, by the admin.

Both run in the service because it alone has the ledger open; the commands ``infermeter billing
retain`` and ``backup`` call them. A backup goes to a new directory ``name`` under
``billing.backup_dir`` (a volume mounted for backups): a name, never a path, so the caller
chooses no place on billing's filesystem, and one that exists is refused: a backup never
replaces anything.
"""

from __future__ import annotations

from pathlib import Path
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
            archive.retain,
            svc.ledger,
            settings.archive,
            settings.raw_days,
            None,
            svc.config.billing.cluster_name,
        )
    except archive.ArchiveError as exc:
        return error_response(409, str(exc), "invalid_request_error", "conflict")
    return report.to_json()


@router.post("/v1/admin/backup", responses=errors(*READ, 409), response_model=None)
async def take_backup(
    _: Manager, svc: ServicesDep, name: Annotated[str, Query(pattern=backup.NAME_PATTERN)]
) -> dict[str, Any] | Response:
    """Snapshot the ledger into the new directory ``name`` under ``billing.backup_dir`` while
    ingest goes on."""
    dest = Path(svc.config.billing.backup_dir) / name
    try:
        manifest = await run_in_threadpool(backup.backup, svc.ledger, dest)
    except backup.BackupError as exc:
        return error_response(409, str(exc), "invalid_request_error", "conflict", "name")
    return {"directory": str(dest.resolve()), **manifest}
