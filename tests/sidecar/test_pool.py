"""The protocol pool to vLLM: keep-alive reuse, timeouts and a connection left paused."""

from __future__ import annotations

import asyncio

import pytest

from infermeter.serving import free_port, host_port
from sidecar.direct import WholeSink
from sidecar.pool import Pool, ReadTimeout, UpstreamClosed, request_head
from tests.servers import serving

# The relay runs on uvloop in the sidecar process and on either loop in tests (conftest).
pytestmark = pytest.mark.both_loops


async def _ok(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(5)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _get(pool: Pool, path: bytes = b"/") -> WholeSink:
    sink = WholeSink(asyncio.get_running_loop(), None)
    conn = await pool.connection()
    conn.send(request_head(b"POST", path, b"h", {}, 0), sink, pool.read_timeout_seconds)
    await asyncio.wait_for(asyncio.shield(sink.finished), 5)
    return sink


async def test_a_connection_is_reused_even_when_left_paused():
    """The next exchange on a pooled connection reads its response, though the last left it paused."""
    async with serving(_ok, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 2.0)
        first = await _get(pool)
        assert (first.status, first.finished.result(), b"".join(first.parts)) == (200, None, b"ok")
        conn = await pool.connection()
        conn.pause_reading()
        pool.release(conn)
        second = await _get(pool)
        assert (second.finished.result(), b"".join(second.parts)) == (None, b"ok")
        assert await pool.connection() is conn
        await pool.close()


async def test_a_silent_replica_times_out():
    """No response within the read timeout ends the exchange with ReadTimeout."""
    async with serving(_ok, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 0.2)
        sink = await _get(pool, b"/slow")
        assert isinstance(sink.finished.result(), ReadTimeout)
        await pool.close()


async def test_nothing_listening_is_unreachable():
    """A refused connection is UpstreamClosed, named after the socket error."""
    pool = Pool("127.0.0.1", free_port(), 1.0, 1.0)
    with pytest.raises(UpstreamClosed, match="ConnectionRefusedError"):
        await pool.connection()
