"""A pooled HTTP/1.1 client on asyncio protocols, for the generation requests sent to vLLM.

aiohttp costs, per request, a ``ClientRequest``, a ``ClientResponse``, multidicts and a
``StreamReader``, and per block a task wake-up through ``readany()``; measured, that was most of
the sidecar's CPU per request. Here a connection is an ``asyncio.Protocol`` with httptools'
response parser, and the response is pushed into a ``Sink`` from ``data_received``: the stream
relay meters a block and writes it to the client's transport in the same call, with no task
switch and no copy beyond what the meter makes.

The read timeout is swept, not timed per exchange: one timer for the whole pool wakes every
quarter of the shortest timeout it has served since it was last idle (at most once a second)
and fails the exchanges that have read nothing for their timeout, so one fires between the
timeout and a quarter more (or a second more, for a timeout over four seconds). A
timer per exchange cost every open stream about 500 bytes (the handle, its libuv timer and its
arguments) and every request an arm and a cancel. Reads are paused and resumed by the sink
(``pause_reading``), which is how a slow client slows its upstream instead of being buffered for
without bound; a paused exchange is not timed out, since the replica is not the one keeping it
waiting.

An https replica is spoken to over TLS (``ssl.create_default_context``: the system's CAs, the
host name checked), made once per pool. Its connections are read as they come: the kernel's bytes
are ciphertext, so neither batching (``Connection.batch``) nor reading what the kernel holds
before a close (``Connection.read_received``) applies to them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
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
# The longest interval between two sweeps of the read timeouts.
_SWEEP_SECONDS = 1.0
# What a batched connection (``Connection.batch``) lets the kernel gather before the loop reads:
# a 64-token answer with usage on every chunk is about 20 KiB, read once, at its end.
BATCH_BYTES = 64 << 10


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


def request_head(
    method: bytes, target: bytes, host: bytes, headers: dict[str, str], length: int
) -> bytes:
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
    __slots__ = (
        "_headers",
        "_interim",
        "_lowat",
        "_parser",
        "_pool",
        "_sink",
        "_timeout",
        "closed",
        "idle_since",
        "last_read",
        "transport",
    )

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        # Dropped once the connection is lost: the parser holds the protocol's bound callbacks,
        # a reference cycle that only the cyclic collector would free otherwise.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._sink: Sink | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self.idle_since = 0.0
        # perf_counter of the last arrival (or of the request sent, or of the last sweep that
        # found reading paused by the client).
        self.last_read = 0.0
        # The exchange's read timeout, in seconds.
        self._timeout = 0.0
        self.closed = False
        # The socket's receive low-water mark: above 1 once ``batch`` was called.
        self._lowat = 1
        # True from an interim (1xx) head to its end: the exchange's response is still to come.
        self._interim = False

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport (a stream transport: uvloop's is not an ``asyncio.Transport`` subclass)."""
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        """Parse; the parser's callbacks feed the sink."""
        self.last_read = time.perf_counter()
        parser = self._parser
        if parser is None:
            return
        try:
            parser.feed_data(data)
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
        # Freed now by its count of references, with its transport, not at the next full
        # collection: after a burst of streams, a thousand closed connections held until then
        # are 4 MB more at the next burst's peak (docs/benchmarks.md).
        self._parser = None

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        """Collect a response header."""
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        """Hand the head to the sink, unless it is an interim one (1xx).

        An interim response (``100 Continue``, ``103 Early Hints``) is not the answer: the
        final one follows on the same connection. Taken as the answer, it would end the
        exchange with nothing metered and put the connection back in the pool while the real
        answer was still coming on it, for the next request to read as its own.
        """
        headers, self._headers = self._headers, []
        if self._parser is None:
            return
        status = self._parser.get_status_code()
        if status < 200:
            self._interim = True
            return
        if self._sink is not None:
            self._sink.head(status, headers)

    def on_body(self, body: bytes) -> None:
        """Hand a piece of the body to the sink."""
        if self._sink is not None:
            self._sink.body(body, self.last_read)

    def on_message_complete(self) -> None:
        """The exchange is over: back to the pool when the replica keeps the connection."""
        if self._interim:
            # The end of an interim response: the parser reads the final one next.
            self._interim = False
            return
        sink, self._sink = self._sink, None
        # (A batched connection asked the replica to close it: it never serves a stream.)
        parser = self._parser
        if (
            self._lowat == 1
            and parser is not None
            and parser.should_keep_alive()
            and self.transport is not None
        ):
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
        self._timeout = read_timeout_seconds
        self._pool.watch(read_timeout_seconds)
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

    def batch(self, nbytes: int = BATCH_BYTES) -> None:
        """Have the loop read only once ``nbytes`` have arrived, or the replica closed.

        For a non-streamed answer read from vLLM's stream on a connection the replica closes
        after it (``connection: close``): its client gets nothing before the end, so reading
        every token's chunk as it comes (a wake-up, a read and a parse each) buys nothing; the
        kernel keeps them, and the close says the answer is whole. Whoever needs the tokens so
        far before that reads them with ``pull`` (the journal's tick, a hang-up, the drain, the
        read-timeout sweep).
        """
        transport = self.transport
        sock = None if transport is None or self.closed else transport.get_extra_info("socket")
        if sock is None or self._pool.tls:
            return
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        except OSError:  # (not a TCP socket: it is read as it comes, as before)
            return
        self._lowat = nbytes

    def pull(self) -> None:
        """Parse what a batched connection's kernel holds below its low-water mark."""
        if self._lowat > 1:
            self.read_received()

    def read_received(self, limit: int = 1 << 20) -> None:
        """Parse what the kernel has received on the connection and the loop has not read yet.

        Called before closing on an exchange whose client left: those bytes are tokens the
        replica spent and sent, and the record bills them, where closing would drop them unread
        (how many there are depends on how busy the loop was, not on the replica). At most
        ``limit`` bytes: the replica goes on writing until it sees the close.
        """
        transport = self.transport
        sock = None if transport is None else transport.get_extra_info("socket")
        if sock is None or self._pool.tls:
            return
        fd = sock.fileno()
        while limit > 0 and self._sink is not None and not self.closed:
            try:
                # The socket is non-blocking (the loop's): this takes what is there, no more.
                data = os.read(fd, min(limit, 65536))
            except OSError:  # BlockingIOError: nothing more; any other: the close is next anyway
                return
            if not data:
                return
            limit -= len(data)
            self.data_received(data)

    def close(self) -> None:
        """Close the connection: a request still running is aborted by vLLM when it sees this."""
        self._sink = None
        self.closed = True
        self._pool.forget(self)
        if self.transport is not None:
            self.transport.close()

    def waiting(self, now: float) -> bool:
        """True while an exchange waits on the replica; fails it once its read timeout passed."""
        if self._sink is None:
            return False
        if self._lowat > 1:
            # Bytes waiting below the low-water mark are not silence: read them first.
            self.read_received()
            if self._sink is None:
                return False
        if self.transport is not None and not self.transport.is_reading():
            # Paused by a slow client: the replica is not the one keeping the exchange waiting,
            # so its timeout counts from when reading resumes (at most a sweep later).
            self.last_read = now
            return True
        if now - self.last_read < self._timeout:
            return True
        self._fail(ReadTimeout("Timeout on reading data from the replica"))
        self.close()
        return False

    def _fail(self, exc: BaseException) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.end(exc)


def _wrap(exc: Exception) -> UpstreamError:
    error = UpstreamClosed(f"the connection to the replica failed: {exc}")
    error.__cause__ = exc
    return error


class Pool:
    """Keep-alive connections to one replica; the most recently used idle one is reused first.

    ``tls``: the replica speaks https (its certificate checked against the system's CAs).
    """

    def __init__(
        self,
        host: str,
        port: int,
        connect_timeout_seconds: float,
        read_timeout_seconds: float,
        tls: bool = False,
    ) -> None:
        self.host, self.port, self.tls = host, port, tls
        self._ssl: ssl.SSLContext | None = None
        self.connect_timeout_seconds = connect_timeout_seconds
        self.read_timeout_seconds = read_timeout_seconds
        # Idle connections, most recently released last; a dict, not a deque, so that dropping
        # one (``forget``) is O(1): after a burst of thousands of streams went idle, the next
        # request dropping them all as stale was a scan of the rest for each (116 ms at 5,000).
        self._idle: dict[Connection, None] = {}
        self._all: set[Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_seconds = _SWEEP_SECONDS

    async def connection(self, new: bool = False) -> Connection:
        """An idle connection that is still fresh, else (or with ``new``) a new one.

        ConnectTimeout or UpstreamClosed when the replica cannot be reached.
        """
        now = time.monotonic()
        while self._idle and not new:
            conn, _ = self._idle.popitem()
            if not conn.closed and now - conn.idle_since < _KEEPALIVE_SECONDS:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        if self.tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_seconds):
                _, conn = await loop.create_connection(
                    lambda: Connection(self),
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self.tls else None,
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
        self._idle[conn] = None

    def forget(self, conn: Connection) -> None:
        """Drop a closed connection."""
        self._all.discard(conn)
        self._idle.pop(conn, None)

    def watch(self, read_timeout_seconds: float) -> None:
        """An exchange began: sweep the read timeouts often enough for ``read_timeout_seconds``."""
        seconds = read_timeout_seconds / 4
        if self._sweeper is not None and seconds >= self._sweep_seconds:
            return
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._sweep_seconds = min(self._sweep_seconds, seconds)
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_seconds, self._sweep)

    def _sweep(self) -> None:
        now = time.perf_counter()
        busy = False
        # (A copy: an exchange that times out closes its connection, which leaves the set.)
        for conn in list(self._all):
            busy = conn.waiting(now) or busy
        if busy:
            self._sweeper = asyncio.get_running_loop().call_later(self._sweep_seconds, self._sweep)
        else:
            self._sweeper, self._sweep_seconds = None, _SWEEP_SECONDS

    async def close(self) -> None:
        """Close every connection."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        self._all.clear()
