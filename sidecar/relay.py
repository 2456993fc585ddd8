"""The relay: forward an admitted request to vLLM and give the client its answer.

Three shapes: a stream (every block metered and rewritten on its way, ``sidecar.stream``), a
whole answer relayed as vLLM gives it, and a whole answer assembled from vLLM's stream
(``sidecar.assemble``). Each ends with the request's ending kept (``Accounting.record``) before
the client sees the end of its response, and returns what the request's accounting needs.

One upstream transport serves all three: the pool on asyncio protocols (``sidecar.pool``,
``sidecar.direct``), over plain HTTP or TLS. The client side comes in two kinds: the sidecar's
own server gives the client connection's raw writer, which a stream's blocks are written to and
whose closing says the client left; any other ASGI server gives only ``send`` and ``receive``,
which ``sidecar.send_writer`` turns into the same for a stream, and a whole answer is raced
against ASGI's disconnect message (``_race``). (An aiohttp relay served the second kind, and
every request when ``sidecar.protocol_relay`` was false, until measured to earn nothing:
``docs/benchmarks.md``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, Literal, TypeVar

import orjson

from infermeter.asgi import Receive, Send, respond
from infermeter.errors import error_body, sse_error_event
from infermeter.http_guard import RawWriter
from infermeter.records import RequestStatus
from infermeter.spool import SpoolError
from sidecar.accounting import Accounting, Call
from sidecar.admission import Refusal
from sidecar.assemble import Assembler, answer, assemblable, streamed_body
from sidecar.direct import LEFT, Pools, StreamSink, WholeSink
from sidecar.drain import CUT, Drain
from sidecar.journal import AdmissionJournal
from sidecar.pool import Connection
from sidecar.progress import Slot
from sidecar.rates import COST_HEADER, Rate, RatePoller, with_cost
from sidecar.request_ids import response_id
from sidecar.send_writer import SendWriter
from sidecar.stream import StreamMeter, UsageCounts, parse_usage
from sidecar.upstream import UPSTREAM_ERRORS, upstream_failure

__all__ = ["JSON", "DirectStream", "Relay", "Whole"]

log = logging.getLogger("infermeter.sidecar")

_T = TypeVar("_T")
# How a non-streamed wait ended (``Relay._race``, ``Relay._whole_raw``): the answer, the client
# leaving (aborted), the drain's cut, or the answer read to its end after the client left
# (``sidecar.whole_hang_up: finish``, or the client leaving as the answer ended).
_Ended = Literal["done", "left", "cut", "finished"]
# A non-streamed exchange's outcome: the response and its body (None: read into an assembler).
_Exchanged = tuple[WholeSink, bytes | None]

JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream; charset=utf-8")
_DROP_DOWN = frozenset(
    {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"date", b"server"}
)
_WITHHELD = (
    "Usage metering is unavailable; the response was withheld.",
    "server_error",
    "metering_unavailable",
    RequestStatus.REJECTED,
)

# How a whole (non-streamed) request ended: usage, status, HTTP status, finish reason.
Whole = tuple[UsageCounts | None, RequestStatus, int, str | None]
# A streamed request sent on a pooled connection, its response to be read into the sink.
DirectStream = tuple[Connection, StreamSink]


class Relay:
    """Forwarding for one replica: its upstream pool, the drain, the journal and accounting."""

    def __init__(
        self,
        upstream: str,
        pools: Pools,
        accounting: Accounting,
        journal: AdmissionJournal,
        drain: Drain,
        assemble: bool,
        finish_whole: bool = True,
    ) -> None:
        self.upstream = upstream
        self.accounting = accounting
        self.journal = journal
        self.drain = drain
        # ``sidecar.non_streamed_via_stream``: read whole answers as streams when possible.
        self.assemble = assemble
        # ``sidecar.whole_hang_up``: finish (True) a request relayed whole whose client left, to
        # bill vLLM's usage, or abort it (False), billed nothing.
        self.finish_whole = finish_whole
        self.pools = pools
        # Billing's cost rates (``sidecar.rates``), for the estimate on each answer; None: none.
        self.rates: RatePoller | None = None
        # The replica's system_fingerprint member, from the last stream's final usage chunk
        # (``StreamMeter.fingerprint``): a stream of several choices needs it before its end.
        self.fingerprint: bytes | None = None

    def _rate(self, call: Call) -> Rate | None:
        """The cost rate of ``call``'s model, when an estimate can go on its answer."""
        return None if self.rates is None else self.rates.rate(call.model)

    def _costed(
        self, call: Call, status: int, usage: UsageCounts | None, body: bytes
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """A whole answer's body and extra headers with its cost estimate, when there is one."""
        rate = self._rate(call) if status == 200 else None
        text = None if rate is None else rate.text(usage)
        if text is None:
            return body, []
        return with_cost(body, text), [(COST_HEADER, text)]

    async def close(self) -> None:
        """Close every upstream connection."""
        await self.pools.close()

    # -- streamed --------------------------------------------------------------------------------

    async def _send(
        self,
        call: Call,
        body: dict[str, Any],
        headers: dict[str, str],
        sink: StreamSink | WholeSink,
        batched: bool = False,
    ) -> Connection:
        """Send the request on a pooled connection.

        ``batched``: on a new connection the replica closes after its answer, which is how the
        end of an answer read in batches is seen (``Connection.batch``).
        """
        target = self.pools.get(self.upstream)
        pool = target.pool
        try:
            conn = await pool.connection(new=batched)
        except UPSTREAM_ERRORS as exc:
            raise _refusal(exc) from None
        if batched:
            headers = {**headers, "connection": "close"}
        payload = orjson.dumps(body)
        head = target.head(b"POST", call.endpoint.encode(), headers, len(payload))
        conn.send(head + payload, sink, pool.read_timeout_seconds)
        return conn

    async def open_stream(
        self, call: Call, body: dict[str, Any], headers: dict[str, str]
    ) -> DirectStream:
        """Send a streamed request (``sidecar.direct``). Once this returns, the caller may drop
        ``body`` and ``headers``: a stream holds neither while it runs (``relay_stream``)."""
        meter = StreamMeter(
            call.client_usage,
            call.client_continuous,
            call.started,
            choices=call.choices,
            slot=self.journal.slot(call.request_id),
            rate=self._rate(call) if call.client_usage else None,
            fingerprint=self.fingerprint,
        )
        sink = StreamSink(meter, asyncio.get_running_loop())
        conn = await self._send(call, body, headers, sink)
        return conn, sink

    async def relay_stream(
        self,
        call: Call,
        receive: Receive,
        send: Send,
        opened: DirectStream,
        raw: RawWriter | None = None,
    ) -> tuple[StreamMeter, RequestStatus, int]:
        """Relay a stream ``open_stream`` sent; the meter, the record's status and the HTTP status.

        One coroutine waits on one future for the whole stream (``StreamSink.finished``, which
        the end, the client leaving and the drain's cut all resolve): what an open stream holds.
        ``raw``: the client's writer, when the server gives one; else blocks go out as ASGI
        messages (``SendWriter``, whose tasks cost an open stream about 2 KB more).
        """
        conn, sink = opened
        meter = sink.meter
        finished = sink.finished
        try:
            got = await sink.headed
            if isinstance(got, BaseException):
                raise _refusal(got)
            if got != 200:
                return await self._refused_stream(call, conn, sink, send)
            if meter.slot is not None:
                meter.slot.began()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        _SSE,
                        (b"x-infermeter-request-id", call.request_id.encode()),
                        *call.echo_headers(),
                        *call.ratelimit_headers(),
                    ],
                }
            )
            writer = raw if raw is not None else SendWriter(send, receive)
            sink.go_direct(writer)
            sink.upstream = conn
            # The client's connection closing (or ASGI's disconnect) tells the sink: no wait of
            # its own.
            writer.listener = sink
            if writer.lost.done():
                sink.writer_lost()
            if writer.paused:
                conn.pause_reading()
            # (The wait is written out here, not in a coroutine of its own: a frame less per
            # open stream.)
            try:
                if self.drain.watch(finished):
                    await finished
            finally:
                self.drain.unwatch(finished)
                writer.listener = sink.writer = sink.upstream = None
                if isinstance(writer, SendWriter):
                    if finished.done() and not finished.cancelled():
                        # What it keeps goes out before the last event.
                        try:
                            await writer.close()
                        except BaseException:
                            writer.abort()
                            raise
                    else:
                        writer.abort()
        finally:
            if not finished.done() or finished.cancelled():
                # Cancelled: closing the connection makes vLLM abort the request.
                conn.close()
        ended = finished.result() if finished.done() else CUT
        status = RequestStatus.OK
        if ended is LEFT or ended is CUT:
            if writer.lost.done():
                # What vLLM sent until the client left was spent on it: metered, then dropped.
                # (A drain's cut bills only what the client was given.)
                conn.read_received()
            # Closing the connection is what makes vLLM abort the request.
            conn.close()
            status = (
                RequestStatus.CLIENT_ABORTED if writer.lost.done() else RequestStatus.INTERRUPTED
            )
        elif ended is not None and not meter.done:
            # (A failure after [DONE], while reading the terminator, loses nothing.)
            status = RequestStatus.UPSTREAM_ERROR
            log.warning("upstream failed mid-stream on %s: %s", self.accounting.replica, ended)
        return await self._end_stream(call, meter, status, send)

    async def _refused_stream(
        self, call: Call, conn: Connection, sink: StreamSink, send: Send
    ) -> tuple[StreamMeter, RequestStatus, int]:
        # vLLM refuses bad streamed requests with a JSON error before any SSE: pass it on.
        if await sink.finished is not None:
            conn.close()
        content = b"".join(sink.error or ())
        status = RequestStatus.BAD_REQUEST if sink.status < 500 else RequestStatus.UPSTREAM_ERROR
        meter = StreamMeter(False, False, call.started)
        at = content.find(b'"usage":{')
        meter.usage = parse_usage(content[at:]) if at >= 0 else None
        self.accounting.record(call, status, sink.status, meter.usage, None, None)
        await respond(
            send, sink.status, content, [JSON, *call.echo_headers(), *call.ratelimit_headers()]
        )
        return meter, status, sink.status

    async def _end_stream(
        self, call: Call, meter: StreamMeter, status: RequestStatus, send: Send
    ) -> tuple[StreamMeter, RequestStatus, int]:
        """Record the stream, then give the client its last event (its ending is kept first)."""
        tail = meter.close()
        call.response_id = meter.response_id
        if meter.fingerprint is not None:
            self.fingerprint = meter.fingerprint
        ending = stream_end(status)
        if status is RequestStatus.OK and not meter.done:
            status, ending = RequestStatus.UPSTREAM_ERROR, stream_end(RequestStatus.UPSTREAM_ERROR)
        elif status is RequestStatus.OK and meter.failed:
            # vLLM's own error event, then its [DONE]: the client gets both as vLLM sent them,
            # and the record says the request failed, as it does for the same request unstreamed.
            status = RequestStatus.UPSTREAM_ERROR
        try:
            self.accounting.record(call, status, 200, meter.usage, meter, meter.finish_reason)
        except SpoolError:
            # The client must not see a complete response whose usage is not durable.
            await send(
                {"type": "http.response.body", "body": tail + _UNMETERED, "more_body": False}
            )
            return meter, RequestStatus.UPSTREAM_ERROR, 200
        if status is not RequestStatus.CLIENT_ABORTED:
            await send(
                {
                    "type": "http.response.body",
                    "body": tail + ending,
                    "more_body": False,
                }
            )
        return meter, status, 200

    # -- whole -----------------------------------------------------------------------------------

    async def whole(
        self,
        call: Call,
        receive: Receive,
        send: Send,
        body: dict[str, Any],
        headers: dict[str, str],
        raw: RawWriter | None = None,
    ) -> Whole:
        """Relay a non-streamed request.

        ``raw``: the client's writer, whose connection closing tells that the client left;
        without it, ASGI's disconnect message is awaited instead, in a task of its own.
        """
        if self.assemble and assemblable(call.endpoint, body):
            return await self._assembled(call, receive, send, body, headers, raw)

        async def exchange() -> _Exchanged:
            sink = await self._exchange(call, body, headers, None)
            return sink, b"".join(sink.parts)

        finish = self.finish_whole
        if raw is not None:
            work, ended = await self._whole_raw(call, body, headers, None, raw, finish=finish)
        else:
            work, ended = await self._race(exchange(), receive, finish=finish)
        if ended == "cut":
            return await self._cut(call, work, send)
        if ended == "left":
            with contextlib.suppress(SpoolError):
                self.accounting.record(call, RequestStatus.CLIENT_ABORTED, 499, None, None, None)
            return None, RequestStatus.CLIENT_ABORTED, 499, None
        try:
            response, content = work.result()
            assert content is not None  # (read whole: there is no assembler)
        except UPSTREAM_ERRORS as exc:
            code, message = upstream_failure(exc)
            raise Refusal(
                code,
                orjson.loads(message)["error"]["message"],
                "upstream_error",
                "upstream_error",
                RequestStatus.UPSTREAM_ERROR,
            ) from None
        usage, status, reason = whole_outcome(response.status, content)
        call.response_id = response_id(content)
        if ended == "finished":
            # The client left while vLLM generated; the answer was read to its end for its usage.
            with contextlib.suppress(SpoolError):
                self.accounting.record(call, RequestStatus.CLIENT_ABORTED, 499, usage, None, reason)
            return usage, RequestStatus.CLIENT_ABORTED, 499, reason
        try:
            self.accounting.record(call, status, response.status, usage, None, reason)
        except SpoolError:
            raise Refusal(503, *_WITHHELD) from None
        content, cost = self._costed(call, response.status, usage, content)
        await respond(
            send, response.status, content, [*whole_headers(call, response.raw_headers), *cost]
        )
        return usage, status, response.status, reason

    async def _race(
        self, exchange: Coroutine[Any, Any, _T], receive: Receive, finish: bool = False
    ) -> tuple[asyncio.Task[_T], _Ended]:
        """Run a non-streamed ``exchange`` against ASGI's disconnect and the drain's cut (for a
        server that gives no raw writer; ``_whole_raw`` otherwise).

        vLLM sends nothing, not even headers, until a non-streamed completion is done, so the
        whole exchange is raced. ``left``: the client hung up, and the exchange was cancelled,
        which closes the upstream connection and makes vLLM abort the request. ``cut``: the
        drain ran out with the exchange still running (the caller ends it, ``_cut``). With
        ``finish``, a client leaving does not end the exchange: it runs to its end (``finished``)
        or to the drain's cut.
        """
        loop = asyncio.get_running_loop()
        work = loop.create_task(exchange)
        watcher = loop.create_task(wait_disconnect(receive))
        await self.drain.until_first(work, watcher)
        left = watcher.done()
        if left and finish and not work.done():
            await self.drain.until_first(work)
        watcher.cancel()
        if work.done():
            return work, "finished" if left else "done"
        if not left or finish:
            return work, "cut"
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, *UPSTREAM_ERRORS, Refusal):
            await work
        return work, "left"

    async def _cut(
        self, call: Call, work: asyncio.Future[Any], send: Send, assembler: Assembler | None = None
    ) -> Whole:
        """End a non-streamed request still running past the drain: 503 and its record.

        With ``assembler`` (the request was read as a stream), the record has the tokens vLLM
        had spent when it was cut.
        """
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, *UPSTREAM_ERRORS, Refusal):
            await work
        usage = None
        if assembler is not None:
            call.response_id = assembler.response_id
            usage = assembler.usage_so_far()
        with contextlib.suppress(SpoolError):
            self.accounting.record(call, RequestStatus.INTERRUPTED, 503, usage, None, None)
        await respond(
            send,
            503,
            error_body(
                503,
                "The sidecar shut down before the response was complete.",
                "server_error",
                "server_shutting_down",
            ),
            [JSON, (b"retry-after", b"1"), (b"x-infermeter-request-id", call.request_id.encode())],
        )
        return usage, RequestStatus.INTERRUPTED, 503, None

    async def _assembled(
        self,
        call: Call,
        receive: Receive,
        send: Send,
        body: dict[str, Any],
        headers: dict[str, str],
        raw: RawWriter | None,
    ) -> Whole:
        """A non-streamed request served from vLLM's stream (``sidecar.assemble``)."""
        n = body.get("n")
        assembler = Assembler(call.endpoint, n if isinstance(n, int) and n > 0 else 1)
        # The client gets nothing before the end: the journal's tick keeps the tokens so far,
        # and the slot the prompt and response id of the first events.
        self.journal.track(call.request_id, assembler)
        slot = self.journal.slot(call.request_id)

        async def exchange() -> _Exchanged:
            sink = await self._exchange(call, streamed_body(body), headers, assembler, slot)
            # A refusal before any SSE is read whole: the same JSON error as for the whole request.
            return sink, None if sink.streamed else b"".join(sink.parts)

        if raw is not None:
            work, ended = await self._whole_raw(
                call, streamed_body(body), headers, assembler, raw, slot
            )
        else:
            work, ended = await self._race(exchange(), receive)
        if ended == "cut":
            return await self._cut(call, work, send, assembler)
        if ended == "left":
            # The tokens vLLM spent until the hang-up are in the last chunk read.
            call.response_id = assembler.response_id
            usage = assembler.usage_so_far()
            with contextlib.suppress(SpoolError):
                self.accounting.record(call, RequestStatus.CLIENT_ABORTED, 499, usage, None, None)
            return usage, RequestStatus.CLIENT_ABORTED, 499, None
        call.response_id = assembler.response_id
        try:
            response, whole = work.result()
        except UPSTREAM_ERRORS as exc:
            code, message = upstream_failure(exc)
            usage = assembler.usage_so_far()
            with contextlib.suppress(SpoolError):
                self.accounting.record(call, RequestStatus.UPSTREAM_ERROR, code, usage, None, None)
            await respond(send, code, message, [JSON, *call.echo_headers()])
            return usage, RequestStatus.UPSTREAM_ERROR, code, None
        out = answer(response.status, whole, assembler)
        if whole is not None:
            call.response_id = response_id(whole)
        finish = assembler.finish_reason
        if ended == "finished":
            # The client left as the answer ended: it got none of it.
            with contextlib.suppress(SpoolError):
                self.accounting.record(
                    call, RequestStatus.CLIENT_ABORTED, 499, out.usage, None, finish
                )
            return out.usage, RequestStatus.CLIENT_ABORTED, 499, finish
        try:
            self.accounting.record(call, out.status, out.http_status, out.usage, None, finish)
        except SpoolError:
            raise Refusal(503, *_WITHHELD) from None
        # The stream's own content type gives way to the one vLLM gives a whole answer.
        head = response.raw_headers
        if whole is None:
            head = [
                (b"content-type", b"application/json"),
                *((k, v) for k, v in head if k.lower() != b"content-type"),
            ]
        content, cost = self._costed(call, out.http_status, out.usage, out.body)
        await respond(send, out.http_status, content, [*whole_headers(call, head), *cost])
        return out.usage, out.status, out.http_status, finish

    async def _whole_raw(
        self,
        call: Call,
        body: dict[str, Any],
        headers: dict[str, str],
        assembler: Assembler | None,
        raw: RawWriter,
        slot: Slot | None = None,
        finish: bool = False,
    ) -> tuple[asyncio.Future[_Exchanged], _Ended]:
        """A whole exchange on the protocol pool, waited for as a stream is (``relay_stream``).

        The response's end, the client's connection closing (the sink is the client writer's
        listener) and the drain's cut all resolve the sink's one future ``finished``: no task
        and no race. What ``_race`` gives, as a future already done: the exchange's outcome (or
        error) and how the wait ended; on ``left`` and ``cut`` the connection is closed, which
        makes vLLM abort the request. With ``finish``, the client's connection closing is not
        listened to: the answer is read to its end (``finished`` if the client left meanwhile).
        """
        loop = asyncio.get_running_loop()
        work: asyncio.Future[_Exchanged] = loop.create_future()
        sink = WholeSink(loop, assembler, slot)
        try:
            conn = await self._send(call, body, headers, sink, assembler is not None)
        except Exception as exc:
            work.set_exception(exc)
            return work, "done"
        self._batched(call, sink, conn)
        finished = sink.finished
        if not finish:
            raw.listener = sink
            if raw.lost.done():
                sink.writer_lost()
        try:
            if self.drain.watch(finished):
                await finished
        finally:
            self.drain.unwatch(finished)
            raw.listener = None
            if not finished.done() or finished.cancelled():
                conn.close()
        ended = finished.result() if finished.done() else CUT
        if ended is LEFT or ended is CUT:
            # The client gets nothing either way; what vLLM sent until now was spent on it.
            conn.read_received()
            conn.close()
            work.cancel()
            return work, "left" if ended is LEFT else "cut"
        if ended is None:
            work.set_result((sink, None if sink.streamed else b"".join(sink.parts)))
        else:
            work.set_exception(_whole_failure(sink, ended))
        return work, "finished" if raw.lost.done() else "done"

    def _batched(self, call: Call, sink: WholeSink, conn: Connection) -> None:
        """Read an assembled answer in batches: once its slot has the stream's first events
        (at once without a slot), the kernel gathers the chunks until the end or a ``pull``,
        which the journal's tick makes through the sink."""
        if sink.assembler is None:
            return
        sink.upstream = conn
        if sink.slot is None:
            conn.batch()
        self.journal.track(call.request_id, sink)

    async def _exchange(
        self,
        call: Call,
        body: dict[str, Any],
        headers: dict[str, str],
        assembler: Assembler | None,
        slot: Slot | None = None,
    ) -> WholeSink:
        """A whole exchange on the protocol pool, awaited (``_race`` runs it as a task)."""
        sink = WholeSink(asyncio.get_running_loop(), assembler, slot)
        conn = await self._send(call, body, headers, sink, assembler is not None)
        self._batched(call, sink, conn)
        try:
            exc = await sink.finished
        except BaseException:
            # Cancelled (the client left, or the drain): what vLLM sent until now was spent on
            # it, and a batched connection leaves it in the kernel: read it, then close, which
            # makes vLLM abort the request.
            conn.read_received()
            conn.close()
            raise
        if exc is None:
            return sink
        raise _whole_failure(sink, exc)


_UNMETERED = sse_error_event(
    "Usage metering is unavailable; the response is incomplete.",
    "server_error",
    "metering_unavailable",
)
_STREAM_ENDS = {
    RequestStatus.OK: b"data: [DONE]\n\n",
    RequestStatus.UPSTREAM_ERROR: sse_error_event(
        "The upstream model server stopped responding mid-stream."
    ),
    RequestStatus.INTERRUPTED: sse_error_event(
        "The sidecar shut down before the stream was complete.",
        "server_error",
        "server_shutting_down",
    ),
}


def _refusal(exc: BaseException) -> Refusal:
    """The 502 or 504 of an upstream that failed before its response head."""
    status, message = upstream_failure(exc)
    return Refusal(
        status,
        orjson.loads(message)["error"]["message"],
        "upstream_error",
        "upstream_unreachable" if status == 502 else "upstream_timeout",
        RequestStatus.UPSTREAM_ERROR,
    )


def _whole_failure(sink: WholeSink, exc: BaseException) -> BaseException:
    """What a failed whole exchange raises: with nothing back (unreachable, or timed out) the
    502 or 504 a refused connection gets, else the error itself."""
    return _refusal(exc) if sink.status == 0 else exc


def stream_end(status: RequestStatus) -> bytes:
    """The last event of a stream that ended with ``status`` (none for a client that left)."""
    return _STREAM_ENDS.get(status, b"")


def whole_outcome(
    http_status: int, content: bytes
) -> tuple[UsageCounts | None, RequestStatus, str | None]:
    """Usage, record status and finish reason of a whole answer vLLM gave."""
    usage = finish = None
    at = content.find(b'"usage":{')
    if at >= 0:
        usage = parse_usage(content[at:])
    if http_status == 200:
        i = content.find(b'"finish_reason":"')
        if i >= 0:
            i += len(b'"finish_reason":"')
            finish = content[i : content.find(b'"', i)].decode()
        return usage, RequestStatus.OK, finish
    status = RequestStatus.BAD_REQUEST if http_status < 500 else RequestStatus.UPSTREAM_ERROR
    return usage, status, finish


def whole_headers(call: Call, raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A whole (non-streamed) answer's headers: vLLM's own, then the sidecar's."""
    echo = call.echo_headers()
    # vLLM may echo x-request-id itself; the caller's is sent once.
    drop = _DROP_DOWN | {b"x-request-id"} if echo else _DROP_DOWN
    headers = [(k.lower(), v) for k, v in raw if k.lower() not in drop]
    return [
        *headers,
        (b"x-infermeter-request-id", call.request_id.encode()),
        *echo,
        *call.ratelimit_headers(),
    ]


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has gone (ASGI's ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass
