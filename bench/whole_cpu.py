"""What assembling non-streamed answers from vLLM's stream costs the sidecar, per request.

One simulated replica (fast engine) and one ``infermeter sidecar`` process in front of it, on
loopback, started twice: with ``sidecar.non_streamed_via_stream`` on (the default: vLLM is asked
for a stream with continuous usage and the sidecar builds the whole answer) and off (the
request is relayed to vLLM as sent). Each run sends ``--requests`` non-streamed chat
completions of ``--max-tokens`` tokens, ``--concurrency`` at a time, and reads the sidecar
process's CPU time around them (``/proc/PID/task/*/schedstat``).

    .venv/bin/python -m bench.whole_cpu                           # about 30 seconds
    .venv/bin/python -m bench.whole_cpu --max-tokens 16 256 --requests 400
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from bench.sidecar_overhead import (
    API_KEY,
    FAST,
    HOST,
    REPLICA,
    SIDECAR_MODEL,
    Service,
    _env,
    cpu_seconds,
    write_config,
)
from infermeter.serving import free_port

__all__ = ["main"]


@contextlib.contextmanager
def _stack(tmp: Path, via_stream: bool) -> Iterator[tuple[Service, int]]:
    """A replica and a sidecar, the sidecar with ``non_streamed_via_stream`` as given."""
    base = tmp / ("stream" if via_stream else "relay")
    base.mkdir()
    cfg = base / "infermeter.yaml"
    replica_port, sidecar_port = free_port(HOST), free_port(HOST)
    write_config(cfg, base, replica_port, FAST)
    env = _env() | {"INFERMETER__SIDECAR__NON_STREAMED_VIA_STREAM": str(via_stream).lower()}
    py = [sys.executable, "-m", "launcher"]
    replica = Service(
        "replica",
        [*py, "simulate", "--config", str(cfg), "--replica", REPLICA],
        base / "replica.log",
        env,
    )
    try:
        sidecar = Service(
            "sidecar",
            [
                *py,
                "sidecar",
                "--config",
                str(cfg),
                "--replica",
                REPLICA,
                "--listen",
                f"{HOST}:{sidecar_port}",
            ],
            base / "sidecar.log",
            env,
        )
        try:
            replica.wait_ready(replica_port, "/health")
            sidecar.wait_ready(sidecar_port, "/healthz")
            yield sidecar, sidecar_port
        finally:
            sidecar.stop()
    finally:
        replica.stop()


async def _load(port: int, requests: int, concurrency: int, max_tokens: int) -> None:
    body = {
        "model": SIDECAR_MODEL,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Count to a large number, please."}],
    }
    queue = iter(range(requests))
    async with httpx.AsyncClient(
        base_url=f"http://{HOST}:{port}",
        timeout=120,
        headers={"authorization": f"Bearer {API_KEY}"},
    ) as c:

        async def worker() -> None:
            for _ in queue:
                r = await c.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise SystemExit(f"request failed: {r.status_code} {r.text[:200]}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def measure(via_stream: bool, tokens: Sequence[int], requests: int, concurrency: int) -> list[str]:
    """One table row per token count: sidecar CPU microseconds per request."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, _stack(Path(tmp), via_stream) as (sidecar, port):
        asyncio.run(_load(port, 20, concurrency, 8))  # warm up
        for n in tokens:
            before, t0 = cpu_seconds(sidecar.pids()), time.perf_counter()
            asyncio.run(_load(port, requests, concurrency, n))
            cpu, wall = cpu_seconds(sidecar.pids()) - before, time.perf_counter() - t0
            mode = "stream+assemble" if via_stream else "relay whole"
            rows.append(
                f"{mode:16} {n:>7} {requests:>9} {cpu / requests * 1e6:>13.0f} "
                f"{cpu / requests / n * 1e6:>11.1f} {wall:>7.1f}"
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run both modes and print CPU per request and per token."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    print(f"cpu: {os.cpu_count()} cores; concurrency {args.concurrency}")
    print(
        f"{'mode':16} {'tokens':>7} {'requests':>9} {'us CPU/req':>13} {'us/token':>11} {'wall s':>7}"
    )
    for via_stream in (False, True):
        for row in measure(via_stream, args.max_tokens, args.requests, args.concurrency):
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
