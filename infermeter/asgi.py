"""The few plain-ASGI helpers the servers share (sidecar, simulated replica, dcgm stand-in).

The hot servers are written against ASGI directly for speed; these are the pieces every one of
them needs, kept in one place so a fix to body reading or header lookup lands everywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["Message", "Receive", "Scope", "Send", "header", "idle_lifespan", "read_body", "respond"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of request header ``name`` (lower-case bytes), or None."""
    for key, value in scope["headers"]:
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None


async def read_body(
    receive: Receive, limit: int, timeout_seconds: float | None = None, complete: bool = False
) -> bytes | None:
    """The whole request body, ``b""`` if the client left, None when it exceeds ``limit``.

    With ``timeout_seconds``, TimeoutError when the whole body has not arrived by then: the
    HTTP server has no body deadline of its own, and a client trickling a body would otherwise
    hold its request (and whatever it reserved) for as long as it likes. ``complete``: the
    server says the whole body is in (``http_guard.BODY_COMPLETE``), so no deadline is armed.
    """
    if complete:
        return await _read_body(receive, limit)
    async with asyncio.timeout(timeout_seconds):
        return await _read_body(receive, limit)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """Send a whole response: start, then the body in one message."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def idle_lifespan(receive: Receive, send: Send) -> None:
    """Answer the lifespan protocol for an app with nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
