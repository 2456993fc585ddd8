"""Deadlines and caps uvicorn does not have: a header deadline, a header size cap, a connection cap.

Measured on uvicorn 0.54 with httptools: a connection that sends nothing, or trickles its request
headers a byte at a time, is held open for ever (the keep-alive timeout is armed only after a
first request), every accepted connection is kept however many there are (``limit_concurrency``
only answers 503 to requests whose headers are complete), and header lines are collected without
a size limit. One pod could hold every file descriptor of a sidecar that way. This protocol adds
the three missing bounds on top of uvicorn's own, and nothing else:

- the request line and headers must arrive within ``header_timeout_seconds`` of the connection
  opening (or of the first byte of a later request on it), else ``408`` and the connection closes;
- they may total at most ``max_header_bytes``, else ``431`` and the connection closes;
- past ``max_connections`` open connections, a new one is closed as soon as it is accepted.

The body has its own deadline in the application, which reads it (``infermeter.asgi.read_body``).

Each request's scope also carries a ``RawWriter`` (``scope["extensions"]["infermeter.raw"]``): a
streaming application may write the chunks of a response body it started with ``send`` straight
to the client's transport, and be told when the client stops taking them. Once the whole body
has arrived, ``scope["extensions"]["infermeter.body_complete"]`` is true: reading it then cannot
wait, so the application's body deadline (a timer per request) can be skipped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BODY_COMPLETE",
    "DEFAULT_LIMITS",
    "HEADERS_TOO_LARGE",
    "RAW_WRITER",
    "REQUEST_TIMEOUT",
    "RawWriter",
    "ServerLimits",
    "WriterListener",
    "guarded_protocol",
]

RAW_WRITER = "infermeter.raw"
BODY_COMPLETE = "infermeter.body_complete"

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
HEADERS_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True)
class ServerLimits:
    """The bounds every infermeter server applies to its clients."""

    header_timeout_seconds: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 4096
    keep_alive_seconds: int = 5


DEFAULT_LIMITS = ServerLimits()


class WriterListener(Protocol):
    """What a relay is told of its client's connection (``RawWriter.listener``)."""

    def writer_paused(self) -> None:
        """The client's socket buffer is full: stop producing."""

    def writer_resumed(self) -> None:
        """It drained: produce again."""

    def writer_lost(self) -> None:
        """The connection closed."""


class RawWriter:
    """Chunks of a started chunked response, written to the client's transport past ASGI.

    The response must have been started with ``send`` (``http.response.start``, no
    content-length) and must be ended with ``send`` too (the last ``http.response.body``), so the
    server keeps its own account of the response; in between, ``write`` frames and writes each
    piece at once. ``listener`` (a ``WriterListener``, one for the response being relayed) is told
    when the client's socket buffer fills and drains again, and when the connection closes;
    ``paused`` says which holds now. ``lost`` resolves when the connection closes: a relay waits
    on it, where waiting for ASGI's ``http.disconnect`` takes a task. (One listener object, not a
    callable per event: three bound methods would be about 200 bytes of every open stream.)

    ``head``: the response's head when the server holds it back to send it with the first piece
    of the body in one write (``sidecar.http_server``; uvicorn writes it at once).
    """

    __slots__ = ("chunked", "head", "listener", "lost", "paused", "transport")

    def __init__(self, transport: asyncio.Transport, lost: asyncio.Future[None]) -> None:
        self.transport = transport
        self.lost = lost
        self.paused = False
        self.head = b""
        # False for a response whose body ends with the connection (an HTTP/1.0 client, which
        # cannot read chunked framing): pieces are written as they are.
        self.chunked = True
        # Told when the connection closes too: a stream that waits for its end on one future of
        # its own is woken by it, not by a callback on ``lost`` (which copies a context).
        self.listener: WriterListener | None = None

    def write(self, data: bytes) -> None:
        """Write ``data`` as one chunk of the body (nothing for empty data)."""
        if data and not self.transport.is_closing():
            frame = b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data
            if self.head:
                frame, self.head = self.head + frame, b""
            self.transport.write(frame)

    def connection_lost(self) -> None:
        """The connection closed: resolve ``lost`` and tell the listener."""
        if not self.lost.done():
            self.lost.set_result(None)
        if self.listener is not None:
            self.listener.writer_lost()

    def flush(self) -> None:
        """Write a head still held back."""
        if self.head:
            if not self.transport.is_closing():
                self.transport.write(self.head)
            self.head = b""

    def pause(self) -> None:
        """The transport's buffer is full."""
        self.paused = True
        if self.listener is not None:
            self.listener.writer_paused()

    def resume(self) -> None:
        """The transport's buffer drained."""
        self.paused = False
        if self.listener is not None:
            self.listener.writer_resumed()


def guarded_protocol(limits: ServerLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with ``limits`` applied, as a class uvicorn can instantiate.

    uvicorn is imported here, not with the module: the sidecar, which serves on its own protocol
    (``sidecar.http_server``), uses this module's writer and limits without loading uvicorn.
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpTools(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _header_bytes = 0
        # A head has begun and is not complete; bytes read for it past its first read.
        _heading = False
        _head_read = 0
        # A request began in the read being parsed.
        _began = False
        _raw: RawWriter | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._raw = RawWriter(transport, self.loop.create_future())
            if len(self.connections) > limits.max_connections:
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)
            if self._raw is not None:
                self._raw.connection_lost()

        def data_received(self, data: bytes) -> None:
            heading = self._heading
            idle = self.timeout_keep_alive_task
            self._began = False
            super().data_received(data)  # (uvicorn cancels the keep-alive wait on any bytes)
            if idle is not None and not self._began and not self.transport.is_closing():
                # Stray bytes between requests (a lone CRLF, the rest of a body the app did not
                # read) do not end the keep-alive wait, nor start it again: it ends when it
                # was to end.
                self.timeout_keep_alive_task = self.loop.call_at(
                    idle.when(), self.timeout_keep_alive_handler
                )
            if heading and self._heading:
                # httptools joins a long header line itself and calls back only at its end:
                # the size is bounded here too, by the bytes read while the head is incomplete.
                self._head_read += len(data)
                if self._head_read > limits.max_header_bytes:
                    self._refuse(HEADERS_TOO_LARGE)

        def on_message_begin(self) -> None:
            self._heading = True
            self._began = True
            self._head_read = 0
            super().on_message_begin()
            if self._raw is not None:
                self.scope["extensions"] = {RAW_WRITER: self._raw}  # type: ignore[dict-item]
            self._header_bytes = 0
            if self._deadline is None:
                self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._heading = False
            self._disarm()
            if self.transport.is_closing():
                # Refused while its headers were parsed (431): the parser still calls back for
                # what it was fed, but no request may start for it.
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self.transport.is_closing():
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self.transport.is_closing():
                return
            super().on_message_complete()
            extensions = self.scope.get("extensions")
            if extensions is not None:
                extensions[BODY_COMPLETE] = True  # type: ignore[assignment]

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._raw is not None:
                self._raw.pause()

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._raw is not None:
                self._raw.resume()

        def _count(self, size: int) -> None:
            self._header_bytes += size
            if self._header_bytes > limits.max_header_bytes:
                self._refuse(HEADERS_TOO_LARGE)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(
                limits.header_timeout_seconds, self._refuse, REQUEST_TIMEOUT
            )

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _refuse(self, answer: bytes) -> None:
            self._heading = False
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    return GuardedHttpTools
