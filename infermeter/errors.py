"""The one error shape every infermeter API answers with: OpenAI's ``{"error": {...}}``.

The sidecar speaks the OpenAI API, and billing uses the same body so one client can read both.
``BadRequest`` is what request-handling code raises for input the caller can fix; only it (never
a bare ``ValueError``, which may be a fault of the server) becomes HTTP 400.
"""

from __future__ import annotations

import orjson

__all__ = ["BadRequest", "error_body", "sse_error_event"]


class BadRequest(Exception):
    """The caller sent something it can fix: HTTP 400 with this message (and ``param``)."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = "invalid_request"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


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
