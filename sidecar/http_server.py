"""The sidecar's HTTP/1.1 server: httptools' parser on an asyncio protocol, serving an ASGI app.

Why not uvicorn, which serves the other infermeter servers: every request of the sidecar is on
the metered path, and uvicorn's per-request machinery is general. Per request it makes a scope
with a copy of the lifespan state, a ``RequestResponseCycle`` with an ``asyncio.Event`` (and one
more per connection for flow control; each allocates a deque block on first wait), checks every
response header against two regular expressions, and keeps a ``server`` header; importing it
also imports click. Measured on the sidecar (docs/benchmarks.md): about 3 KiB of its 7 KiB per
open stream and about 6 MB of its idle RSS. This module serves the subset of ASGI 3 the sidecar
uses, with nothing per request but the scope, one slotted exchange and the task:

- ``http`` scopes with ``method``, ``path``, ``raw_path``, ``query_string``, ``headers`` (names
  lower-cased), ``http_version``, ``scheme``, ``server``, ``client``, ``root_path``, and the
  extensions of ``infermeter.http_guard`` (``RawWriter``, the body-complete flag);
- ``receive``: the body as it arrives (reading pauses while 64 KiB are unread), then
  ``http.disconnect`` once the client has gone or the response is complete; an ``Expect:
  100-continue`` is answered on the first ``receive``;
- ``send``: ``content-length`` when the app gives one, else chunked (never for HEAD, 204, 304),
  a ``date`` header, ``connection: close`` when the connection closes after the response; a
  header value with CR or LF is refused (it would split the response);
- keep-alive with an idle timeout that only a request's first byte ends; a response given before
  its request's body is all in closes the connection; pipelined requests are answered in order,
  one at a time, at most 16 waiting (the connection closes past that);
- the bounds of ``infermeter.http_guard``: the header deadline (408), the header size (431, also
  inside one long header line) and the connection cap; a malformed request gets 400 and the
  connection closes. While an earlier request is answered, none of these is written (it would
  land in that answer): reading stops and the connection closes once that answer is complete;
- ``lifespan``: a failed start-up is logged and the process exits with status 3, as uvicorn's;
- graceful stop: stop listening, close idle connections, let running responses end, cancel
  what still runs after ``graceful_seconds``, then the lifespan's shutdown.

Not served: TLS, WebSocket and other upgrades. A request asking for one is answered as plain
HTTP/1.1 and the connection then closes; nothing after its head is read, since httptools hands
those bytes to the new protocol (read as HTTP, they could smuggle a second request). An HTTP/1.0
client, which cannot read chunked framing, gets a body of unknown length as it is, ended by the
connection closing (uvicorn would send it chunked).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools

from infermeter.asgi import Message, Scope
from infermeter.http_guard import (
    BODY_COMPLETE,
    DEFAULT_LIMITS,
    HEADERS_TOO_LARGE,
    RAW_WRITER,
    REQUEST_TIMEOUT,
    RawWriter,
    ServerLimits,
)

__all__ = ["STARTUP_FAILURE", "HttpServer"]

log = logging.getLogger("infermeter.http")

# uvicorn's exit status for a start-up that failed; kept, so supervisors read it the same way.
STARTUP_FAILURE = 3
# Unread request body past which the connection stops reading (uvicorn's HIGH_WATER_LIMIT).
_BODY_HIGH_WATER = 65536
# Requests parsed while another is answered, at most, per connection (clients pipeline a few).
_MAX_PIPELINED = 16
_BACKLOG = 2048


def _status_line(code: int) -> bytes:
    try:
        phrase = HTTPStatus(code).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (code, phrase)


_STATUS = {code: _status_line(code) for code in range(100, 600)}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BAD_REQUEST = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 24\r\nconnection: close\r\n\r\nInvalid HTTP request.\r\n\r\n"
)
_SERVER_ERROR = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", b"21"),
    (b"connection", b"close"),
]
_DISCONNECT: Message = {"type": "http.disconnect"}
App = Callable[..., Any]


class _Exchange:
    """One request and its response: the ASGI ``receive`` and ``send`` of one scope."""

    __slots__ = (
        "body",
        "body_done",
        "chunked",
        "conn",
        "done",
        "expect_continue",
        "head_only",
        "keep_alive",
        "more_body",
        "remaining",
        "scope",
        "started",
        "unread",
        "until_close",
        "waiter",
    )

    def __init__(self, conn: _Connection, scope: Scope, keep_alive: bool, expect: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect
        self.head_only = scope["method"] == "HEAD"
        self.body: list[bytes] = []
        self.unread = 0
        self.more_body = True
        # The last http.request message (more_body false) was given to the app.
        self.body_done = False
        self.waiter: asyncio.Future[None] | None = None
        self.started = False
        self.done = False
        self.chunked = False
        # The body ends with the connection (no length, no chunks: an HTTP/1.0 client).
        self.until_close = False
        self.remaining = 0

    def wake(self) -> None:
        """Something ``receive`` waits for happened (body, its end, the client gone, the end)."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> Message:
        """The next ``http.request`` message, or ``http.disconnect``."""
        conn = self.conn
        if self.expect_continue:
            self.expect_continue = False
            if not conn.lost:
                conn.write(_CONTINUE)
        while True:
            if conn.lost or self.done:
                return _DISCONNECT
            if self.body or (not self.more_body and not self.body_done):
                data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body = []
                self.unread = 0
                self.body_done = not self.more_body
                conn.body_read()
                return {"type": "http.request", "body": data, "more_body": self.more_body}
            self.waiter = conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def send(self, message: Message) -> None:
        """Write the response's head or a piece of its body."""
        conn = self.conn
        if conn.write_paused and not conn.lost:
            await conn.drained()
        if conn.lost:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got {kind!r}."
                )
            self._start(message["status"], message.get("headers", ()))
        elif not self.done:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got {kind!r}.")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message {kind!r} after the response was complete.")

    def _start(self, status: int, headers: Any) -> None:
        head = [_STATUS[status]]
        chunked: bool | None = None
        close = False
        for name, value in headers:
            if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name:
                raise RuntimeError("Invalid HTTP header: CR or LF in a response header.")
            lower = name.lower()
            if lower == b"content-length" and chunked is None:
                self.remaining = int(value)
                chunked = False
            elif lower == b"transfer-encoding" and value.lower() == b"chunked":
                self.remaining = 0
                chunked = True
            elif lower == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                close = True
            head += (lower, b": ", value, b"\r\n")
        # Started only once the head is valid: a refused head can still become a 500.
        self.started = True
        self.expect_continue = False
        head.append(self.conn.server.date_line)
        if self.conn.closing or self.more_body:
            # (A body not all in yet: the parser would read its rest, or a request the client
            # sends after giving up on ``100-continue``, as the next request. Close instead.)
            self.keep_alive = False
        if not self.keep_alive and not close:
            head.append(b"connection: close\r\n")
        if chunked is None and not self.head_only and status not in (204, 304):
            if self.scope["http_version"] == "1.0":
                # An HTTP/1.0 client cannot read chunked framing: the body ends with the
                # connection, which a 1.0 request never keeps.
                self.until_close = True
            else:
                chunked = True
                head.append(b"transfer-encoding: chunked\r\n")
        self.chunked = bool(chunked)
        head.append(b"\r\n")
        # Held back to go out with the body's first piece in one write (one system call and one
        # segment, not two), and written on the loop's next turn if no piece comes before.
        raw = self.conn.raw
        assert raw is not None
        raw.head = b"".join(head)
        raw.chunked = self.chunked
        self.conn.loop.call_soon(raw.flush)

    def _body(self, body: bytes, more: bool) -> None:
        conn = self.conn
        out = b""
        if self.head_only:
            self.remaining = 0
        elif self.chunked:
            if more:
                if body:
                    out = b"%x\r\n%b\r\n" % (len(body), body)
            elif body:
                out = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
            else:
                out = b"0\r\n\r\n"
        elif self.until_close:
            out = body
        else:
            if len(body) > self.remaining:
                raise RuntimeError("Response content longer than Content-Length")
            self.remaining -= len(body)
            out = body
        raw = conn.raw
        if raw is not None and raw.head:
            out, raw.head = raw.head + out, b""
        if out:
            conn.write(out)
        if not more:
            if self.remaining:
                raise RuntimeError("Response content shorter than Content-Length")
            self.done = True
            self.wake()
            conn.answered(self)


class _Connection(asyncio.Protocol):
    """One client connection: parse requests, run each as an ASGI task, one answered at a time."""

    __slots__ = (
        "_answering",
        "_between",
        "_deadline",
        "_drained",
        "_expect",
        "_head_read",
        "_header_bytes",
        "_headers",
        "_heading",
        "_idle",
        "_ignore",
        "_parsing",
        "_queued",
        "_reading_paused",
        "_url",
        "closing",
        "limits",
        "local",
        "loop",
        "lost",
        "parser",
        "peer",
        "raw",
        "server",
        "transport",
        "write_paused",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.limits = server.limits
        # Made when bytes come and dropped between requests (``data_received``).
        self.parser: httptools.HttpRequestParser | None = None
        # The last request parsed is complete and the next has not begun: a new parser would
        # read what comes next as this one would.
        self._between = True
        self.transport: asyncio.Transport | None = None
        self.raw: RawWriter | None = None
        self.local: tuple[str, int] | None = None
        self.peer: tuple[str, int] | None = None
        self.lost = False
        # Once the server stops: answer what runs, then close.
        self.closing = False
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._reading_paused = False
        # The request being parsed, the one being answered, and those parsed in between.
        self._parsing: _Exchange | None = None
        self._answering: _Exchange | None = None
        # (A list, not a deque: pipelining is rare, and an empty deque is 600 bytes a connection.)
        self._queued: list[_Exchange] = []
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0
        self._expect = False
        self._deadline: asyncio.TimerHandle | None = None
        # A request's head has begun and is not complete yet; bytes read for it past its first read.
        self._heading = False
        self._head_read = 0
        # After an upgrade request: nothing more on this connection is read (module docstring).
        self._ignore = False
        self._idle: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports do not subclass asyncio.Transport, so a cast, not an isinstance.)
        transport = cast("asyncio.Transport", transport)
        self.transport = transport
        connections = self.server.connections
        connections.add(self)
        self.raw = RawWriter(transport, self.loop.create_future())
        if len(connections) > self.limits.max_connections:
            transport.close()
            return
        self.local = self.server.local_address(transport.get_extra_info("sockname"))
        self.peer = _address(transport.get_extra_info("peername"))
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.lost = True
        self._disarm()
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._answering is not None:
            self._answering.wake()
        # (Nothing is parsed after the loss; the exchange being parsed would keep a cycle.)
        self._parsing = None
        self._queued.clear()
        if self.raw is not None:
            self.raw.connection_lost()
        self._wake_drained()

    def data_received(self, data: bytes) -> None:
        if self._ignore:
            return
        heading = self._heading
        parser = self.parser
        if parser is None:
            parser = self.parser = _request_parser(self)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # answered as plain HTTP/1.1, then closed (module docstring)
        except httptools.HttpParserError:
            self._refuse(_BAD_REQUEST)
            return
        if self._between:
            # Not kept while the request is answered: a stream can run for minutes, and the
            # parser with its bound callbacks is 0.9 KiB of every open one. Making the next
            # costs 0.3 µs (docs/benchmarks.md).
            self.parser = None
        if not self._heading:
            return
        if heading:
            # A whole read inside one head: httptools joins a long header line itself and calls
            # back only at its end, so the size is bounded here, by the bytes read for the head.
            self._head_read += len(data)
            if self._head_read > self.limits.max_header_bytes:
                self._refuse(HEADERS_TOO_LARGE)
                return
        if self._deadline is None and not self._reading_paused:
            # A head split across reads: its deadline runs from its first bytes. (A head that
            # came whole, as a kept-alive client's usually does, never costs a timer; one
            # behind a pipelined request gets it when reading resumes.)
            self._arm()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.raw is not None:
            self.raw.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.raw is not None:
            self.raw.resume()
        self._wake_drained()

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._between = False
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._expect = False
        self._heading = True
        self._head_read = 0
        if self._idle is not None:
            # Only a request's first byte ends the keep-alive wait: stray bytes (a lone CRLF,
            # the rest of a body the app did not read) do not keep a connection open.
            self._idle.cancel()
            self._idle = None

    # (The size count is written out in both callbacks, not called: they run per header of
    # every request, before it is forwarded.)

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(HEADERS_TOO_LARGE)
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(HEADERS_TOO_LARGE)
        lower = _NAMES.get(name)
        name = name.lower() if lower is None else lower
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._heading = False
        self._disarm()
        if self._ignore or self.transport is None or self.transport.is_closing():
            # Refused while its headers were parsed (431, 408) or the connection is going: the
            # parser still calls back for what it was fed, but nothing may run for it.
            return
        parser = self.parser
        assert parser is not None  # (called back by it)
        version = parser.get_http_version()
        url = httptools.parse_url(self._url)
        raw_path: bytes = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        scope: Scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": version,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "path": path,
            "raw_path": raw_path,
            "query_string": url.query or b"",
            "root_path": "",
            "headers": self._headers,
            "server": self.local,
            "client": self.peer,
            "extensions": {RAW_WRITER: self.raw, BODY_COMPLETE: False},
        }
        keep_alive = version != "1.0" and parser.should_keep_alive()
        if parser.should_upgrade():
            # httptools hands what follows the head to the new protocol, which is not served:
            # the request is answered, and nothing after its head is read (or it could smuggle
            # a second request in its body).
            self._ignore = True
            keep_alive = False
        exchange = _Exchange(self, scope, keep_alive, self._expect and version == "1.1")
        self._parsing = exchange
        if self._answering is None:
            self._start(exchange)
        elif len(self._queued) >= _MAX_PIPELINED:
            self.close()  # one read of tiny requests must not queue thousands
        else:
            self._queued.append(exchange)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self._parsing
        if exchange is None or exchange.done:
            return
        exchange.body.append(body)
        exchange.unread += len(body)
        if exchange.unread > _BODY_HIGH_WATER:
            self._pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        self._between = True
        exchange = self._parsing
        if exchange is None:
            return
        self._parsing = None
        exchange.more_body = False
        exchange.scope["extensions"][BODY_COMPLETE] = True
        exchange.wake()

    # -- for the exchange ------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Write to the client unless the connection is closing."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def close(self) -> None:
        """Close the connection (after what is written)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    async def drained(self) -> None:
        """Return once the client's socket buffer has room again (or the client is gone)."""
        if self._drained is None or self._drained.done():
            self._drained = self.loop.create_future()
        await self._drained

    def body_read(self) -> None:
        """The app took the body it was given: read more if reading paused for it."""
        if self._reading_paused and not self._queued:
            self._resume_reading()

    def answered(self, exchange: _Exchange) -> None:
        """``exchange``'s response is complete: close, or answer the next request, or idle."""
        if exchange is self._answering:
            self._answering = None
        if not exchange.keep_alive or self.closing:
            self.close()
            return
        if self.transport is None or self.transport.is_closing():
            return
        if self._queued:
            self._start(self._queued.pop(0))
        if not self._queued:
            self._resume_reading()
        if self._answering is None:
            self._idle = self.loop.call_later(self.limits.keep_alive_seconds, self.close)

    def shutdown(self) -> None:
        """The server stops: close now if idle, else once the running response is complete."""
        self.closing = True
        if self._answering is None:
            self.close()

    # -- internals -------------------------------------------------------------------------------

    def _start(self, exchange: _Exchange) -> None:
        self._answering = exchange
        # The task leaves the set at the end of ``_run``.
        self.server.tasks.add(self.loop.create_task(self._run(exchange)))

    async def _run(self, exchange: _Exchange) -> None:
        try:
            try:
                await self.server.app(exchange.scope, exchange.receive, exchange.send)
            except asyncio.CancelledError:
                self.close()
                return
            except BaseException as exc:  # the app's failure must not take the server down
                log.error("Exception in ASGI application", exc_info=exc)
                if exchange.done:
                    return  # its response is whole; the next request on the connection may run
            else:
                if self.lost or exchange.done:
                    return
                missing = "completing" if exchange.started else "starting"
                log.error("ASGI callable returned without %s response.", missing)
            if exchange.started or self.lost:
                # Half a response cannot be mended: the client sees the connection close.
                self.close()
                return
            exchange.keep_alive = False
            await exchange.send(
                {"type": "http.response.start", "status": 500, "headers": _SERVER_ERROR}
            )
            await exchange.send({"type": "http.response.body", "body": b"Internal Server Error"})
        finally:
            # (Here, not a done callback: that would cost a bound method and a context copy. The
            # loop is given: without it, Python 3.11 asks the kernel for the process id.)
            self.server.tasks.discard(asyncio.current_task(self.loop))
            if self.lost and self._answering is exchange:
                # The exchange and its connection refer to each other: unlinked, both are freed
                # now by their counts of references, not at the next full collection.
                self._answering = None

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(
            self.limits.header_timeout_seconds, self._refuse, REQUEST_TIMEOUT
        )

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _refuse(self, answer: bytes) -> None:
        """Answer a request that cannot be read (400, 408, 431) and close.

        While an earlier request is answered or waits, nothing is written (an answer written now
        would land in that request's response, or be read as its answer): the connection reads
        no more and closes once that answer is complete.
        """
        self._heading = False
        self._disarm()
        if self._answering is None and not self._queued:
            self.write(answer)
            self.close()
            return
        if self._parsing is not None and self._parsing is self._answering:
            self.close()  # the request being answered is the broken one: its body cannot come
            return
        # Read nothing more; the running answer ends, then the connection closes (``answered``).
        self._ignore = True
        self.closing = True

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
            # A head the server stopped reading is not the client's delay.
            self._disarm()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.lost:
            self._reading_paused = False
            self.transport.resume_reading()
            if self._heading and self._deadline is None:
                self._arm()

    def _wake_drained(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)


_ASGI = {"version": "3.0", "spec_version": "2.3"}
# The header names clients send most, lower-cased once: a request keeps these, not a bytes object
# of its own per header for as long as it is answered (a stream's memory); any other name is
# lower-cased as it comes. Spelled as sent: lower case, or capitalised as most clients write them.
_NAMES = {
    spelling: name
    for name in (
        b"accept",
        b"accept-encoding",
        b"authorization",
        b"connection",
        b"content-length",
        b"content-type",
        b"expect",
        b"host",
        b"traceparent",
        b"tracestate",
        b"transfer-encoding",
        b"user-agent",
        b"x-request-id",
        # The OpenAI SDK's own (sent lower-cased by httpx).
        b"x-stainless-arch",
        b"x-stainless-async",
        b"x-stainless-lang",
        b"x-stainless-os",
        b"x-stainless-package-version",
        b"x-stainless-read-timeout",
        b"x-stainless-retry-count",
        b"x-stainless-runtime",
        b"x-stainless-runtime-version",
    )
    for spelling in (name, name.title())
}


# httptools < 0.6.3 has no leniencies.
_LENIENT = hasattr(httptools.HttpRequestParser, "set_dangerous_leniencies")


def _request_parser(conn: _Connection) -> httptools.HttpRequestParser:
    """A parser calling back ``conn``."""
    parser = httptools.HttpRequestParser(conn)
    if _LENIENT:
        # Parse what a client pipelined after a request that asked for the connection closed.
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser


def _address(value: Any) -> tuple[str, int] | None:
    """``(host, port)`` of a socket name, None for anything else (a Unix socket)."""
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


class _Lifespan:
    """ASGI's lifespan protocol, run in a task of its own as uvicorn does."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.started: asyncio.Future[bool] = loop.create_future()
        self.stopped: asyncio.Future[None] = loop.create_future()
        self.task: asyncio.Task[None] | None = None

    async def startup(self) -> bool:
        """Run the app's start-up; False when it failed (logged)."""
        self.task = asyncio.get_running_loop().create_task(self._run())
        await self.inbox.put({"type": "lifespan.startup"})
        return await self.started

    async def shutdown(self) -> None:
        """Run the app's shutdown, once its start-up completed."""
        if self.task is None or self.task.done():
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        await self.stopped

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": _ASGI, "state": {}}
        try:
            await self.app(scope, self.inbox.get, self._send)
        except BaseException as exc:
            log.error("Exception in 'lifespan' protocol", exc_info=exc)
        finally:
            if not self.started.done():
                self.started.set_result(False)
            if not self.stopped.done():
                self.stopped.set_result(None)

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self.started.set_result(True)
        elif kind == "lifespan.startup.failed":
            log.error("%s", message.get("message", "start-up failed"))
            self.started.set_result(False)
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            if kind.endswith("failed"):
                log.error("%s", message.get("message", "shutdown failed"))
            self.stopped.set_result(None)


class HttpServer:
    """Serve ``app`` on ``host:port`` until ``should_exit`` is set (the surface of uvicorn.Server
    that infermeter uses: ``serve``, ``started``, ``should_exit``).

    ``on_signal``: SIGTERM and SIGINT go to it on the event loop, and the server does not stop
    by itself (the sidecar's drain sets ``should_exit``). Without it, signals are left alone.
    """

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        *,
        limits: ServerLimits = DEFAULT_LIMITS,
        lifespan: bool = True,
        on_signal: Callable[[signal.Signals], None] | None = None,
        graceful_seconds: float = 2.0,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.limits = limits
        self.lifespan = lifespan
        self.on_signal = on_signal
        self.graceful_seconds = graceful_seconds
        self.started = False
        self.should_exit = False
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.date_line = b""
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set in serve
        self._local: tuple[str, int] | None = None

    def local_address(self, sockname: Any) -> tuple[str, int] | None:
        """The scope's ``server`` of a connection with this ``sockname``: one tuple shared by the
        connections on one address, not one more held by each (an open stream's memory)."""
        address = _address(sockname)
        if address != self._local:
            self._local = address
        return self._local

    @property
    def url(self) -> str:
        """Where it listens."""
        return f"http://{self.host}:{self.port}"

    async def serve(self) -> None:
        """Start up, listen, serve until ``should_exit``, then stop gracefully."""
        self.loop = asyncio.get_running_loop()
        lifespan = _Lifespan(self.app) if self.lifespan else None
        if lifespan is not None and not await lifespan.startup():
            log.error("Application startup failed. Exiting.")
            sys.exit(STARTUP_FAILURE)
        self._date()
        try:
            listener = await self.loop.create_server(
                lambda: _Connection(self),
                self.host,
                self.port,
                backlog=_BACKLOG,
                reuse_address=True,
            )
        except OSError as exc:
            log.error("%s", exc)
            if lifespan is not None:
                await lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        self.started = True
        with self._signals():
            while not self.should_exit:
                await asyncio.sleep(0.1)
                self._date()
        await self._stop(listener, lifespan)

    def _date(self) -> None:
        """Refresh the ``date`` header (once per second is what HTTP's resolution needs)."""
        self.date_line = b"date: %s\r\n" % formatdate(time.time(), usegmt=True).encode()

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        handler = self.on_signal
        if handler is None:
            yield
            return
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            self.loop.add_signal_handler(sig, handler, sig)
        try:
            yield
        finally:
            for sig in signals:
                self.loop.remove_signal_handler(sig)

    async def _stop(self, listener: asyncio.Server, lifespan: _Lifespan | None) -> None:
        listener.close()
        for conn in list(self.connections):
            conn.shutdown()
        try:
            async with asyncio.timeout(self.graceful_seconds):
                while self.connections or self.tasks:
                    await asyncio.sleep(0.05)
        except TimeoutError:
            log.error("Cancel %d running task(s), graceful shutdown timed out", len(self.tasks))
            for task in list(self.tasks):
                task.cancel()
            for conn in list(self.connections):
                conn.close()
        if lifespan is not None:
            await lifespan.shutdown()
