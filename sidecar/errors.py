"""OpenAI-style error responses: the only error shape a client of the sidecar ever sees."""

from __future__ import annotations

import orjson

__all__ = ["error_body", "sse_error_event"]


def error_body(
    status: int, message: str, err_type: str, code: str | None = None, param: str | None = None
) -> bytes:
    """``{"error": {...}}`` as the OpenAI API writes it."""
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    )


def sse_error_event(
    message: str, err_type: str = "upstream_error", code: str | None = "upstream_error"
) -> bytes:
    """The SSE event sent when a stream cannot go on: the error object, then the stream ends."""
    return b"data: " + error_body(502, message, err_type, code) + b"\n\n"
