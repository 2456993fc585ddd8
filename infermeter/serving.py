"""Serving HTTP: the uvicorn settings, listen addresses and port checks every server shares.

Every infermeter ASGI server but the sidecar (collector, billing, autoscaler, the simulator and
the tests' own servers) is started through ``server`` so they all get the same parser, logging
and shutdown behaviour. The sidecar, whose every request is on the metered path, serves on its
own protocol (``sidecar.http_server``) with the same client limits, and uvicorn is imported
only by ``server``, so a sidecar never loads it. The dashboard, a WSGI app, runs under waitress (``dashboards.wsgi``) with the
same client limits; ``wsgi_server`` (uvicorn through a2wsgi) remains for the benchmark that
compares them. Every server fails with the same one-line message when its port is taken.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from infermeter.http_guard import DEFAULT_LIMITS, ServerLimits, guarded_protocol

if TYPE_CHECKING:
    import uvicorn
    from _typeshed.wsgi import WSGIApplication

__all__ = [
    "DEFAULT_LIMITS",
    "PortInUseError",
    "ServerLimits",
    "ensure_free",
    "free_port",
    "host_port",
    "server",
    "wsgi_server",
]


class PortInUseError(Exception):
    """A port a server must listen on is taken; the message names who wanted it."""


def host_port(url_or_addr: str) -> tuple[str, int]:
    """``http://h:p/x`` or ``h:p`` -> ``(h, p)``; ValueError saying what is wrong.

    A bare ``h:p`` is read by the rule the configuration and the ``--listen`` options check
    (``infermeter.config.listen_address``), so what passed those binds."""
    if "://" not in url_or_addr:
        from infermeter.config import listen_address

        return listen_address(url_or_addr)
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


# The ports ``free_port`` handed out last in this process: the OS may pick a port again as soon
# as the probe closes, before whoever asked for it binds it. (Bounded: a port handed out long
# ago is bound by now, or free again.)
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=4096)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listened on a moment ago (the OS picks it), and that
    this process was not handed lately: several asked for at once (a configuration's servers,
    bound later) are distinct."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port
    raise PortInUseError(f"no port on {host} that was not handed out lately")


def loop_factory(
    choice: Literal["auto", "uvloop", "asyncio"],
) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a server process runs on (``asyncio.Runner(loop_factory=...)``).

    None is Python's own loop. "auto" takes uvloop when it is installed; "uvloop" without it is
    an ImportError for the caller to report against the setting that asked for it.
    """
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def server(
    app: object,
    host: str,
    port: int,
    lifespan: Literal["auto", "on", "off"] = "on",
    limits: ServerLimits = DEFAULT_LIMITS,
) -> uvicorn.Server:
    """A quiet uvicorn server on the running asyncio loop, with httptools' HTTP parser.

    ``limits`` bound what a client may hold: a header deadline, a header size, a connection
    count (``infermeter.http_guard``) and the keep-alive idle time.

    ``Server.serve()`` runs on whatever loop the caller started (``asyncio.run``): uvicorn's
    ``loop`` setting only applies to ``Server.run()``. Measured, uvloop was not faster for the
    simulator's per-step wake-ups (docs/benchmarks.md), so the standard loop is used.
    """
    import uvicorn  # here, not with the module: the sidecar serves without it

    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_seconds,
        lifespan=lifespan,
        timeout_graceful_shutdown=2,
        # No infermeter server reads the client's address, so uvicorn's middleware rewriting it
        # from X-Forwarded-* would only cost every request a pass over its headers.
        proxy_headers=False,
    )
    return uvicorn.Server(config)


def wsgi_server(app: WSGIApplication, host: str, port: int, threads: int = 16) -> uvicorn.Server:
    """``server`` for a WSGI app: each request runs on one of ``threads`` worker threads.

    a2wsgi's adapter carries requests and responses between uvicorn's event loop and the
    threads. A request holds its thread while the app blocks (the dashboard waiting on billing),
    so ``threads`` bounds the requests served at once; the rest wait for a free thread. A browser
    opens up to six connections to one host, so the default lets a few page loads run together.
    """
    from a2wsgi import WSGIMiddleware

    # a2wsgi types the environ as its own TypedDict, the standard library's WSGI types as a dict.
    wsgi = WSGIMiddleware(app, workers=threads)  # type: ignore[arg-type]
    return server(wsgi, host, port, lifespan="off")
