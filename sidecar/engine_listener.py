"""A second listener that serves vLLM's own ``/metrics`` and nothing else, without a token.

An endpoint picker (the Gateway API Inference Extension's) chooses a pod by its engine's queue
and KV-cache use, read from ``http://<pod IP>:<port>/metrics`` with no credentials. vLLM itself
listens on loopback (it serves some routes without its key), and the sidecar's
``/engine/metrics`` needs the metrics token, which a picker cannot send. This listener, on a port
of its own, relays vLLM's page for ``GET /metrics`` and answers 404 to every other path, so it
opens the engine's gauges and nothing of the engine's API; a NetworkPolicy keeps the port to
the picker's pods.

The page is fetched through the sidecar's own connection pool (``sidecar.fetch``), the way the
token-guarded ``/engine/metrics`` is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from infermeter.asgi import Receive, Scope, Send
from sidecar.fetch import fetch
from sidecar.upstream import UPSTREAM_ERRORS

__all__ = ["EngineMetricsOnly"]

_TEXT = b"text/plain; version=0.0.4; charset=utf-8"


class EngineMetricsOnly:
    """ASGI app: ``GET /metrics`` is the engine's page; anything else is 404 (405 for a method)."""

    def __init__(self, page: Callable[[], Awaitable[tuple[int, bytes, bytes]]]) -> None:
        self.page = page

    @classmethod
    def of(cls, sidecar: Any, timeout_seconds: float = 10.0) -> EngineMetricsOnly:
        """The listener of ``sidecar`` (a ``sidecar.app.Sidecar``): its upstream, its pool."""

        async def page() -> tuple[int, bytes, bytes]:
            r = await fetch(sidecar.relay.pools, sidecar.upstream, "/metrics", {}, timeout_seconds)
            return r.status, r.content_type or _TEXT, r.body

        return cls(page)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request."""
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            await _respond(send, 404, b"not found\n", _TEXT)
        elif scope["method"] not in ("GET", "HEAD"):
            await _respond(send, 405, b"method not allowed\n", _TEXT)
        else:
            try:
                status, kind, body = await self.page()
            except UPSTREAM_ERRORS as exc:
                await _respond(
                    send, 503, f"engine unreachable: {type(exc).__name__}\n".encode(), _TEXT
                )
                return
            await _respond(send, status, body, kind)


async def _respond(send: Send, status: int, body: bytes, kind: bytes) -> None:
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
