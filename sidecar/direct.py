"""The streamed relay on protocols: vLLM's blocks metered and written to the client as they arrive.

``StreamSink`` receives the response on the upstream connection (``sidecar.pool``) and, from
inside ``data_received``, meters each block (``StreamMeter.feed``) and writes what the client
should see to the client's transport (``infermeter.http_guard.RawWriter``; behind a server that
gives none, ``sidecar.send_writer.SendWriter`` sends it as ASGI messages). Per block that is
one parse, one meter pass and one write: no task switch, no ASGI message, no timer. The coroutine
serving the request only starts the response, waits for the end, the client leaving or the
drain, and then keeps the request's ending (``Accounting.record``) before the final
``data: [DONE]``. All three end the wait through the one future ``finished``: the
upstream's end gives it None or the error, the client's connection closing ``LEFT``
(``writer_lost``: the sink is the client writer's listener), the drain's cut
``sidecar.drain.CUT``.

Flow control both ways: while the client's transport is paused (its socket buffer is full), the
upstream connection stops reading, so vLLM's bytes wait in the kernel, not in the sidecar.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from infermeter.http_guard import RawWriter
from sidecar.assemble import Assembler
from sidecar.pool import Connection, Pool, UpstreamClosed, request_head
from sidecar.progress import Slot
from sidecar.send_writer import SendWriter
from sidecar.stream import StreamMeter, UsageCounts

__all__ = ["LEFT", "Left", "Pools", "StreamSink", "Target", "WholeSink"]


class Left(Exception):
    """The client's connection closed, as the result a stream's ``finished`` gets (never raised)."""


# The one value of ``Left`` a stream's ``finished`` is given.
LEFT = Left("the client closed the connection")


class StreamSink:
    """One streamed response: held until the client's response starts, then relayed directly."""

    __slots__ = ("error", "finished", "headed", "meter", "pending", "status", "upstream", "writer")

    def __init__(self, meter: StreamMeter, loop: asyncio.AbstractEventLoop) -> None:
        self.meter = meter
        self.status = 0
        # The status once the head is in, or the exception that came instead.
        self.headed: asyncio.Future[int | BaseException] = loop.create_future()
        # None once the response ended cleanly, else the exception that ended it, ``LEFT`` or
        # the drain's ``CUT`` (whichever came first).
        self.finished: asyncio.Future[BaseException | None] = loop.create_future()
        self.writer: RawWriter | SendWriter | None = None
        # The connection the response comes on, paused and resumed with the client's writer.
        self.upstream: Connection | None = None
        # What the client should see, metered before its response had started (made when needed:
        # most streams start their response before their first block).
        self.pending: list[bytes] | None = None
        # A refusal's body (any status but 200), read whole.
        self.error: list[bytes] | None = None

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The status is in: the serving coroutine decides how to answer."""
        self.status = status
        if not self.headed.done():
            self.headed.set_result(status)

    def body(self, data: bytes, now: float) -> None:
        """Meter a block read at ``now`` and relay it (the per-chunk path)."""
        if self.status != 200:
            if self.error is None:
                self.error = []
            self.error.append(data)
            return
        meter = self.meter
        if meter.done:
            # Bytes after [DONE] are not vLLM's stream.
            return
        out = meter.feed(data, now)
        if out:
            writer = self.writer
            if writer is not None:
                writer.write(out)
            elif self.pending is None:
                self.pending = [out]
            else:
                self.pending.append(out)

    def end(self, exc: BaseException | None) -> None:
        """The response ended (``exc`` None) or failed."""
        if not self.headed.done():
            self.headed.set_result(exc or UpstreamClosed("no response from the replica"))
        if not self.finished.done():
            self.finished.set_result(exc)

    # -- the client writer's listener (``infermeter.http_guard.WriterListener``) ----------------

    def writer_paused(self) -> None:
        """The client cannot take more for now: stop reading from the replica."""
        if self.upstream is not None:
            self.upstream.pause_reading()

    def writer_resumed(self) -> None:
        """The client takes more again."""
        if self.upstream is not None:
            self.upstream.resume_reading()

    def writer_lost(self) -> None:
        """The client's connection closed."""
        if not self.finished.done():
            self.finished.set_result(LEFT)

    def go_direct(self, writer: RawWriter | SendWriter) -> None:
        """The client's response has started: write what is held (one write), then every block
        at once."""
        if self.pending:
            writer.write(b"".join(self.pending))
            self.pending = None
        self.writer = writer


class WholeSink:
    """A whole response read to its end, or a stream read into an ``Assembler``.

    A stream read into an assembler on a connection of its own (``upstream``, closed by the
    replica after the answer) is batched (``Connection.batch``) once the slot has what the
    stream's first events give: from then on the kernel gathers vLLM's chunks and the loop reads
    them at the end, or when the tokens so far are asked for (``usage_so_far``).
    """

    __slots__ = (
        "assembler",
        "finished",
        "parts",
        "raw_headers",
        "slot",
        "status",
        "streamed",
        "upstream",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, assembler: Assembler | None, slot: Slot | None = None
    ) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.parts: list[bytes] = []
        self.assembler = assembler
        # The journal's slot, until it has the prompt tokens and response id of the stream's
        # first events (``Slot.opening``).
        self.slot = slot
        self.streamed = False
        self.finished: asyncio.Future[BaseException | None] = loop.create_future()
        # The connection to batch once the slot is served (None: read every block as it comes).
        self.upstream: Connection | None = None

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Keep the status and headers; a refusal before any SSE is read whole."""
        self.status, self.raw_headers = status, headers
        if self.assembler is not None and status == 200:
            kind = next((v for k, v in headers if k.lower() == b"content-type"), b"")
            self.streamed = kind.split(b";")[0].strip().lower() == b"text/event-stream"

    def body(self, data: bytes, now: float) -> None:
        """Keep a piece of the body, or feed it to the assembler."""
        if self.streamed:
            assert self.assembler is not None
            self.assembler.feed(data)
            if self.slot is not None and self.slot.opening(data):
                self.slot = None
                if self.upstream is not None:
                    self.upstream.batch()
        else:
            self.parts.append(data)

    def usage_so_far(self) -> UsageCounts | None:
        """The tokens vLLM has reported so far, the kernel's unread chunks included (the
        journal's ``Counting``)."""
        assert self.assembler is not None
        if self.upstream is not None:
            self.upstream.pull()
        return self.assembler.usage_so_far()

    def end(self, exc: BaseException | None) -> None:
        """Wake the waiting coroutine."""
        if not self.finished.done():
            self.finished.set_result(exc)

    # -- the client writer's listener (``infermeter.http_guard.WriterListener``) ----------------

    def writer_paused(self) -> None:
        """Nothing to do: the answer is written once it is whole."""

    def writer_resumed(self) -> None:
        """Nothing to do: the answer is written once it is whole."""

    def writer_lost(self) -> None:
        """The client's connection closed."""
        if not self.finished.done():
            self.finished.set_result(LEFT)


@dataclass(frozen=True, slots=True)
class Target:
    """Where a base URL's requests go: its pool, ``host`` header, path prefix and credentials.

    ``authorization``: a ``Basic`` header for the user and password written in the URL, sent
    unless the request has an authorization header of its own (the upstream's API key).
    """

    pool: Pool
    host: bytes
    prefix: bytes
    authorization: str | None = None

    def head(self, method: bytes, path: bytes, headers: dict[str, str], length: int) -> bytes:
        """The request head for ``path`` (below the prefix) with ``headers``."""
        if self.authorization is not None and "authorization" not in headers:
            headers = {**headers, "authorization": self.authorization}
        return request_head(method, self.prefix + path, self.host, headers, length)


class Pools:
    """One connection pool per upstream base URL (http or https), made on first use."""

    def __init__(self, connect_timeout_seconds: float, read_timeout_seconds: float) -> None:
        self.connect_timeout_seconds = connect_timeout_seconds
        self.read_timeout_seconds = read_timeout_seconds
        self._pools: dict[str, Target] = {}

    def get(self, base_url: str) -> Target:
        """The pool and request target of ``base_url`` (``http://`` or ``https://``, as the
        config's ``Url`` checks); everything after the host is the prefix of every path."""
        found = self._pools.get(base_url)
        if found is not None:
            return found
        parts = urlsplit(base_url)
        tls = parts.scheme == "https"
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        port = parts.port or (443 if tls else 80)
        pool = Pool(
            parts.hostname, port, self.connect_timeout_seconds, self.read_timeout_seconds, tls
        )
        host = parts.netloc.rpartition("@")[2]
        rest = base_url[base_url.index(parts.netloc) + len(parts.netloc) :]
        auth = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            auth = "Basic " + base64.b64encode(pair.encode("latin-1")).decode("ascii")
        found = Target(pool, host.encode("latin-1"), rest.rstrip("/").encode("latin-1"), auth)
        self._pools[base_url] = found
        return found

    async def close(self) -> None:
        """Close every connection of every pool."""
        for target in self._pools.values():
            await target.pool.close()
        self._pools.clear()
