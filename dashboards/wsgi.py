"""The dashboard's production WSGI server: waitress, with infermeter's client limits and a graceful stop.

Why waitress (measured with ``python -m bench.dashboard_servers``, docs/dashboards.md): it
serves Flask from a bounded pool of threads like gunicorn's ``gthread`` worker, for the same
latency and CPU per callback, and it runs inside the process, so ``infermeter dashboard``, the
demo's supervisor and the browser tests start and stop it the same way; gunicorn forks its
workers from its own command line and takes over the process's signals.

waitress has a connection cap (``connection_limit``: past it no connection is accepted, they wait
in the listen backlog) and a header size cap (``max_request_header_size``: larger headers are
``431``), which take ``ServerLimits``' values. It has no header deadline: its ``channel_timeout``
closes a connection only when it is silent, so one that trickles its headers a byte at a time is
kept. ``_GuardedChannel`` adds the deadline: request headers not complete within
``header_timeout_seconds`` of their first byte close the connection, as
``infermeter.http_guard`` does for uvicorn. An idle keep-alive connection is closed after
``keep_alive_seconds``.

waitress reads a request's whole body (into memory, then a temporary file) before it calls the
app, and Flask then reads it into memory again: one 400 MiB POST to ``/_dash-update-component``
left the process at 941 MiB. So the body limit is waitress's own ``max_request_body_size``: a
``Content-Length`` over ``max_body_bytes`` is answered ``413`` as soon as the headers are in,
before a byte of the body is read, and a chunked body is cut off at the limit. waitress writes
that answer itself, so ``error_headers`` (the app's security headers) are added to it here.

``stop`` is graceful: the listening socket closes at once, requests being served get up to
``graceful_seconds`` to finish, then the connections close and the loop ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer, create_server
from waitress.task import ErrorTask

from infermeter.http_guard import DEFAULT_LIMITS, ServerLimits

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIApplication

__all__ = ["WsgiServer"]

# How often the loop wakes to check deadlines and a stop request, seconds.
_TICK_SECONDS = 0.25


class _GuardedChannel(HTTPChannel):  # type: ignore[misc]
    """waitress's connection, remembering when the request whose headers it reads began."""

    headers_since: float | None = None

    def received(self, data: bytes) -> bool:
        """Read ``data``; start the header clock on a new request, stop it once headers are in."""
        if data and self.request is None and self.headers_since is None:
            self.headers_since = time.monotonic()
        result: bool = super().received(data)
        if self.request is None or self.request.headers_finished:
            self.headers_since = None
        return result


def _guarded_server(
    header_timeout_seconds: float, error_headers: Mapping[str, str]
) -> type[TcpWSGIServer]:
    class HeadedErrorTask(ErrorTask):  # type: ignore[misc]
        """waitress's own error answer (400, 413, 431), with the app's headers."""

        def execute(self) -> None:
            self.response_headers.extend(error_headers.items())
            super().execute()

    class HeadedChannel(_GuardedChannel):
        error_task_class = HeadedErrorTask

    class GuardedServer(TcpWSGIServer):  # type: ignore[misc]
        channel_class = HeadedChannel

        def maintenance(self, now: float) -> None:
            """waitress's idle cleanup, then close connections past their header deadline."""
            super().maintenance(now)
            late = time.monotonic() - header_timeout_seconds
            for channel in list(self.active_channels.values()):
                since = getattr(channel, "headers_since", None)
                if since is not None and since < late and not channel.requests:
                    channel.will_close = True

    return GuardedServer


class WsgiServer:
    """A WSGI app served by waitress on ``host:port`` until ``stop``; bound when constructed."""

    def __init__(
        self,
        app: WSGIApplication,
        host: str,
        port: int,
        limits: ServerLimits = DEFAULT_LIMITS,
        threads: int = 16,
        graceful_seconds: float = 2.0,
        max_body_bytes: int = 1 << 20,
        error_headers: Mapping[str, str] | None = None,
    ) -> None:
        """``max_body_bytes``: the largest request body taken (larger: 413, unread);
        ``error_headers``: added to the answers waitress makes itself (see the module docstring).
        """
        self.graceful_seconds = graceful_seconds
        self._stop = threading.Event()
        # ``stop`` wakes the loop through waitress's trigger, which ``serve`` closes once done:
        # the lock keeps the two apart (a stop from another thread that ran late wrote into a
        # closed descriptor, EBADF, or into whatever the number had been given to since).
        self._trigger_lock = threading.RLock()  # re-entered by a signal handler in its thread
        self._trigger_closed = False
        self._map: dict[int, Any] = {}
        self._server: TcpWSGIServer = create_server(
            app,
            map=self._map,
            host=host,
            port=port,
            threads=threads,
            connection_limit=limits.max_connections,
            max_request_header_size=limits.max_header_bytes,
            # waitress refuses a body of this size or more: one byte over the limit.
            max_request_body_size=max_body_bytes + 1,
            channel_timeout=limits.keep_alive_seconds,
            cleanup_interval=_TICK_SECONDS,
            asyncore_loop_timeout=_TICK_SECONDS,
            # poll(), not select(): select cannot watch descriptors past 1024.
            asyncore_use_poll=True,
            ident="infermeter",
        )
        if type(self._server) is not TcpWSGIServer:
            # A host name with several addresses makes waitress listen on each of them.
            raise ValueError(f"listen on one address, not on every address of {host!r}")
        # create_server builds the server and its listening socket itself; the guarded subclass
        # only adds methods, so the built server takes its class in place.
        self._server.__class__ = _guarded_server(limits.header_timeout_seconds, error_headers or {})
        self.started = threading.Event()

    def serve(self) -> None:
        """Serve until ``stop``, then finish gracefully (see the module's docstring)."""
        server = self._server
        self.started.set()
        while not self._stop.is_set():
            wasyncore.loop(_TICK_SECONDS, True, self._map, count=1)
        # Stop accepting: close the listening socket only (waitress's close() ends everything).
        wasyncore.dispatcher.close(server)
        deadline = time.monotonic() + self.graceful_seconds
        while time.monotonic() < deadline and any(
            c.requests for c in list(server.active_channels.values())
        ):
            wasyncore.loop(_TICK_SECONDS, True, self._map, count=1)
        server.task_dispatcher.shutdown(cancel_pending=True, timeout=self.graceful_seconds)
        with self._trigger_lock:
            self._trigger_closed = True
            server.trigger.close()
        wasyncore.close_all(self._map)

    def stop(self) -> None:
        """Ask ``serve`` to finish (from any thread or a signal handler); it returns once done."""
        with self._trigger_lock:
            if self._stop.is_set():
                return
            self._stop.set()
            if not self._trigger_closed:
                self._server.pull_trigger()
