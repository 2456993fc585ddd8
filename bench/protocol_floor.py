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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, cast

import httptools

from infermeter.config import load_config
from infermeter.serving import host_port

__all__ = ["main", "run_on_loop"]

_HOP = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding"})
_HEALTHY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def run_on_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on the loop ``BENCH_EVENT_LOOP`` names: ``asyncio`` (default) or ``uvloop``."""
    if os.environ.get("BENCH_EVENT_LOOP", "asyncio") == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the replica, lent to one client request at a time."""

    def __init__(self, idle: list[Upstream]) -> None:
        self.idle = idle
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.client is not None:
            self.client.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.client = None
        self.idle.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.idle:
            self.idle.remove(self)
        if self.client is not None:
            self.client.close()


class Front(asyncio.Protocol):
    """A client connection: parse each request and hand it to an upstream connection."""

    def __init__(self, upstream: tuple[str, int], aliases: dict[bytes, bytes], idle: list[Upstream]) -> None:  # fmt: skip
        self.upstream, self.aliases, self.idle = upstream, aliases, idle
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
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
        for alias, served in self.aliases.items():
            body = body.replace(alias, served)
        method = self.parser.get_method()
        head = b"%b %b HTTP/1.1\r\nhost: %b:%d\r\ncontent-length: %d\r\n%b\r\n" % (
            method, self.url, self.upstream[0].encode(), self.upstream[1], len(body),
            b"".join(self.headers),
        )  # fmt: skip
        request = head + body
        if self.idle:
            self._send(self.idle.pop(), request)
        else:
            asyncio.get_running_loop().create_task(self._connect(request))

    async def _connect(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: Upstream(self.idle), *self.upstream)
        self._send(conn, request)

    def _send(self, conn: Upstream, request: bytes) -> None:
        assert conn.transport is not None
        conn.client = self.transport
        conn.transport.write(request)


async def serve(listen: str, upstream: tuple[str, int], aliases: dict[bytes, bytes]) -> None:
    """Serve until cancelled (Ctrl-C)."""
    idle: list[Upstream] = []
    host, port = host_port(listen)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Front(upstream, aliases, idle), host, port)
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
    replica = load_config(args.config).replica(args.replica)
    aliases = {f'"{replica.model}"'.encode(): f'"{replica.served_version}"'.encode()}
    upstream = host_port(replica.upstream_url)
    with contextlib.suppress(KeyboardInterrupt):
        run_on_loop(serve(args.listen, upstream, aliases))


if __name__ == "__main__":
    main(sys.argv[1:])
