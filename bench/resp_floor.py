"""The floor under shared admission: the same script over a bare asyncio Protocol speaking RESP.

No client library: one connection, requests written as RESP arrays, replies matched in order and
parsed only as far as counting them. Whatever the sidecar's admission costs above this is the
client library's and the limiter's; this much is the event loop, the system calls and Redis.

    .venv/bin/python -m bench.resp_floor --duration 5 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import deque
from typing import Any

import redis

from bench.shared_limits import redis_server
from infermeter.serving import loop_factory
from sidecar.shared_scripts import ADMIT


def command(*parts: str | int) -> bytes:
    """One RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        raw = str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


class Resp(asyncio.Protocol):
    """Pipelined RESP: each reply resolves the oldest waiting future (replies are arrays)."""

    def __init__(self) -> None:
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = reply_end(self.buffer)
            if end is None:
                return
            self.buffer = self.buffer[end:]
            self.waiting.popleft().set_result(None)

    def call(self, payload: bytes) -> asyncio.Future[None]:
        """Send one command; the future resolves when its reply has come."""
        assert self.transport is not None
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.transport.write(payload)
        return future


def reply_end(buf: bytes, pos: int = 0) -> int | None:
    """Where the RESP reply starting at ``pos`` ends, or None when it has not all come."""
    line = buf.find(b"\r\n", pos)
    if line < 0:
        return None
    kind, value = buf[pos : pos + 1], buf[pos + 1 : line]
    pos = line + 2
    if kind == b"*":
        for _ in range(int(value)):
            end = reply_end(buf, pos)
            if end is None:
                return None
            pos = end
        return pos
    if kind == b"$" and int(value) >= 0:
        pos += int(value) + 2
        return pos if pos <= len(buf) else None
    return pos


async def run(
    port: int, concurrency: int, duration: float, request_seconds: float
) -> dict[str, Any]:
    """Admit (one EVALSHA of the real script), hold, and admit again, from ``concurrency`` tasks."""
    sha = str(redis.Redis(port=port).script_load(ADMIT))
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(Resp, "127.0.0.1", port)
    rng = random.Random(1)
    latencies: list[float] = []
    stop = time.monotonic() + duration

    async def worker(n: int) -> None:
        seq = 0
        while time.monotonic() < stop:
            seq += 1
            payload = command(
                "EVALSHA",
                sha,
                4,
                "f:{t}:b",
                "f:{t}:c",
                "f:{t}:x",
                "f:{t}:p",
                10**9,
                10**12,
                10**6,
                100,
                f"{n}:{seq}",
                30000,
                0,
                0,
                "bench",
                0,
                0,
            )
            t0 = time.perf_counter()
            await proto.call(payload)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(request_seconds * rng.uniform(0.5, 1.5))

    cpu0 = time.process_time()
    await asyncio.gather(*(worker(n) for n in range(concurrency)))
    cpu = time.process_time() - cpu0
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "p50_ms": latencies[n // 2] * 1000,
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1000,
        "cpu_us_per_request": cpu / n * 1e6,
    }


def cli() -> None:
    """Parse flags, run, print one line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio"),
        default="auto",
        help="the event loop, as sidecar.event_loop (auto: uvloop, the sidecar's default)",
    )
    p.add_argument("--request-ms", type=float, default=100.0)
    args = p.parse_args()
    with redis_server() as port, asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
        r = runner.run(run(port, args.concurrency, args.duration, args.request_ms / 1000))
    print(
        f"raw RESP c={args.concurrency}: {r['requests']} admissions, p50 {r['p50_ms']:.3f} ms, "
        f"p99 {r['p99_ms']:.3f} ms, {r['cpu_us_per_request']:.1f} us CPU per admission"
    )


if __name__ == "__main__":
    cli()
