"""Python objects per open stream in the sidecar, against what its RSS grows by.

Runs one simulated replica (``infermeter simulate --replica small-0``, a child process) and a
sidecar in this process on uvloop, opens ``--streams`` long streams through it, and compares
with tracemalloc what Python allocated for them (by where, top lines) with how much the
process's RSS grew. What RSS adds beyond the traced objects is below Python's allocator.

    .venv/bin/python -m bench.stream_memory --streams 300
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import uvloop

from infermeter.config import DEFAULT_CONFIG, load_config
from infermeter.serving import free_port
from sidecar.app import Sidecar
from sidecar.http_server import HttpServer

_BODY = (
    b'{"model":"chat-small","messages":[{"role":"user","content":"Count to a large number."}],'
    b'"stream":true,"max_tokens":3000,"ignore_eos":true}'
)


class _Reader(asyncio.Protocol):
    """A client that sends one streamed request and discards what comes back."""

    def __init__(self, request: bytes) -> None:
        self.request = request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        pass


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def measure(streams: int, top: int) -> None:
    """Open the streams and print the comparison."""
    config = load_config(DEFAULT_CONFIG)
    replica = config.replica("small-0")
    with tempfile.TemporaryDirectory() as spool:
        app = Sidecar(config, "small-0", spool_dir=Path(spool))
        port = free_port()
        srv = HttpServer(app, "127.0.0.1", port, limits=app.server_limits)  # as the sidecar serves
        task = asyncio.get_running_loop().create_task(srv.serve())
        while not srv.started:
            await asyncio.sleep(0.05)
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
            b"im-demo-search\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        )
        request = head % len(_BODY) + _BODY
        loop = asyncio.get_running_loop()
        clients = []
        for _ in range(5):  # warm-up: pools, caches, first imports
            clients.append(
                await loop.create_connection(lambda: _Reader(request), "127.0.0.1", port)
            )
        await asyncio.sleep(2)
        gc.collect()
        rss0 = _rss_kib()
        tracemalloc.start(4)
        before = tracemalloc.take_snapshot()
        for _ in range(streams):
            clients.append(
                await loop.create_connection(lambda: _Reader(request), "127.0.0.1", port)
            )
        await asyncio.sleep(4)
        gc.collect()
        after = tracemalloc.take_snapshot()
        rss1 = _rss_kib()
        tracemalloc.stop()
        stats = after.compare_to(before, "lineno")
        traced = sum(s.size_diff for s in stats)
        print(f"upstream {replica.upstream_url}, {streams} streams")
        print(f"traced Python allocations: {traced / streams / 1024:.1f} KiB per stream")
        print(
            f"RSS growth (tracemalloc's own bookkeeping included): "
            f"{(rss1 - rss0) / streams:.1f} KiB per stream"
        )
        for s in stats[:top]:
            frame = s.traceback[0]
            print(
                f"  {s.size_diff / streams:8.0f} B/stream  {frame.filename.rsplit('/', 2)[-2:]}:{frame.lineno}"
            )
        for transport, _ in clients:  # hang up: the sidecar aborts them upstream and records them
            transport.close()
        await asyncio.sleep(1)
        srv.should_exit = True
        await task


def main() -> int:
    """Start the replica, measure, stop it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=300)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    replica = subprocess.Popen(
        [sys.executable, "-m", "launcher", "simulate", "--replica", "small-0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(3)
        uvloop.run(measure(args.streams, args.top))
    finally:
        replica.kill()
        replica.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
