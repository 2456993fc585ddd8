"""The floor under any Python ASGI relay on this stack: uvicorn + aiohttp with no sidecar logic.

A ``--sidecar-launcher`` for ``bench/sidecar_overhead.py``. It serves the sidecar's address with
the least a streaming proxy can do on the same server (uvicorn, httptools, the default asyncio
loop) and the same upstream client (aiohttp): read the request, swap the model alias for the served
model, forward it, and send every block that arrives straight on. No authentication, limits,
metering, rewriting or spool. Its CPU per chunk is what the sidecar's own work is added to.

    .venv/bin/python -m bench.sidecar_overhead --sidecar-launcher bench/relay_floor.py

It takes the arguments of ``infermeter sidecar`` (``--config``, ``--replica``, ``--listen``), and
runs on uvloop with ``BENCH_EVENT_LOOP=uvloop``. ``bench/protocol_floor.py`` is the floor under
the protocol relay, on bare asyncio protocols.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from infermeter.asgi import Receive, Scope, Send, read_body, respond
from infermeter.config import load_config
from infermeter.serving import host_port, server

__all__ = ["Relay", "main"]

_HOP = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding"})


class Relay:
    """Forward every request to one upstream and stream the answer back untouched."""

    def __init__(self, upstream: str, aliases: dict[bytes, bytes]) -> None:
        self.upstream = upstream.rstrip("/")
        self.aliases = aliases
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer /healthz; relay everything else."""
        if scope["type"] != "http":
            return
        if scope["path"] == "/healthz":
            await respond(send, 200, b"{}", [(b"content-type", b"application/json")])
            return
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        body = await read_body(receive, 1 << 20) or b""
        for alias, served in self.aliases.items():
            body = body.replace(alias, served)
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k not in _HOP}
        url = self.upstream + scope["path"]
        async with self.session.post(url, data=body, headers=headers) as response:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [
                        (b"content-type", response.headers.get("content-type", "").encode())
                    ],
                }
            )
            read = response.content.readany
            while block := await read():
                await send({"type": "http.response.body", "body": block, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the relay where the sidecar of ``--replica`` would listen."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["sidecar"])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--listen", required=True)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    replica = config.replica(args.replica)
    aliases = {f'"{replica.model}"'.encode(): f'"{replica.served_version}"'.encode()}
    host, port = host_port(args.listen)
    app = Relay(replica.upstream_url, aliases)
    srv = server(app, host, port, lifespan="off")  # every server's uvicorn settings
    if os.environ.get("BENCH_EVENT_LOOP", "asyncio") == "uvloop":
        # Run as a script, this file cannot import bench/protocol_floor.py's helper.
        import uvloop

        uvloop.run(srv.serve())
    else:
        asyncio.run(srv.serve())


if __name__ == "__main__":
    main(sys.argv[1:])
