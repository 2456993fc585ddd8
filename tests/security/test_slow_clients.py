"""Slow and idle clients cannot hold the sidecar's connections or its fair-share queue forever."""

from __future__ import annotations

import asyncio
import socket
import time
from urllib.parse import urlsplit

import orjson
import pytest

from infermeter.asgi import read_body
from tests.sidecar import conftest as sidecar_fixtures

# The replica-and-sidecar fixture of the sidecar's own tests.
stack_factory = sidecar_fixtures.stack_factory

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DEADLINES = {
    "sidecar.header_timeout_seconds": 1.0,
    "sidecar.body_timeout_seconds": 1.0,
    "sidecar.max_connections": 8,
}


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    return sock


async def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``sock`` (reading whatever it answers), trickling bytes."""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if trickle:
            try:
                sock.send(trickle)
            except OSError:
                return time.monotonic() - start
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 0.5)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
        if not data:
            return time.monotonic() - start
    raise AssertionError(f"the connection was still open after {seconds} s")


async def test_slowloris_headers_are_cut_off(stack_factory):
    """A client trickling its request headers is disconnected at the header deadline."""
    stack = await stack_factory(**DEADLINES)
    with _connect(stack.url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        took = await _closed_within(sock, 6.0, trickle=b"x")
    assert took < 4.0


async def test_an_idle_connection_is_closed(stack_factory):
    """A connection that never sends a byte is closed at the header deadline."""
    stack = await stack_factory(**DEADLINES)
    with _connect(stack.url) as sock:
        took = await _closed_within(sock, 6.0)
    assert took < 4.0


async def test_a_stalled_body_is_refused(stack_factory):
    """A body that stops arriving is answered 408 at the body deadline."""
    stack = await stack_factory(**DEADLINES)
    with _connect(stack.url) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"authorization: Bearer im-demo-search\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"model"'
        )
        sock.settimeout(6.0)
        start = time.monotonic()
        answer = await asyncio.get_running_loop().run_in_executor(None, sock.recv, 65536)
    assert answer.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - start < 4.0


async def test_oversized_headers_are_refused(stack_factory):
    """Request headers past 64 KiB are answered 431 and the connection is closed."""
    stack = await stack_factory(**DEADLINES)
    with _connect(stack.url) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        for _ in range(20):
            sock.sendall(b"x-filler: " + b"f" * 4096 + b"\r\n")
        sock.settimeout(6.0)
        answer = await asyncio.get_running_loop().run_in_executor(None, sock.recv, 65536)
    assert answer.startswith(b"HTTP/1.1 431")


async def test_connections_beyond_the_cap_are_closed(stack_factory):
    """Connections past sidecar.max_connections are closed at once; those within are kept."""
    stack = await stack_factory(**{**DEADLINES, "sidecar.header_timeout_seconds": 30.0})
    socks = [_connect(stack.url) for _ in range(12)]
    try:
        await asyncio.sleep(0.3)
        closed = 0
        for sock in socks:
            sock.setblocking(False)
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        assert closed == 4
    finally:
        for sock in socks:
            sock.close()


async def test_body_reads_have_a_deadline():
    """read_body gives up on a body that stops arriving after ``timeout`` seconds."""

    async def trickle():
        await asyncio.sleep(5)
        return {"type": "http.request", "body": b"", "more_body": False}

    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await read_body(trickle, 1000, timeout_seconds=0.2)
    assert time.monotonic() - start < 1.0


async def _slow_upstream(scope, receive, send):
    """A replica that takes two seconds to answer any completion."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(2.0)
    body = orjson.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def test_the_fair_queue_is_bounded_and_waits_time_out(stack_factory):
    """Past the queue bound a request is 429 at once; a queued one is 503 after the wait timeout; both carry Retry-After."""
    stack = await stack_factory(
        _slow_upstream,
        **{
            "replicas.1.max_num_seqs": 1,
            "sidecar.fair_queue_max_per_team": 1,
            "sidecar.fair_wait_timeout_seconds": 0.5,
        },
    )
    async with stack.client() as c:
        holding = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.3)
        queued = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.1)
        start = time.monotonic()
        over = await c.post("/v1/chat/completions", json=CHAT)
        assert time.monotonic() - start < 0.4
        timed_out = await queued
        held = await holding
    assert held.status_code == 200
    assert over.status_code == 429
    assert timed_out.status_code == 503
    assert over.headers["retry-after"]
    assert timed_out.headers["retry-after"]
