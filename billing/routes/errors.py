"""Every error the billing API answers, mapped once, in the OpenAI shape the sidecar uses.

Unauthenticated 401, Forbidden 403, BadRequest 400 (only input the caller can fix), a body or
batch over the limits 413, a body too slow to arrive 408, a caller over its read rate 429 (with
Retry-After), a refused ledger operation 409, a ledger that cannot be written 503, an ID token
that cannot be checked because the identity provider's keys cannot be read 503 (with
Retry-After: the token is not refused, and may be good once the provider answers). A
``ValueError`` is not mapped: raised anywhere but a caller-input check it is a fault of the
server, and comes out as a 500 like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import duckdb
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from billing.ledger import BatchTooLargeError, LedgerError, LedgerUnavailableError
from billing.ratelimit import RateLimitedError
from billing.routes.body import BodyIncompleteError, BodyTimeoutError, BodyTooLargeError
from infermeter.auth import Forbidden, Unauthenticated
from infermeter.errors import BadRequest, error_body
from infermeter.oidc import KeysUnavailable

__all__ = ["IDP_RETRY_SECONDS", "error_response", "install"]

log = logging.getLogger("infermeter.billing")

# The Retry-After of a 503 for an ID token whose issuer's keys cannot be read: soon, as each
# request tries the provider again.
IDP_RETRY_SECONDS = 5


def error_response(
    status: int, message: str, err_type: str, code: str | None = None, param: str | None = None
) -> Response:
    """An ``error_body`` answer with ``status``."""
    return Response(
        error_body(status, message, err_type, code, param),
        status_code=status,
        media_type="application/json",
    )


async def _bad_request(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest)
    return error_response(400, exc.message, "invalid_request_error", exc.code, exc.param)


async def _rate_limited(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RateLimitedError)
    response = error_response(429, str(exc), "rate_limit_error", "rate_limited")
    response.headers["retry-after"] = str(exc.retry_after_seconds)
    return response


async def _unavailable(_: Request, exc: Exception) -> Response:
    log.error("ledger write failed: %s", exc)
    return error_response(
        503,
        "the ledger cannot be written (disk full or unavailable); retry later",
        "server_error",
        "ledger_unavailable",
    )


async def _idp_unavailable(_: Request, exc: Exception) -> Response:
    # Logged by ``IdTokens`` once per outage, not here per request.
    response = error_response(503, str(exc), "server_error", "idp_unavailable")
    response.headers["retry-after"] = str(IDP_RETRY_SECONDS)
    return response


async def _invalid(_: Request, exc: Exception) -> Response:
    # FastAPI's own parameter checks (a query parameter of the wrong form): its status, our shape.
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else "invalid request"
    return error_response(422, message, "invalid_request_error", "invalid_value", param)


async def _http(_: Request, exc: Exception) -> Response:
    # Routing's own answers: no such path (404), method not allowed (405).
    assert isinstance(exc, HTTPException)
    response = error_response(exc.status_code, str(exc.detail), "invalid_request_error")
    response.headers.update(exc.headers or {})
    return response


async def _fault(_: Request, exc: Exception) -> Response:
    # The server erred; the exception is logged by the server (it is re-raised after this).
    return error_response(500, "internal server error", "server_error", "internal_error")


def _fixed(
    status: int, err_type: str, code: str
) -> Callable[[Request, Exception], Awaitable[Response]]:
    """A handler answering ``status`` with the exception's message, ``err_type`` and ``code``."""

    async def handle(_: Request, exc: Exception) -> Response:
        return error_response(status, str(exc), err_type, code)

    return handle


# Errors whose answer is their message with a fixed status, type and code. A body too large or
# too slow does not close the connection at once: closing a socket with unread input resets it,
# and the client would lose the answer. The server discards what is left of the body, for at
# most the header deadline of the next request (``infermeter.serving``), and then closes it.
_FIXED: tuple[tuple[type[Exception], int, str, str], ...] = (
    (Unauthenticated, 401, "invalid_request_error", "invalid_api_key"),
    (Forbidden, 403, "permission_error", "forbidden"),
    (BatchTooLargeError, 413, "invalid_request_error", "batch_too_large"),
    (BodyTooLargeError, 413, "invalid_request_error", "body_too_large"),
    (BodyTimeoutError, 408, "invalid_request_error", "body_timeout"),
    (BodyIncompleteError, 400, "invalid_request_error", "body_incomplete"),
    (LedgerError, 409, "invalid_request_error", "conflict"),
)


def install(app: FastAPI) -> None:
    """Map every error the routes raise to its status and the OpenAI error body."""
    for exc_type, status, err_type, code in _FIXED:
        app.add_exception_handler(exc_type, _fixed(status, err_type, code))
    app.add_exception_handler(BadRequest, _bad_request)
    app.add_exception_handler(RateLimitedError, _rate_limited)
    app.add_exception_handler(duckdb.IOException, _unavailable)
    app.add_exception_handler(LedgerUnavailableError, _unavailable)
    app.add_exception_handler(KeysUnavailable, _idp_unavailable)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(Exception, _fault)
