"""The sidecar's HTTP/1.1 server speaks HTTP as a client expects, over real loopback sockets.

Each test talks raw HTTP/1.1 to ``sidecar.http_server.HttpServer`` (keep-alive, pipelining,
100-continue, HEAD, chunked bodies, bad requests, failing apps, graceful stop, lifespan), so
what is asserted is what is on the wire, not what a client library makes of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httptools
import httpx
import pytest

from infermeter.asgi import Message, Receive, Scope, Send, read_body, respond
from infermeter.http_guard import RAW_WRITER, ServerLimits
from infermeter.serving import free_port
from sidecar.http_server import STARTUP_FAILURE, HttpServer

TEXT = [(b"content-type", b"text/plain")]


class _App:
    """Echo the method, path, query and body; a few paths misbehave on purpose."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.lifespan: list[str] = []
        self.fail_startup = False
        self.paths: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path = scope["path"]
        self.paths.append(path)
        if path == "/boom":
            raise ValueError("the app failed")
        if path == "/silent":
            return
        if path == "/bad-header":
            await respond(send, 200, b"x", [(b"x-evil", b"a\r\nset-cookie: b")])
            return
        if path == "/early":  # answers without reading the body (as a 401 does)
            await respond(send, 401, b"no", [*TEXT, (b"content-length", b"2")])
            return
        if path == "/boom-after":  # fails once its response is complete
            await respond(send, 200, b"ok", [*TEXT, (b"content-length", b"2")])
            raise ValueError("the app failed after answering")
        if path == "/slow":
            await send({"type": "http.response.start", "status": 200, "headers": TEXT})
            await self.release.wait()
            await send({"type": "http.response.body", "body": b"slow done"})
            return
        if path == "/raw":  # a body written past ASGI, as the sidecar's relay writes a stream
            await send({"type": "http.response.start", "status": 200, "headers": TEXT})
            scope["extensions"][RAW_WRITER].write(b"one,")
            scope["extensions"][RAW_WRITER].write(b"two")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body = await read_body(receive, 1 << 22)
        answer = b"%s %s ?%s %d:%s" % (
            scope["method"].encode(),
            scope["raw_path"],
            scope["query_string"],
            len(body or b""),
            (body or b"")[:16],
        )
        if path == "/chunked":
            await send({"type": "http.response.start", "status": 200, "headers": TEXT})
            await send({"type": "http.response.body", "body": answer, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await respond(send, 200, answer, [*TEXT, (b"content-length", b"%d" % len(answer))])

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "lifespan.startup":
                self.lifespan.append("startup")
                if self.fail_startup:
                    await send({"type": "lifespan.startup.failed", "message": "no spool"})
                    return
                await send({"type": "lifespan.startup.complete"})
            else:
                self.lifespan.append("shutdown")
                await send({"type": "lifespan.shutdown.complete"})
                return


@contextlib.asynccontextmanager
async def _serving(app: _App, limits: ServerLimits | None = None) -> AsyncIterator[HttpServer]:
    srv = HttpServer(app, "127.0.0.1", free_port(), limits=limits or ServerLimits())
    task = asyncio.get_running_loop().create_task(srv.serve())
    while not srv.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield srv
    finally:
        srv.should_exit = True
        await task


async def _read_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One response off the wire: status line, headers, body (by content-length or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b": ")
            headers[name] = value
    if b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += data[:-2]
    else:
        body = b""
    return lines[0], headers, body


async def _connect(srv: HttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(srv.host, srv.port)


async def _answered_then_closed(reader: asyncio.StreamReader) -> bytes:
    """The status line of the answer read, which says ``connection: close`` and is the last
    thing on the connection before it closes."""
    status, headers, _ = await _read_response(reader)
    assert headers[b"connection"] == b"close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    return status


async def test_requests_on_one_kept_alive_connection_are_answered_in_turn() -> None:
    async with _serving(_App()) as srv:
        reader, writer = await _connect(srv)
        for i in range(3):
            writer.write(
                b"POST /echo?i=%d HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello" % i
            )
            status, headers, body = await _read_response(reader)
            assert status == b"HTTP/1.1 200 OK"
            assert body == b"POST /echo ?i=%d 5:hello" % i
            assert b"date" in headers
            assert b"connection" not in headers
        writer.close()


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with _serving(_App()) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"".join(b"GET /p%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(4)))
        bodies = [(await _read_response(reader))[2] for _ in range(4)]
        assert bodies == [b"GET /p%d ? 0:" % i for i in range(4)]
        writer.close()


async def test_a_chunked_request_body_and_a_chunked_response() -> None:
    async with _serving(_App()) as srv:
        reader, writer = await _connect(srv)
        writer.write(
            b"POST /chunked HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
        )
        _status, headers, body = await _read_response(reader)
        assert headers[b"transfer-encoding"] == b"chunked"
        assert body == b"POST /chunked ? 7:abcdefg"
        writer.close()


async def test_a_body_larger_than_the_read_pause_arrives_whole() -> None:
    payload = bytes(range(256)) * 1024  # 256 KiB: reading pauses and resumes several times
    async with _serving(_App()) as srv, httpx.AsyncClient() as client:
        r = await client.post(srv.url + "/echo", content=payload)
        assert r.text.startswith(f"POST /echo ? {len(payload)}:")


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    async with _serving(_App()) as srv:
        reader, writer = await _connect(srv)
        writer.write(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\nexpect: 100-continue\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"data")
        assert (await _read_response(reader))[2] == b"POST /echo ? 4:data"
        writer.close()


async def test_head_gets_headers_only_and_the_connection_stays_usable() -> None:
    async with _serving(_App()) as srv:
        reader, writer = await _connect(srv)
        writer.write(
            b"HEAD /chunked HTTP/1.1\r\nhost: x\r\n\r\nGET /after HTTP/1.1\r\nhost: x\r\n\r\n"
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert b"transfer-encoding" not in head
        assert (await _read_response(reader))[2] == b"GET /after ? 0:"
        writer.close()


@pytest.mark.parametrize(
    "request_line",
    [b"GET /close HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", b"GET /old HTTP/1.0\r\n\r\n"],
)
async def test_a_connection_the_client_will_not_keep_is_closed_after_its_answer(
    request_line: bytes,
) -> None:
    async with _serving(_App()) as srv:
        reader, writer = await _connect(srv)
        writer.write(request_line)
        await _answered_then_closed(reader)
        writer.close()


@pytest.mark.parametrize(
    ("path", "body"), [(b"/chunked", b"GET /chunked ? 0:"), (b"/raw", b"one,two")]
)
async def test_an_http_1_0_client_gets_a_body_that_ends_with_the_connection(
    path: bytes, body: bytes
) -> None:
    """HTTP/1.0 has no chunked framing: a body of unknown length is sent as it is, then closed.

    For a 1.1 client the same answers are chunked (the tests above); a 1.0 client would read
    the chunk sizes as part of the body.
    """
    async with _serving(_App()) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"GET %s HTTP/1.0\r\n\r\n" % path)
        answer = await asyncio.wait_for(reader.read(), 5)  # to the connection's end
        writer.close()
    head, _, got = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding" not in head
    assert b"content-length" not in head
    assert b"connection: close" in head
    assert got == body


async def test_a_malformed_request_gets_400_and_the_connection_closes() -> None:
    async with _serving(_App()) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"GET / HTTP/1.1\r\nbad header line\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert b"connection: close" in answer
        writer.close()


@pytest.mark.parametrize("path", ["/boom", "/silent", "/bad-header"])
async def test_an_app_that_fails_before_answering_gives_500(path: str) -> None:
    async with _serving(_App()) as srv, httpx.AsyncClient() as client:
        r = await client.get(srv.url + path)
        assert r.status_code == 500
        assert r.text == "Internal Server Error"
        assert "x-evil" not in r.headers
        assert "set-cookie" not in r.headers
        # The server still serves.
        assert (await client.get(srv.url + "/after")).status_code == 200


async def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_time() -> None:
    async with _serving(_App(), ServerLimits(keep_alive_seconds=1)) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"GET /once HTTP/1.1\r\nhost: x\r\n\r\n")
        await _read_response(reader)
        assert await asyncio.wait_for(reader.read(), 3) == b""
        writer.close()


async def test_stopping_lets_a_running_response_end_and_closes_idle_connections() -> None:
    app = _App()
    srv = HttpServer(app, "127.0.0.1", free_port())
    task = asyncio.get_running_loop().create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    idle_reader, idle_writer = await _connect(srv)
    reader, writer = await _connect(srv)
    writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 OK")
    srv.should_exit = True
    assert await asyncio.wait_for(idle_reader.read(), 5) == b"", "an idle connection is closed"
    app.release.set()
    rest = await asyncio.wait_for(reader.read(), 5)
    assert b"slow done" in rest
    assert rest.endswith(b"0\r\n\r\n")
    await task
    assert app.lifespan == ["startup", "shutdown"]
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(srv.host, srv.port)
    for w in (idle_writer, writer):
        w.close()


async def test_a_response_still_running_past_the_grace_is_cancelled() -> None:
    app = _App()
    srv = HttpServer(app, "127.0.0.1", free_port(), graceful_seconds=0.3)
    task = asyncio.get_running_loop().create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    reader, writer = await _connect(srv)
    writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    srv.should_exit = True
    await asyncio.wait_for(task, 5)
    assert not srv.tasks
    assert not srv.connections
    assert b"slow done" not in await asyncio.wait_for(reader.read(), 5)
    writer.close()


async def test_a_failed_start_up_exits_with_status_3_without_listening() -> None:
    app = _App()
    app.fail_startup = True
    srv = HttpServer(app, "127.0.0.1", free_port())
    with pytest.raises(SystemExit) as exited:
        await srv.serve()
    assert exited.value.code == STARTUP_FAILURE
    assert not srv.started
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(srv.host, srv.port)


async def test_a_port_in_use_exits_with_status_3_after_shutting_the_app_down() -> None:
    app = _App()
    async with _serving(_App()) as taken:
        srv = HttpServer(app, "127.0.0.1", taken.port)
        with pytest.raises(SystemExit) as exited:
            await srv.serve()
    assert exited.value.code == STARTUP_FAILURE
    assert app.lifespan == ["startup", "shutdown"]


async def test_the_scope_carries_what_the_apps_read() -> None:
    seen: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            seen.append(scope)
            await respond(send, 204, b"", [])

    srv: Any = HttpServer(app, "127.0.0.1", free_port(), lifespan=False)
    task = asyncio.get_running_loop().create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient() as client:
        r = await client.get(srv.url + "/v1/a%20b?x=1", headers={"X-Team": "search"})
    srv.should_exit = True
    await task
    assert r.status_code == 204
    assert "transfer-encoding" not in r.headers
    scope = seen[0]
    assert (scope["method"], scope["path"], scope["raw_path"], scope["query_string"]) == (
        "GET",
        "/v1/a b",
        b"/v1/a%20b",
        b"x=1",
    )
    assert (b"x-team", b"search") in scope["headers"]
    assert scope["client"][0] == "127.0.0.1"
    assert scope["server"] == ("127.0.0.1", srv.port)


async def test_a_request_refused_for_its_header_size_never_reaches_the_app() -> None:
    """Headers past the cap, sent whole in one write: 431, and the app is not run for them."""
    app = _App()
    async with _serving(app, ServerLimits(max_header_bytes=1024)) as srv:
        reader, writer = await _connect(srv)
        writer.write(
            b"POST /echo HTTP/1.1\r\nhost: x\r\nx-filler: " + b"f" * 2048 + b"\r\n"
            b"content-length: 2\r\n\r\nhi"
        )
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert app.paths == []


async def test_a_later_request_trickling_its_head_on_a_kept_alive_connection_gets_408() -> None:
    """The header deadline also holds for the second request of a connection, from its first byte."""
    async with _serving(
        _App(), ServerLimits(header_timeout_seconds=0.5, keep_alive_seconds=30)
    ) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"GET /first HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await _read_response(reader))[2] == b"GET /first ? 0:"
        writer.write(b"GET /second HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ")


async def test_stray_bytes_after_an_answer_do_not_keep_the_connection_open() -> None:
    """Only a request's first byte ends the keep-alive wait; a lone CRLF does not."""
    async with _serving(_App(), ServerLimits(keep_alive_seconds=1)) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"GET /once HTTP/1.1\r\nhost: x\r\n\r\n")
        await _read_response(reader)
        writer.write(b"\r\n")
        assert await asyncio.wait_for(reader.read(), 4) == b""
        writer.close()


async def test_an_answer_before_the_body_is_in_closes_the_connection() -> None:
    """The rest of that body would be read as the next request, or trickled to hold the
    connection open: the answer says ``connection: close`` and the connection closes."""
    app = _App()
    async with _serving(app) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\npartial")
        status, headers, _ = await _read_response(reader)
        assert status == b"HTTP/1.1 401 Unauthorized"
        assert headers[b"connection"] == b"close"
        writer.write(b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    assert app.paths == ["/early"]


async def test_an_upgrade_request_cannot_carry_a_second_request() -> None:
    """An ``Upgrade`` request is answered as plain HTTP/1.1; nothing after its head is read."""
    app = _App()
    async with _serving(app) as srv:
        reader, writer = await _connect(srv)
        smuggled = b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n"
        writer.write(
            b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: h2c\r\n"
            b"content-length: %d\r\n\r\n" % len(smuggled)
        )
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(smuggled)
        await _answered_then_closed(reader)
        writer.close()
    assert app.paths == ["/echo"]


async def test_a_flood_of_pipelined_requests_is_cut_at_a_bound() -> None:
    """One read of tiny requests does not queue without bound: the connection closes."""
    app = _App()
    async with _serving(app) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"GET /p HTTP/1.1\r\nhost: x\r\n\r\n" * 2000)
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert 1 <= len(app.paths) <= 17


async def test_a_bad_request_behind_one_being_answered_does_not_take_its_answer() -> None:
    """A malformed or oversized pipelined request: the one before it is answered whole (with
    ``connection: close``), and no 400 or 431 is written in its place or into it."""
    for bad in (b"GARBAGE\x01\r\n\r\n", b"GET / HTTP/1.1\r\nx: " + b"a" * 70_000 + b"\r\n\r\n"):
        app = _App()
        async with _serving(app) as srv:
            reader, writer = await _connect(srv)
            writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(bad)
            await asyncio.sleep(0.2)
            app.release.set()
            rest = await asyncio.wait_for(reader.read(), 5)
            writer.close()
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert rest.endswith(b"slow done\r\n0\r\n\r\n")
        assert b"HTTP/1.1 4" not in rest


async def test_a_pipelined_head_left_half_sent_does_not_cut_the_running_stream() -> None:
    """Its header deadline runs out mid-stream: the stream still ends whole, then the
    connection closes (nothing is written into the stream)."""
    app = _App()
    async with _serving(app, ServerLimits(header_timeout_seconds=0.3)) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(b"GET /next HTTP/1.1\r\nho")
        await asyncio.sleep(0.8)
        app.release.set()
        rest = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert rest.endswith(b"slow done\r\n0\r\n\r\n")
    assert app.paths == ["/slow"]


async def test_an_app_failing_after_its_answer_does_not_cut_the_next_request() -> None:
    app = _App()
    async with _serving(app) as srv:
        reader, writer = await _connect(srv)
        writer.write(
            b"GET /boom-after HTTP/1.1\r\nhost: x\r\n\r\nGET /after HTTP/1.1\r\nhost: x\r\n\r\n"
        )
        assert (await _read_response(reader))[2] == b"ok"
        assert (await _read_response(reader))[2] == b"GET /after ? 0:"
        writer.close()


def _request_parsers() -> int:
    return sum(isinstance(o, httptools.HttpRequestParser) for o in gc.get_objects())


async def test_a_connection_holds_no_request_parser_while_its_request_is_answered() -> None:
    """A stream can run for minutes: its connection keeps no parser (memory per open stream),
    and the next request on it is parsed as the first was."""
    app = _App()
    async with _serving(app) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        gc.collect()
        assert _request_parsers() == 0
        app.release.set()
        assert (await _read_response_body_after_head(reader)).endswith(b"slow done")
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhel")
        await asyncio.sleep(0.05)
        writer.write(b"lo")
        status, _, body = await _read_response(reader)
        assert (status, body) == (b"HTTP/1.1 200 OK", b"POST /echo ? 5:hello")
        writer.close()


async def _read_response_body_after_head(reader: asyncio.StreamReader) -> bytes:
    """The chunked body of a response whose head was read already."""
    body = b""
    while True:
        size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return body
        body += data[:-2]


async def test_requests_share_their_common_header_names_and_server_address() -> None:
    """What every open stream would otherwise hold a copy of: the names of the headers clients
    send most, in any usual spelling, and the address they came to; other names are still
    lower-cased."""
    seen: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            seen.append(scope)
            await respond(send, 204, b"", [])

    srv = HttpServer(app, "127.0.0.1", free_port(), lifespan=False)
    task = asyncio.get_running_loop().create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    for spelling in (b"Content-Type", b"content-type"):
        reader, writer = await _connect(srv)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n%s: a\r\nX-Team: b\r\n\r\n" % spelling)
        assert (await _read_response(reader))[0] == b"HTTP/1.1 204 No Content"
        writer.close()
    srv.should_exit = True
    await task
    first, second = (dict(scope["headers"]) for scope in seen)
    assert first == second == {b"host": b"x", b"content-type": b"a", b"x-team": b"b"}
    names = [{name: name for name in scope_headers} for scope_headers in (first, second)]
    assert names[0][b"content-type"] is names[1][b"content-type"]
    assert names[0][b"host"] is names[1][b"host"]
    assert seen[0]["server"] == ("127.0.0.1", srv.port)
    assert seen[0]["server"] is seen[1]["server"]


@contextlib.contextmanager
def _no_cyclic_collector() -> Iterator[None]:
    """Only counts of references free objects inside: what a cycle holds stays."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


async def test_a_connection_lost_mid_response_is_freed_without_the_cyclic_collector() -> None:
    """A client that hangs up mid-stream leaves nothing for the cyclic collector: its connection
    and exchange go when the response's task ends, not at the next full collection (after a
    burst of streams, a thousand such connections were 4 MB more at the next burst's peak)."""
    app = _App()
    async with _serving(app) as srv:
        with _no_cyclic_collector():
            reader, writer = await _connect(srv)
            writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert _alive("_Connection", "_Exchange") == {"_Connection": 1, "_Exchange": 1}
            writer.close()
            while srv.connections:
                await asyncio.sleep(0.01)
            app.release.set()  # the response's task sees the loss and ends
            while srv.tasks:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.01)
            # (Objects in a cycle stay tracked, and listed, until the collector frees them.)
            assert _alive("_Connection", "_Exchange") == {}


def _alive(*names: str) -> dict[str, int]:
    """How many objects of the server's classes called ``names`` exist."""
    found: dict[str, int] = {}
    for o in gc.get_objects():
        name = type(o).__name__
        if name in names and type(o).__module__ == "sidecar.http_server":
            found[name] = found.get(name, 0) + 1
    return found
