"""How the routes answer: JSON through orjson, CSV downloads, cached statements with their age."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
from fastapi.responses import Response

from billing.statement_cache import Cached

__all__ = ["download", "fields_of", "json_response", "lifetime_headers", "spend_rows"]


def json_response(body: Any, headers: dict[str, str] | None = None) -> Response:
    """``body`` as JSON; NaN (an empty mean) becomes null, which JSON clients can read."""
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        media_type="application/json",
        headers=headers,
    )


def lifetime_headers(entry: Cached, now: float) -> dict[str, str]:
    """``Cache-Control`` for an answer read from ``entry``: private, and only while it is served."""
    return {"cache-control": f"private, max-age={max(0, int(entry.expires_at - now))}"}


def download(text: str, filename: str) -> Response:
    """A CSV file the browser saves as ``filename``."""
    return Response(
        text,
        media_type="text/csv; charset=utf-8",
        headers={"content-disposition": f'attachment; filename="{filename}"'},
    )


def fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass as a dict, in field order."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def spend_rows(entry: Cached, config: Any, team: str | None) -> list[dict[str, Any]]:
    """The spend rows ``entry`` gives (every team's, or ``team``'s only), each with its ``as_of``."""
    return [
        fields_of(s) | {"as_of": entry.as_of}
        for s in entry.spend(config)
        if team is None or s.team == team
    ]
