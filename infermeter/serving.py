"""Serving HTTP: the uvicorn settings, listen addresses and port checks every server shares.

Every infermeter server (sidecar, collector, billing, autoscaler, dashboard, the simulator and the
tests' own servers) is started through ``server`` so they all get the same parser, logging and
shutdown behaviour, and fail with the same one-line message when their port is taken.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Literal
from urllib.parse import urlsplit

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["PortInUseError", "ensure_free", "free_port", "host_port", "server"]


class PortInUseError(Exception):
    """A port a server must listen on is taken; the message names who wanted it."""


def host_port(url_or_addr: str) -> tuple[str, int]:
    """``http://h:p/x`` or ``h:p`` -> ``(h, p)``."""
    if "://" not in url_or_addr:
        url_or_addr = f"http://{url_or_addr}"
    parts = urlsplit(url_or_addr)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"{url_or_addr!r} has no host and port")
    return parts.hostname, parts.port


def ensure_free(host: str, port: int, what: str) -> None:
    """Fail early, with a useful message, when ``host:port`` cannot be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(f"port {port} on {host} ({what}) is already in use") from None
            raise PortInUseError(
                f"cannot listen on {host}:{port} ({what}): {exc.strerror}"
            ) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listened on a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class _HeaderDeadline(HttpToolsProtocol):
    """httptools' protocol, closing a connection whose request headers arrive too slowly.

    uvicorn bounds only the idle time between requests (``timeout_keep_alive``), and any byte
    resets that: a client sending one header line a second holds its connection for ever.
    Here each request's headers must be complete within ``header_timeout_seconds`` of the
    connection opening or of the previous response ending.
    """

    header_timeout_seconds = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the deadline of the first request's headers."""
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        """The headers are in: the deadline no longer applies to this request."""
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        """Start the deadline of the next request's headers, unless they are in already."""
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        """Nothing to time any more."""
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def server(
    app: object,
    host: str,
    port: int,
    lifespan: Literal["auto", "on", "off"] = "on",
    *,
    max_connections: int | None = None,
    header_timeout_seconds: float | None = None,
    keep_alive_timeout_seconds: int = 5,
) -> uvicorn.Server:
    """A quiet uvicorn server on the running asyncio loop, with httptools' HTTP parser.

    ``Server.serve()`` runs on whatever loop the caller started (``asyncio.run``): uvicorn's
    ``loop`` setting only applies to ``Server.run()``. Measured, uvloop was not faster for the
    simulator's per-step wake-ups (docs/benchmarks.md), so the standard loop is used.

    For a server that callers it does not trust can reach: ``max_connections`` (uvicorn's
    ``limit_concurrency``: a request arriving while that many connections or requests are open
    is answered 503), ``header_timeout_seconds`` (a connection whose request headers take
    longer is closed) and ``keep_alive_timeout_seconds`` (an idle connection is closed).
    """
    http: type[asyncio.Protocol] | Literal["httptools"] = "httptools"
    if header_timeout_seconds is not None:
        http = type("HeaderDeadline", (_HeaderDeadline,),
                    {"header_timeout_seconds": header_timeout_seconds})  # fmt: skip
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        http=http,
        lifespan=lifespan,
        timeout_graceful_shutdown=2,
        limit_concurrency=max_connections,
        timeout_keep_alive=keep_alive_timeout_seconds,
    )
    return uvicorn.Server(config)
