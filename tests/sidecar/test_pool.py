"""The protocol pool to vLLM: keep-alive reuse, timeouts and a connection left paused."""

from __future__ import annotations

import asyncio
import fcntl
import gc
import struct
import termios
import time

import pytest

from infermeter.serving import free_port, host_port
from sidecar.direct import WholeSink
from sidecar.pool import Connection, Pool, ReadTimeout, UpstreamClosed, request_head
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


async def test_the_idle_set_reuses_the_newest_and_drops_the_stale_and_the_lost():
    """The newest idle connection is reused first; a stale one is closed, never handed out; one
    the replica closed while idle leaves the pool; a connection released twice is pooled once."""
    async with serving(_ok, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 2.0)
        a, b, c, d = [await pool.connection(new=True) for _ in range(4)]
        for conn in (a, b, c, c, d):
            pool.release(conn)
        a.idle_since -= 60.0  # stale: older than the replica's keep-alive
        assert d.transport is not None
        d.transport.close()  # the replica (here: the transport) closes d while it is idle
        while not d.closed:
            await asyncio.sleep(0.01)
        assert await pool.connection() is c
        assert await pool.connection() is b
        fresh = await pool.connection()
        assert fresh not in (a, b, c, d)
        assert a.closed
        assert (await _get(pool)).finished.result() is None
        await pool.close()


async def test_an_interim_response_is_not_taken_for_the_answer():
    """A ``100 Continue`` (or any 1xx) before the answer is skipped: the sink gets the final
    response, and the connection goes back to the pool only once that has ended, in step."""
    answers = iter([b"first", b"second"])

    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readuntil(b"\r\n\r\n"):
            body = next(answers)
            writer.write(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\n"
            )
            await writer.drain()
            await asyncio.sleep(0.05)  # the answer comes later than its interim heads
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    server = await asyncio.start_server(replica, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool("127.0.0.1", port, 1.0, 2.0)
    first = await _get(pool)
    second = await _get(pool)
    assert (first.status, first.finished.result(), b"".join(first.parts)) == (200, None, b"first")
    assert (second.status, second.finished.result(), b"".join(second.parts)) == (
        200,
        None,
        b"second",
    )
    await pool.close()
    server.close()


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


async def _trickle(scope, receive, send):
    """A response that sends a piece every 0.1 s for 1 s: slow, but never silent for long."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(10):
        await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
    await send({"type": "http.response.body", "body": b"end"})


async def test_the_read_timeout_counts_from_the_last_read_not_the_request():
    """A response longer than the read timeout, with no gap as long, is read to its end."""
    async with serving(_trickle, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 0.4)
        sink = await _get(pool)
        assert (sink.finished.result(), b"".join(sink.parts)) == (None, b"x" * 10 + b"end")
        await pool.close()


async def test_a_timeout_never_fires_early_and_a_short_one_is_not_held_by_a_long_one():
    """Exchanges of different timeouts share the pool's sweeps: each fails at its own time."""
    async with serving(_ok, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 30.0)
        loop = asyncio.get_running_loop()
        long_sink = WholeSink(loop, None)
        (await pool.connection()).send(
            request_head(b"POST", b"/slow", b"h", {}, 0), long_sink, 30.0
        )
        short_sink = WholeSink(loop, None)
        started = time.monotonic()
        (await pool.connection()).send(
            request_head(b"POST", b"/slow", b"h", {}, 0), short_sink, 0.4
        )
        exc = await asyncio.wait_for(asyncio.shield(short_sink.finished), 5)
        elapsed = time.monotonic() - started
        assert isinstance(exc, ReadTimeout)
        assert 0.4 <= elapsed < 3.0, elapsed
        assert not long_sink.finished.done()
        await pool.close()


async def test_a_quiet_pool_keeps_no_sweep_timer():
    """Once no exchange waits, the sweeps stop (an idle sidecar wakes for nothing)."""
    async with serving(_ok, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 0.4)
        await _get(pool)
        assert pool._sweeper is not None  # armed by the exchange
        await asyncio.sleep(0.3)  # a sweep (every 0.1 s here) finds nothing waiting
        assert pool._sweeper is None
        await pool.close()


async def _pieces(scope, receive, send):
    """A response whose head comes at once, five pieces 0.2 s later, then nothing for 1 s."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await asyncio.sleep(0.2)
    for i in range(5):
        await send({"type": "http.response.body", "body": b"piece%d;" % i, "more_body": True})
    await asyncio.sleep(1)
    await send({"type": "http.response.body", "body": b"end"})


async def test_read_received_takes_what_the_kernel_holds_before_a_close():
    """Bytes the replica sent but the loop has not read (reading paused here) are parsed at once.

    A request whose client left is closed at once; what the replica had sent by then was spent
    on it and is billed, so it must reach the sink, not be dropped with the socket.
    """
    async with serving(_pieces, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 10.0)
        sink = WholeSink(asyncio.get_running_loop(), None)
        conn = await pool.connection()
        conn.send(request_head(b"POST", b"/", b"h", {}, 0), sink, pool.read_timeout_seconds)
        while sink.status == 0:
            await asyncio.sleep(0.01)
        conn.pause_reading()
        await asyncio.sleep(0.5)  # the pieces arrive in the socket's buffer, unread
        before = b"".join(sink.parts)
        conn.read_received()
        after = b"".join(sink.parts)
        conn.close()
        await pool.close()
    assert before == b""
    assert after == b"piece0;piece1;piece2;piece3;piece4;"


class _Counting(WholeSink):
    """A sink that tells the socket's reads apart: the pieces of one read share its time."""

    __slots__ = ("times",)

    def __init__(self) -> None:
        super().__init__(asyncio.get_running_loop(), None)
        self.times: set[float] = set()

    @property
    def reads(self) -> int:
        return len(self.times)

    def body(self, data: bytes, now: float) -> None:
        self.times.add(now)
        super().body(data, now)


async def _tokens(scope, receive, send):
    """40 pieces 10 ms apart, as a stream's chunks come, the connection closed after (uvicorn
    closes it when the request asked ``connection: close``)."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i in range(40):
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"t%02d;" % i, "more_body": True})
    await send({"type": "http.response.body", "body": b"end"})


async def _batched(pool: Pool, sink: WholeSink) -> None:
    conn = await pool.connection(new=True)
    head = request_head(b"POST", b"/", b"h", {"connection": "close"}, 0)
    conn.send(head, sink, pool.read_timeout_seconds)
    conn.batch()


async def test_a_batched_answer_is_read_at_its_end_in_one_piece():
    """A batched connection leaves the pieces to the kernel and reads them when the replica
    closes: the whole answer, in a read or two instead of one per piece."""
    expected = b"".join(b"t%02d;" % i for i in range(40)) + b"end"
    async with serving(_tokens, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 10.0)
        plain = _Counting()
        conn = await pool.connection(new=True)
        conn.send(request_head(b"POST", b"/", b"h", {}, 0), plain, 10.0)
        batched = _Counting()
        await _batched(pool, batched)
        for sink in (plain, batched):
            assert await asyncio.wait_for(asyncio.shield(sink.finished), 5) is None
        await pool.close()
    assert b"".join(plain.parts) == b"".join(batched.parts) == expected
    assert plain.reads >= 20
    assert batched.reads <= 2


async def _until_queued(conn: Connection, nbytes: int, seconds: float = 10.0) -> None:
    """Wait until the kernel holds ``nbytes`` the loop has not read on ``conn`` (FIONREAD)."""
    assert conn.transport is not None
    fd = conn.transport.get_extra_info("socket").fileno()
    deadline = time.monotonic() + seconds
    while True:
        queued = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        if queued >= nbytes:
            return
        assert time.monotonic() < deadline, f"{queued} bytes queued after {seconds} s"
        await asyncio.sleep(0.01)


async def test_pull_reads_what_a_batched_connection_holds():
    """``pull`` parses the pieces waiting below the mark (the tokens so far, for a tick)."""
    async with serving(_tokens, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 10.0)
        sink = _Counting()
        await _batched(pool, sink)
        (conn,) = pool._all
        # The head and a dozen pieces or more waiting in the kernel (a fixed sleep of 0.2 s
        # was not enough on a busy machine).
        await _until_queued(conn, 300)
        before = b"".join(sink.parts)
        sink.upstream = None  # (not a sink's pull: the connection's own)
        conn.pull()
        after = b"".join(sink.parts)
        await asyncio.wait_for(asyncio.shield(sink.finished), 5)
        await pool.close()
    assert before == b""
    assert after.startswith(b"t00;t01;t02;")
    assert len(after) >= 10 * 4


async def test_a_batched_exchange_is_not_silent_while_bytes_wait_below_the_mark():
    """Pieces that wait in the kernel count as arrivals: a slow answer with no gap as long as
    the read timeout is read to its end, though nothing is read until the close."""
    async with serving(_trickle, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 0.4)
        sink = WholeSink(asyncio.get_running_loop(), None)
        await _batched(pool, sink)
        assert await asyncio.wait_for(asyncio.shield(sink.finished), 5) is None
        assert b"".join(sink.parts) == b"x" * 10 + b"end"
        await pool.close()


async def test_a_silent_batched_replica_still_times_out():
    """Batching does not hide a replica that sends nothing: ReadTimeout as before."""
    async with serving(_ok, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 0.2)
        sink = WholeSink(asyncio.get_running_loop(), None)
        conn = await pool.connection(new=True)
        head = request_head(b"POST", b"/slow", b"h", {"connection": "close"}, 0)
        conn.send(head, sink, pool.read_timeout_seconds)
        conn.batch()
        assert isinstance(await asyncio.wait_for(asyncio.shield(sink.finished), 5), ReadTimeout)
        await pool.close()


async def test_a_batched_connection_never_goes_back_to_the_pool():
    """Its low-water mark would batch the next stream: it is closed after its answer."""
    async with serving(_ok, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 2.0)
        sink = WholeSink(asyncio.get_running_loop(), None)
        conn = await pool.connection(new=True)
        conn.send(request_head(b"POST", b"/", b"h", {}, 0), sink, 2.0)  # (keep-alive asked)
        conn.batch()
        assert await asyncio.wait_for(asyncio.shield(sink.finished), 5) is None
        assert conn.closed
        assert await pool.connection() is not conn
        await pool.close()


async def test_a_closed_connection_is_freed_without_the_cyclic_collector():
    """Its parser holds its callbacks: dropped at the loss, so the connection goes by its count
    of references, not at the next full collection (a batched answer's connection is closed
    after every non-streamed request)."""
    async with serving(_ok, lifespan="off") as url:
        pool = Pool(*host_port(url), 1.0, 2.0)
        gc.collect()
        gc.disable()
        try:
            sink = WholeSink(asyncio.get_running_loop(), None)
            conn = await pool.connection(new=True)
            conn.send(request_head(b"POST", b"/", b"h", {}, 0), sink, 2.0)
            conn.batch()
            assert await asyncio.wait_for(asyncio.shield(sink.finished), 5) is None
            del conn
            for _ in range(100):
                if not _connections():
                    break
                await asyncio.sleep(0.01)
            # (Objects in a cycle stay tracked, and listed, until the collector frees them.)
            assert _connections() == 0
        finally:
            gc.enable()
        await pool.close()


def _connections() -> int:
    return sum(isinstance(o, Connection) for o in gc.get_objects())
