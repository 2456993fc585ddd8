"""What fleet-wide team limits in Redis add to each admission, against the per-process limiter.

Starts Debian's redis-server on a free loopback port (no persistence), then for each limiter
keeps ``C`` tasks admitting and settling requests of one team (requests/min, tokens/min and
concurrency limits all set, high enough never to refuse) for ``--duration`` seconds. Admission
is awaited before a request is forwarded, so its latency adds to time to first token one for one.
Reports the admission latency p50/p99, the process CPU per request, and (for Redis) the commands
Redis ran per request, from ``INFO commandstats``.

    .venv/bin/python -m bench.shared_limits --duration 5 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from prometheus_client import CollectorRegistry

from infermeter.config import SharedLimitsSettings, TeamLimits
from infermeter.serving import free_port, loop_factory
from sidecar.shared_limits import SharedTeamLimiter
from sidecar.team_limits import LocalTeamLimiter, TeamLimiter

LIMITS = {
    "t": TeamLimits(requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent=10**6)
}


@contextmanager
def redis_server() -> Iterator[int]:
    """A throwaway redis-server on loopback; yields its port."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (make system-deps)")
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                d,
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            for _ in range(200):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.02)
            yield port
        finally:
            proc.kill()
            proc.wait()


async def run(
    limiter: TeamLimiter, concurrency: int, duration: float, request_seconds: float
) -> dict[str, Any]:
    """Admit, hold for ``request_seconds`` and settle, from ``concurrency`` tasks."""
    latencies: list[float] = []
    rng = random.Random(1)
    await limiter.start()
    for _ in range(50):  # warm-up: connections, script cache
        limiter.settle(await limiter.admit("t", 100), 50)
    stop = time.monotonic() + duration

    async def worker() -> None:
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            admission = await limiter.admit("t", 100)
            latencies.append(time.perf_counter() - t0)
            # The request itself runs here; its length varies so the tasks do not march in step.
            await asyncio.sleep(request_seconds * rng.uniform(0.5, 1.5))
            limiter.settle(admission, 50)

    cpu0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu = time.process_time() - cpu0
    await limiter.close()
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "p50_ms": latencies[n // 2] * 1000,
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1000,
        "cpu_us_per_request": cpu / n * 1e6,
    }


def redis_calls(port: int) -> int:
    """Commands the limiter sent to Redis so far: scripts run, and script management.

    Redis's own totals also count the commands a script runs inside the server, which are no
    round trip; the limiter sends nothing but EVALSHA (EVAL, SCRIPT on a restart).
    """
    stats: dict[str, Any] = redis.Redis(port=port).info("commandstats")  # type: ignore[assignment]
    return sum(
        int(v["calls"])
        for k, v in stats.items()
        if k in ("cmdstat_evalsha", "cmdstat_eval") or k.startswith("cmdstat_script")
    )


async def main(concurrency: int, duration: float, request_seconds: float) -> dict[str, Any]:
    """Both limiters at one concurrency."""
    local = await run(LocalTeamLimiter(LIMITS), concurrency, duration, request_seconds)
    with redis_server() as port:
        settings = SharedLimitsSettings(
            redis_url=f"redis://127.0.0.1:{port}/0", timeout_millis=1000
        )
        shared = SharedTeamLimiter(settings, LIMITS, "bench", CollectorRegistry())
        before = redis_calls(port)
        result = await run(shared, concurrency, duration, request_seconds)
        await asyncio.sleep(0.2)
        sent = redis_calls(port) - before
        result["redis_commands_per_request"] = sent / (result["requests"] + 50)
    return {
        "concurrency": concurrency,
        "request_ms": request_seconds * 1000,
        "local": local,
        "redis": result,
        "added_p50_ms": result["p50_ms"] - local["p50_ms"],
        "added_p99_ms": result["p99_ms"] - local["p99_ms"],
    }


def cli() -> None:
    """Parse flags, run, print a table or JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio"),
        default="auto",
        help="the event loop, as sidecar.event_loop (auto: uvloop, the sidecar's default)",
    )
    p.add_argument(
        "--request-ms",
        type=float,
        default=100.0,
        help="how long each admitted request holds its slot (0: admissions back to back)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
        out = runner.run(main(args.concurrency, args.duration, args.request_ms / 1000))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"c={out['concurrency']} request={out['request_ms']:.0f}ms {'limiter':8} {'requests':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/req':>11}"
    )
    for name in ("local", "redis"):
        r = out[name]
        print(
            f"      {name:10} {r['requests']:9d} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['cpu_us_per_request']:11.1f}"
        )
    print(
        f"added by Redis: p50 {out['added_p50_ms']:.3f} ms, p99 {out['added_p99_ms']:.3f} ms; "
        f"{out['redis']['redis_commands_per_request']:.2f} Redis commands per request"
    )


if __name__ == "__main__":
    cli()
