"""Reading an ingest body under a size cap and a deadline, as it arrives.

``await request.body()`` would buffer whatever a caller sends, for as long as it takes to send
it. Here a declared ``Content-Length`` over the cap is refused before a byte of the body is
read, a chunked body is refused as soon as it passes the cap (what was read is dropped), and a
body that is still arriving at the deadline is refused too, so a client that trickles its body
holds a worker for a bounded time only. A client that hangs up before its body is whole (a
writer whose timeout ran out while billing was paused) is refused like a bad body, not a fault of
billing: the writer ships the batch again, record ids making a second arrival harmless.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

__all__ = ["BodyIncompleteError", "BodyTimeoutError", "BodyTooLargeError", "read_body"]


class BodyTooLargeError(Exception):
    """The body is over ``billing.max_body_bytes`` (413)."""


class BodyTimeoutError(Exception):
    """The body did not arrive within ``billing.body_read_timeout_seconds`` (408)."""


class BodyIncompleteError(Exception):
    """The client hung up before its body was whole (400, to no one)."""


async def read_body(request: Request, max_bytes: int, timeout_seconds: float) -> bytes:
    """The whole body, at most ``max_bytes`` of it, received within ``timeout_seconds``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLargeError(_too_large(max_bytes))
    try:
        async with asyncio.timeout(timeout_seconds):
            return await _capped(request, max_bytes)
    except ClientDisconnect:
        raise BodyIncompleteError("the client hung up before its body was whole") from None
    except TimeoutError:
        raise BodyTimeoutError(
            f"the body did not arrive within {timeout_seconds:g} s "
            "(billing.body_read_timeout_seconds)"
        ) from None


async def _capped(request: Request, max_bytes: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > max_bytes:
            raise BodyTooLargeError(_too_large(max_bytes))
        body += chunk
    return bytes(body)


def _too_large(max_bytes: int) -> str:
    return f"the body is over {max_bytes} bytes (billing.max_body_bytes)"
