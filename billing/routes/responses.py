"""How the routes answer: JSON through orjson, CSV downloads, statement refreshes after a response."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import orjson
from fastapi.responses import Response
from starlette.background import BackgroundTask

from billing.routes.dependencies import Services, compute

__all__ = ["download", "fields_of", "json_response", "refresh_if_stale"]


def json_response(body: Any, background: BackgroundTask | None = None) -> Response:
    """``body`` as JSON; NaN (an empty mean) becomes null, which JSON clients can read."""
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
                    media_type="application/json", background=background)  # fmt: skip


def download(text: str, filename: str) -> Response:
    """A CSV file the browser saves as ``filename``."""
    return Response(text, media_type="text/csv; charset=utf-8",
                    headers={"content-disposition": f'attachment; filename="{filename}"'})  # fmt: skip


def fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass as a dict, in field order."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def refresh_if_stale(svc: Services, month: str) -> BackgroundTask | None:
    """Recompute a stale statement after the response is sent (the server waits for it on exit)."""
    if not svc.statements.stale(month, time.monotonic()):
        return None
    return BackgroundTask(compute, svc, svc.statements.recompute, month)
