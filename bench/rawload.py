"""A raw-socket load client: keep-alive connections that re-send one streaming request.

httpx costs more CPU per streamed chunk than the servers being measured, so the benchmarks
drive them with a bare ``asyncio.Protocol`` instead (docs/benchmarks.md). The connection
handling is here; each benchmark subclasses ``RepeatingStream`` for what it counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, cast

__all__ = ["END", "RepeatingStream", "run_connections"]

END: Final = b"\r\n0\r\n\r\n"  # the last chunk of a chunked HTTP/1.1 body


class RepeatingStream(asyncio.Protocol):
    """One keep-alive connection re-sending ``request`` until ``stop`` is set.

    A response that is not ``200`` with a chunked body (or one with a content-length: a
    non-streamed answer) closes the connection and counts as an error. Subclasses count what they need in ``on_send``, ``on_body`` and ``on_error``.
    """

    def __init__(self, request: bytes, stop: asyncio.Event) -> None:
        self.request = request
        self.stop = stop
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.in_body = False
        self.end_tail = b""
        # Body bytes still to come of a response with a content-length (-1: a chunked one).
        self.remaining = -1

    def on_send(self) -> None:
        """A request is about to go out."""

    def on_body(self, data: bytes) -> None:
        """Body bytes of the current response arrived."""

    def on_done(self) -> None:
        """The current response ended."""

    def on_error(self) -> None:
        """The response was not a 200 stream; the connection is being closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.head, self.in_body, self.end_tail, self.remaining = b"", False, b"", -1
        self.on_send()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if not self.in_body:
            self.head += data
            split = self.head.find(b"\r\n\r\n")
            if split < 0:
                return
            head, data = self.head[:split], self.head[split + 4 :]
            lower = head.lower()
            length = _content_length(lower)
            if not head.startswith(b"HTTP/1.1 200") or (b"chunked" not in lower and length < 0):
                self.on_error()
                self.transport.close()
                return
            self.in_body, self.remaining = True, length
        self.on_body(data)
        if self.remaining >= 0:
            self.remaining -= len(data)
            finished = self.remaining <= 0
        else:
            self.end_tail = (self.end_tail + data)[-len(END) :]
            finished = self.end_tail == END
        if finished:
            self.on_done()
            if self.stop.is_set():
                self.transport.close()
            else:
                self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _content_length(head: bytes) -> int:
    """The content-length of a lower-cased response head, -1 without one."""
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return -1
    start = at + len(b"\r\ncontent-length:")
    end = head.find(b"\r\n", start)
    return int(head[start : end if end >= 0 else len(head)])


async def run_connections(
    make: Callable[[], RepeatingStream],
    host: str,
    port: int,
    stop: asyncio.Event,
    on_connect_error: Callable[[], None],
    live: set[RepeatingStream] | None = None,
) -> None:
    """Keep one connection from ``make`` open until ``stop``, reconnecting when it closes."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            _, proto = await loop.create_connection(make, host, port)
        except OSError:
            on_connect_error()
        else:
            if live is not None:
                live.add(proto)
            await proto.closed
            if live is not None:
                live.discard(proto)
        if not stop.is_set():
            await asyncio.sleep(0.05)  # the server closed on us or is gone; do not spin
