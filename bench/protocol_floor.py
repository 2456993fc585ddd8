"""The floor under the sidecar's relay: bare asyncio protocols, no framework, no sidecar logic.

A ``--sidecar-launcher`` for ``bench/sidecar_overhead.py``. It serves the sidecar's address with
the least a Python relay on the lowest layer the language offers can do: httptools parses the
request, the model alias is swapped for the served model, the request goes out on a pooled
upstream connection, and every upstream read is written to the client's transport as it arrives,
framing and all (httptools reads it only to see where the response ends). No authentication,
limits, metering, rewriting, spool or flow control. The sidecar's CPU above this is its own work.

    .venv/bin/python -m bench.sidecar_overhead --sidecar-launcher bench/protocol_floor.py
    BENCH_EVENT_LOOP=uvloop .venv/bin/python -m bench.sidecar_overhead \\
        --sidecar-launcher bench/protocol_floor.py

``BENCH_EVENT_LOOP=uvloop`` runs it (and ``bench/relay_floor.py``) on uvloop instead of the
standard library's loop. It takes the arguments of ``infermeter sidecar``.

``BENCH_FLOOR_WORK=1`` adds, written inline with no structure around it, the least work that the
sidecar cannot skip for a request (``Work``): a request id, the team key's SHA-256 compared in
constant time with every team's, the body parsed, its model swapped and ``include_usage`` set,
then serialized again, a token bucket taken, the admission's journal line written to a file
before forwarding (for kill -9), every upstream read scanned for content and usage before it
is written, the per-chunk usage the client did not ask for cut out of each block (one regular
expression, then the block framed again), and the request's record written at its end. A
non-streamed request is asked of the replica as a stream with usage on every chunk, read whole
and answered as one JSON body, as the sidecar does to bill a client that hangs up. Not done:
fsync (the sidecar makes each record durable, its disk thread sharing one fsync among records),
so this is a floor below the job.
What the sidecar adds above it is the cost of its structure, not of its job:

    BENCH_FLOOR_WORK=1 BENCH_EVENT_LOOP=uvloop .venv/bin/python -m bench.sidecar_overhead \\
        --quick --phases ttft_c1,ttft_paired,c16_json --sidecar-launcher bench/protocol_floor.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import httptools
import orjson

from infermeter.auth import AuthError, KeyRing
from infermeter.config import Config, load_config
from infermeter.serving import host_port

__all__ = ["main", "run_on_loop"]


class Admitted(NamedTuple):
    """A request let through, as the upstream connection needs it."""

    body: bytes  # to forward
    whole: bool  # the client asked for a non-streamed answer
    record: dict[str, Any]  # as journaled
    # What the client asked for of vLLM's usage (``stream_options``): the floor cuts out what
    # it did not ask for, as the sidecar does.
    continuous_usage: bool
    final_usage: bool


_HOP = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding"})
# The usage vLLM puts on a chunk (after its choices), and its final usage chunk (no choices):
# what a client that did not ask for them must not see.
_FINAL_USAGE = re.compile(rb'data: \{[^\n]*"choices":\[\],"usage"[^\n]*\n\n')
_CHUNK_USAGE = re.compile(rb'(\}\]),"usage":\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}')
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_HEALTHY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def run_on_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on the loop ``BENCH_EVENT_LOOP`` names: ``asyncio`` (default) or ``uvloop``."""
    if os.environ.get("BENCH_EVENT_LOOP", "asyncio") == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


class Work:
    """The least per-request work of the sidecar's job, inline (``BENCH_FLOOR_WORK=1``)."""

    def __init__(self, config: Config, replica: str, journal: int) -> None:
        self.keys = KeyRing((t.name, t.api_key_sha256) for t in config.teams)
        self.journal = journal
        self.replica = replica
        # One token bucket per team: tokens, refill per second, when last taken.
        self.buckets = {t.name: [1e9, 1e6, time.monotonic()] for t in config.teams}

    def admit(self, key: bytes, body: bytes, aliases: dict[str, str]) -> Admitted | None:
        """The body to forward, journaled; None for a refused key.

        A non-streamed request is asked of the replica as a stream with usage on every chunk
        and answered whole at its end, as the sidecar does so that a client that hangs up is
        still billed (``sidecar.non_streamed_via_stream``).
        """
        received, started = time.time(), time.perf_counter()
        request = os.urandom(16).hex()
        try:
            team = self.keys.team_for(key.decode("latin-1").partition(" ")[2])
        except AuthError:
            return None
        document = orjson.loads(body)
        requested = document.get("model")
        model = aliases.get(requested, requested)
        document["model"] = model
        whole = not document.get("stream")
        asked = document.get("stream_options") or {}
        continuous, final = (
            bool(asked.get("continuous_usage_stats")),
            bool(asked.get("include_usage")),
        )
        document["stream"] = True
        document["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        now = time.monotonic()
        bucket = self.buckets[team]
        bucket[0] = min(1e9, bucket[0] + (now - bucket[2]) * bucket[1]) - 1
        bucket[2] = now
        record = {
            "request_id": request,
            "team": team,
            "model": requested,
            "served": model,
            "endpoint": "chat.completions",
            "stream": not whole,
            "replica": self.replica,
            "received_at": received,
            "started": started,
            "reserve": 256,
            "status": "running",
            "client_request_id": None,
        }
        os.write(self.journal, orjson.dumps({"a": record}) + b"\n")
        return Admitted(orjson.dumps(document), whole, record, continuous, final)

    def end(self, record: dict[str, Any], usage: bytes) -> None:
        """The request's record, with the last usage seen, written where the journal is."""
        record["status"], record["usage"] = "ok", usage[:200].decode("latin-1")
        record["finished"] = time.perf_counter()
        os.write(self.journal, orjson.dumps(record) + b"\n")

    @staticmethod
    def answer(stream: bytes) -> bytes:
        """A non-streamed answer (its head and body) from the stream the replica sent."""
        payloads = [line[6:] for line in stream.split(b"\n") if line.startswith(b"data: {")]
        chunks = orjson.loads(b"[" + b",".join(payloads) + b"]")
        text, finish, usage = [], None, None
        for chunk in chunks:
            for choice in chunk.get("choices") or ():
                content = choice.get("delta", {}).get("content")
                if content is not None:
                    text.append(content)
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
        first = chunks[0] if chunks else {}
        message = {"role": "assistant", "content": "".join(text)}
        body = orjson.dumps(
            {
                "id": first.get("id"),
                "object": "chat.completion",
                "created": first.get("created"),
                "model": first.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            }
        )
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        return head % len(body) + body


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the replica, lent to one client request at a time."""

    def __init__(self, idle: list[Upstream], work: Work | None) -> None:
        self.idle = idle
        self.work = work
        # Dropped at the loss, as the sidecar's pool does: it holds this protocol's callbacks,
        # a cycle that would keep closed connections until a full collection.
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None
        # With ``work``: the exchange's record, the stream of a whole answer, the last usage,
        # and what the client asked for of the usage (on every chunk, at the end).
        self.record: dict[str, Any] | None = None
        self.whole: list[bytes] | None = None
        self.usage = b""
        self.continuous_usage = self.final_usage = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.client is not None and self.work is None:
            self.client.write(data)
        if self.parser is not None:
            self.parser.feed_data(data)

    def on_headers_complete(self) -> None:
        # With ``work`` the stream is framed again block by block (``on_body``): a new head.
        if self.client is not None and self.work is not None and self.whole is None:
            self.client.write(_SSE_HEAD)

    def scan(self, data: bytes) -> None:
        """What metering reads of an upstream block: its first content and its latest usage."""
        data.find(b'"content"')
        at = data.rfind(b'"usage"')
        if at >= 0:
            self.usage = data[at:]

    def on_body(self, body: bytes) -> None:
        if self.whole is not None:
            self.whole.append(body)
            self.scan(body)
        elif self.client is not None and self.work is not None:
            self.scan(body)
            if not self.continuous_usage:
                body = _CHUNK_USAGE.sub(rb"\1", body)
            if not self.final_usage and b'"choices":[],' in body:
                body = _FINAL_USAGE.sub(b"", body)
            if body:  # (an empty chunk would end the response)
                self.client.write(b"%x\r\n%b\r\n" % (len(body), body))

    def on_message_complete(self) -> None:
        if self.work is not None and self.record is not None:
            self.work.end(self.record, self.usage)
            if self.client is not None:
                if self.whole is not None:
                    self.client.write(self.work.answer(b"".join(self.whole)))
                else:
                    self.client.write(b"0\r\n\r\n")
        self.client, self.record, self.whole, self.usage = None, None, None, b""
        self.idle.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.idle:
            self.idle.remove(self)
        if self.client is not None:
            self.client.close()
        self.parser = None


class Front(asyncio.Protocol):
    """A client connection: parse each request and hand it to an upstream connection."""

    def __init__(
        self,
        upstream: tuple[str, int],
        aliases: dict[bytes, bytes],
        idle: list[Upstream],
        work: Work | None,
    ) -> None:
        self.upstream, self.aliases, self.idle, self.work = upstream, aliases, idle, work
        self.names = {a.strip(b'"').decode(): s.strip(b'"').decode() for a, s in aliases.items()}
        self.key = b""
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.parser is None:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.parser = None  # (its callbacks hold this protocol: a cycle otherwise)

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body, self.key = b"", [], [], b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.work is not None and name.lower() == b"authorization":
            self.key = value
            return
        if name.lower() not in _HOP:
            self.headers.append(b"%b: %b\r\n" % (name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.url == b"/healthz":
            self.transport.write(_HEALTHY)
            return
        body = b"".join(self.body)
        admitted = None
        if self.work is not None:
            admitted = self.work.admit(self.key, body, self.names)
            if admitted is None:
                self.transport.close()
                return
            body = admitted.body
        else:
            for alias, served in self.aliases.items():
                body = body.replace(alias, served)
        assert self.parser is not None  # (called back by it)
        method = self.parser.get_method()
        head = b"%b %b HTTP/1.1\r\nhost: %b:%d\r\ncontent-length: %d\r\n%b\r\n" % (
            method,
            self.url,
            self.upstream[0].encode(),
            self.upstream[1],
            len(body),
            b"".join(self.headers),
        )
        request = head + body
        if self.idle:
            self._send(self.idle.pop(), request, admitted)
        else:
            asyncio.get_running_loop().create_task(self._connect(request, admitted))

    async def _connect(self, request: bytes, admitted: Admitted | None) -> None:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: Upstream(self.idle, self.work), *self.upstream
        )
        self._send(conn, request, admitted)

    def _send(self, conn: Upstream, request: bytes, admitted: Admitted | None) -> None:
        assert conn.transport is not None
        conn.client = self.transport
        if admitted is not None:
            conn.record = admitted.record
            conn.whole = [] if admitted.whole else None
            conn.continuous_usage, conn.final_usage = (
                admitted.continuous_usage,
                admitted.final_usage,
            )
        conn.transport.write(request)


async def serve(
    listen: str, upstream: tuple[str, int], aliases: dict[bytes, bytes], work: Work | None = None
) -> None:
    """Serve until cancelled (Ctrl-C)."""
    idle: list[Upstream] = []
    host, port = host_port(listen)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Front(upstream, aliases, idle, work), host, port)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the relay where the sidecar of ``--replica`` would listen."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("command", choices=["sidecar"])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--listen", required=True)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    replica = config.replica(args.replica)
    aliases = {f'"{replica.model}"'.encode(): f'"{replica.served_version}"'.encode()}
    upstream = host_port(replica.upstream_url)
    with contextlib.ExitStack() as stack:
        work = None
        if os.environ.get("BENCH_FLOOR_WORK") == "1":
            journal = stack.enter_context(tempfile.TemporaryFile(prefix="floor-journal-"))
            work = Work(config, replica.id, journal.fileno())
        with contextlib.suppress(KeyboardInterrupt):
            run_on_loop(serve(args.listen, upstream, aliases, work))


if __name__ == "__main__":
    main(sys.argv[1:])
