"""Both server protocols (uvicorn's, guarded, and the sidecar's own) mark a whole body, and only it.

Each marks a request whose whole body has arrived, and only then.

An application may skip its body deadline for such a request (``read_body(..., complete=True)``),
so the marker must never be set while a body is still on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from infermeter.asgi import Receive, Scope, Send, read_body, respond
from infermeter.http_guard import BODY_COMPLETE, ServerLimits
from infermeter.serving import free_port, server
from sidecar.http_server import HttpServer


class _Recorder:
    """An ASGI app noting, per request, the marker before and after reading the body."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, bool, bytes]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        before = bool(scope["extensions"].get(BODY_COMPLETE, False))
        body = await read_body(receive, 1 << 20, 5.0, before)
        after = bool(scope["extensions"].get(BODY_COMPLETE, False))
        self.seen.append((before, after, body or b""))
        await respond(send, 200, b"ok", [(b"content-type", b"text/plain")])


async def _exchange(port: int, parts: list[bytes], pause: float) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for part in parts:
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(pause)
    answer = await reader.readuntil(b"ok")
    writer.close()
    return answer


@pytest.fixture(params=["uvicorn", "http_server"])
async def served(request: pytest.FixtureRequest) -> Any:
    """The recorder behind uvicorn with the guard, or behind the sidecar's own server."""
    app = _Recorder()
    port = free_port()
    # A short keep-alive, so that the test of stray bytes runs in seconds.
    limits = ServerLimits(keep_alive_seconds=1)
    srv: Any = (
        server(app, "127.0.0.1", port, lifespan="off", limits=limits)
        if request.param == "uvicorn"
        else HttpServer(app, "127.0.0.1", port, lifespan=False, limits=limits)
    )
    task = asyncio.get_running_loop().create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    yield app, port
    srv.should_exit = True
    await task


async def test_a_body_that_came_with_its_head_is_marked_complete(served: Any) -> None:
    app, port = served
    body = b'{"x": 1}'
    head = b"POST /v HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
    answer = await _exchange(port, [head + body], 0)
    assert answer.startswith(b"HTTP/1.1 200")
    assert app.seen == [(True, True, body)]


async def test_a_body_still_arriving_is_not_marked_until_it_has(served: Any) -> None:
    app, port = served
    head = b"POST /v HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n"
    answer = await _exchange(port, [head + b"01234", b"56789"], 0.2)
    assert answer.startswith(b"HTTP/1.1 200")
    assert app.seen == [(False, True, b"0123456789")]


async def test_a_request_refused_for_its_header_size_is_not_served(served: Any) -> None:
    """Headers past the 64 KiB cap, sent whole with a body in one write: 431, and no request."""
    app, port = served
    head = b"POST /v HTTP/1.1\r\nhost: x\r\nx-filler: %b\r\ncontent-length: 2\r\n\r\n" % (
        b"f" * 70_000
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"hi")
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 431 ")
    await asyncio.sleep(0.1)
    assert app.seen == []


async def test_one_header_line_past_the_cap_in_many_reads_is_refused(served: Any) -> None:
    """httptools joins a long header value itself: the cap must hold inside one line too.

    The server answers 431 and closes (the client, still writing, may see a reset instead);
    without the bound it would keep reading the line until the header deadline.
    """
    app, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-long: ")
    await writer.drain()
    answer = b""
    with contextlib.suppress(ConnectionError):
        for _ in range(40):  # 40 x 8 KiB = 320 KiB of one value, well past the 64 KiB cap
            await asyncio.sleep(0.02)
            writer.write(b"v" * 8192)
            await writer.drain()
    with contextlib.suppress(ConnectionError):
        answer = await asyncio.wait_for(reader.read(), 3)  # TimeoutError: still reading it
    writer.close()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 ")
    assert app.seen == []


async def test_stray_bytes_do_not_keep_a_kept_alive_connection_open(served: Any) -> None:
    """A CRLF every 0.3 s after an answer: the 1 s keep-alive wait still ends the connection.

    (uvicorn ends its keep-alive wait on any bytes and arms it again only after a response, so
    without the guard's mend a client holds the connection for as long as it keeps sending.)
    """
    _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v HTTP/1.1\r\nhost: x\r\n\r\n")
    await reader.readuntil(b"ok")
    closed = False
    for _ in range(10):  # 3 s of stray bytes
        await asyncio.sleep(0.3)
        try:
            writer.write(b"\r\n")
            await writer.drain()
            closed = reader.at_eof() or await _eof_within(reader, 0.01)
        except ConnectionError:
            closed = True
        if closed:
            break
    writer.close()
    assert closed


async def _eof_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except TimeoutError:
        return False
