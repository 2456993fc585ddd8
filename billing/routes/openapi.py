"""What billing's OpenAPI says of the answers and bodies FastAPI cannot see in a handler's types.

Handlers answer with ``Response`` objects (orjson, CSV) and raise errors that
``billing.routes.errors`` maps, so FastAPI alone would document a bare 200 and its own 422
body. Each route names here the errors it can answer, every one in the OpenAI error shape, and
the ingest routes describe the bodies they read from the raw request.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from infermeter.records import KINDS, USAGE, FieldType
from infermeter.wire import ARROW_STREAM, NDJSON

__all__ = [
    "CSV",
    "INGEST_BODY",
    "KIND_BODY",
    "READ",
    "Error",
    "errors",
    "text",
    "usage_records",
]


class ErrorDetail(BaseModel):
    """The ``error`` object of an error answer."""

    message: str
    type: str
    param: str | None
    code: str | None


class Error(BaseModel):
    """Every error answer of the billing API, as the OpenAI API writes them."""

    error: ErrorDetail


_WHY = {
    400: "Input the caller can fix: a malformed month, batch or range, an unknown kind.",
    401: "The credential is missing or unknown.",
    403: "The credential may not do this (its role, or another team's data).",
    404: "No such query.",
    408: "The body did not arrive within billing.body_read_timeout_seconds.",
    409: "The ledger refused the operation (a month that has not ended).",
    413: "The body is over billing.max_body_bytes, or the batch over billing.max_batch_records.",
    422: "A parameter of the wrong form.",
    429: "The caller is over its read rate; Retry-After says when to ask again.",
    503: "The ledger cannot be written (disk full or unavailable), or an ID token cannot be "
    "checked because the identity provider's keys cannot be read (Retry-After says when to ask "
    "again); retry later.",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds until the next read is admitted.",
        "schema": {"type": "integer", "minimum": 1},
    }
}

# What every read route (statements, files, queries, months) may answer besides its 200: 503
# when single sign-on is on and the bearer is an ID token its issuer's keys cannot check now.
READ = (401, 403, 422, 429, 503)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of ``statuses``, each with its reason and the error body."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": Error, "description": _WHY[status]}
        if status == 429:
            out[status]["headers"] = _RETRY_AFTER
    return out


def text(media_type: str, description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 whose body is text of ``media_type``."""
    return {
        200: {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}
    }


CSV = "text/csv"

# ``POST /v1/ingest``: one JSON object, its only key the kind, its value the records.
INGEST_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {key: {"type": "array", "items": {"type": "object"}}},
                            "required": [key],
                            "additionalProperties": False,
                        }
                        for key in KINDS
                    ]
                }
            }
        },
    }
}

# ``POST /v1/ingest/{kind}``: a spool segment's lines, or the shipper's Arrow IPC stream.
KIND_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            NDJSON: {"schema": {"type": "string", "description": "One JSON record per line."}},
            ARROW_STREAM: {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "An Arrow IPC stream of the kind's columns (infermeter.wire).",
                }
            },
        },
    }
}

_JSON_TYPES = {
    FieldType.STRING: "string",
    FieldType.INT: "integer",
    FieldType.NUMBER: "number",
    FieldType.BOOL: "boolean",
}


def usage_records() -> dict[int | str, dict[str, Any]]:
    """A 200 whose body is ``{"records": [...]}``, each a usage record as the ledger keeps it."""
    properties: dict[str, Any] = {}
    for f in USAGE.fields:
        kind: dict[str, Any] = {"type": _JSON_TYPES[f.type]}
        properties[f.name] = {"anyOf": [kind, {"type": "null"}]} if f.nullable else kind
    record = {
        "type": "object",
        "properties": properties,
        "required": [f.name for f in USAGE.fields],
    }
    schema = {
        "type": "object",
        "properties": {"records": {"type": "array", "items": record}},
        "required": ["records"],
    }
    return {
        200: {
            "description": "The matching usage records, newest first.",
            "content": {"application/json": {"schema": schema}},
        }
    }
