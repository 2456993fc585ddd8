"""A pooled HTTP/1.1 client on asyncio protocols, for the generation requests sent to vLLM.

aiohttp costs, per request, a ``ClientRequest``, a ``ClientResponse``, multidicts and a
``StreamReader``, and per block a task wake-up through ``readany()``; measured, that was most of
the sidecar's CPU per request. Here a connection is an ``asyncio.Protocol`` with httptools'
response parser, and the response is pushed into a ``Sink`` from ``data_received``: the stream
relay meters a block and writes it to the client's transport in the same call, with no task
switch and no copy beyond what the meter makes.

The read timeout is lazy, as in ``sidecar.upstream.StallWatch``: one timer per exchange that
fires at most once per ``read_timeout_seconds`` and fails the exchange only if nothing has
arrived for that long. Reads are paused and resumed by the sink (``pause_reading``), which is
how a slow client slows its upstream instead of being buffered for without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Protocol, cast

import httptools

__all__ = [
    "ConnectTimeout",
    "Connection",
    "Pool",
    "ReadTimeout",
    "Sink",
    "UpstreamClosed",
    "UpstreamError",
    "request_head",
]

# uvicorn, which serves vLLM's API, closes idle connections after 5 s; dropping them first avoids
# sending a request on a connection the server is closing.
_KEEPALIVE_SECONDS = 4.0


class UpstreamError(Exception):
    """An exchange with the replica failed; the class name is shown to the client."""


class ConnectTimeout(UpstreamError):
    """No connection to the replica within ``connect_timeout_seconds`` (a 502)."""


class ReadTimeout(UpstreamError, TimeoutError):
    """Nothing arrived from the replica for ``read_timeout_seconds`` (a 504)."""


class UpstreamClosed(UpstreamError):
    """The replica closed the connection, or sent what is not HTTP, before the response ended."""


class Sink(Protocol):
    """Where a connection delivers one response, as it arrives."""

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The status line and headers are in."""

    def body(self, data: bytes, now: float) -> None:
        """A piece of the body (chunked framing removed), read at ``now`` (``perf_counter``)."""

    def end(self, exc: BaseException | None) -> None:
        """The response is complete (``exc`` None), or failed with ``exc``."""


def request_head(method: bytes, target: bytes, host: bytes, headers: dict[str, str],
                 length: int) -> bytes:  # fmt: skip
    """An HTTP/1.1 request head with ``content-length``; ``headers`` are written as given."""
    lines = [
        b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n" % (method, target, host, length)
    ]
    lines += [
        b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
    ]
    lines.append(b"\r\n")
    return b"".join(lines)


class Connection(asyncio.Protocol):
    """One keep-alive connection to the replica, serving one exchange at a time."""

    # Read on every block of every stream: slots keep them in the object, not in a dict of its own.
    __slots__ = ("_headers", "_parser", "_pool", "_sink", "_timer", "closed", "idle_since",
                 "last_read", "transport")  # fmt: skip

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._sink: Sink | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self.idle_since = 0.0
        # perf_counter of the last arrival (or of the request sent); None while not waiting.
        self.last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport (a stream transport: uvloop's is not an ``asyncio.Transport`` subclass)."""
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        """Parse; the parser's callbacks feed the sink."""
        self.last_read = time.perf_counter()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamClosed(f"invalid HTTP from the replica: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        """End an exchange in flight with an error; an idle connection just leaves the pool."""
        self.closed = True
        self._pool.forget(self)
        self._fail(
            UpstreamClosed("the replica closed the connection") if exc is None else _wrap(exc)
        )

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        """Collect a response header."""
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        """Hand the head to the sink."""
        headers, self._headers = self._headers, []
        if self._sink is not None:
            self._sink.head(self._parser.get_status_code(), headers)

    def on_body(self, body: bytes) -> None:
        """Hand a piece of the body to the sink."""
        if self._sink is not None:
            self._sink.body(body, self.last_read)

    def on_message_complete(self) -> None:
        """The exchange is over: back to the pool when the replica keeps the connection."""
        sink, self._sink = self._sink, None
        self._disarm()
        if self._parser.should_keep_alive() and self.transport is not None:
            self._pool.release(self)
        else:
            self.close()
        if sink is not None:
            sink.end(None)

    # -- the exchange ----------------------------------------------------------------------------

    def send(self, data: bytes, sink: Sink, read_timeout_seconds: float) -> None:
        """Write a whole request and deliver its response to ``sink``."""
        assert self.transport is not None
        self._sink = sink
        self.last_read = time.perf_counter()
        self._timer = asyncio.get_running_loop().call_later(
            read_timeout_seconds, self._check, read_timeout_seconds
        )
        if not self.transport.is_reading():
            # The last exchange may have ended while its client had paused reading.
            self.transport.resume_reading()
        self.transport.write(data)

    def pause_reading(self) -> None:
        """Stop reading from the replica (the client cannot take more for now)."""
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Read again."""
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        """Close the connection: a request still running is aborted by vLLM when it sees this."""
        self._sink = None
        self._disarm()
        self.closed = True
        self._pool.forget(self)
        if self.transport is not None:
            self.transport.close()

    def _check(self, seconds: float) -> None:
        waited = time.perf_counter() - self.last_read
        if self._sink is None:
            return
        if self.transport is not None and not self.transport.is_reading():
            # Paused by a slow client: the replica is not the one keeping the exchange waiting.
            waited = 0.0
        if waited >= seconds:
            self._fail(ReadTimeout("Timeout on reading data from the replica"))
            self.close()
            return
        self._timer = asyncio.get_running_loop().call_later(seconds - waited, self._check, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, exc: BaseException) -> None:
        sink, self._sink = self._sink, None
        self._disarm()
        if sink is not None:
            sink.end(exc)


def _wrap(exc: Exception) -> UpstreamError:
    error = UpstreamClosed(f"the connection to the replica failed: {exc}")
    error.__cause__ = exc
    return error


class Pool:
    """Keep-alive connections to one replica; the most recently used idle one is reused first."""

    def __init__(self, host: str, port: int, connect_timeout_seconds: float,
                 read_timeout_seconds: float) -> None:  # fmt: skip
        self.host, self.port = host, port
        self.connect_timeout_seconds = connect_timeout_seconds
        self.read_timeout_seconds = read_timeout_seconds
        self._idle: deque[Connection] = deque()
        self._all: set[Connection] = set()

    async def connection(self) -> Connection:
        """An idle connection that is still fresh, else a new one.

        ConnectTimeout or UpstreamClosed when the replica cannot be reached.
        """
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < _KEEPALIVE_SECONDS:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_seconds):
                _, conn = await loop.create_connection(
                    lambda: Connection(self), self.host, self.port
                )
        except TimeoutError:
            raise ConnectTimeout("connect timeout") from None
        except OSError as exc:
            raise UpstreamClosed(type(exc).__name__) from exc
        self._all.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        """Take back a connection whose exchange ended cleanly."""
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def forget(self, conn: Connection) -> None:
        """Drop a closed connection."""
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    async def close(self) -> None:
        """Close every connection."""
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        self._all.clear()
