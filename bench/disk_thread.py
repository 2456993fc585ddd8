"""What handing a blocking disk call to another thread costs the sidecar's process, per call.

Runs, on uvloop (the sidecar's loop), the same call ``--calls`` times one after another through
``asyncio.to_thread`` (the loop's default executor) and through ``infermeter.disk_thread``'s
``DiskThread``, and prints process CPU time and wall time per call. Two calls are measured: one
that does nothing (the hand-off alone) and one 600-byte ``write`` plus ``fsync`` in a temporary
file (a spool's group commit of one usage record); then the same write and fsync inline, for
the disk's own share.

    .venv/bin/python -m bench.disk_thread
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable

import uvloop

from infermeter.disk_thread import DiskThread

_RECORD = b"x" * 599 + b"\n"


async def _per_call(calls: int, hand_off: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await hand_off()
    return (time.process_time() - cpu) / calls * 1e6, (time.perf_counter() - wall) / calls * 1e6


async def measure(calls: int) -> list[tuple[str, str, float, float]]:
    """Rows of (call, hand-off, µs CPU per call, µs wall per call)."""
    with tempfile.TemporaryDirectory() as tmp:
        fd = os.open(os.path.join(tmp, "spool.bin"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)

        def nothing() -> None:
            pass

        def commit() -> None:
            os.write(fd, _RECORD)
            os.fsync(fd)

        disk = DiskThread("bench-disk")
        rows = []
        for name, call in (("nothing", nothing), ("write+fsync", commit)):

            async def executor(call: Callable[[], None] = call) -> None:
                await asyncio.to_thread(call)

            async def dedicated(call: Callable[[], None] = call) -> None:
                await disk.run(call)

            for how, hand_off in (("asyncio.to_thread", executor), ("DiskThread", dedicated)):
                await _per_call(min(calls, 200), hand_off)  # warm-up: threads started
                rows.append((name, how, *await _per_call(calls, hand_off)))
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(calls):
            commit()
        rows.append(
            (
                "write+fsync",
                "inline (blocks the loop)",
                (time.process_time() - cpu) / calls * 1e6,
                (time.perf_counter() - wall) / calls * 1e6,
            )
        )
        disk.stop()
        os.close(fd)
    return rows


def main() -> int:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per row (default 2000)")
    args = parser.parse_args()
    print(
        f"{'call':12} {'hand-off':26} {'CPU µs/call':>12} {'wall µs/call':>13}  (load {os.getloadavg()[0]:.2f})"
    )
    for name, how, cpu, wall in uvloop.run(measure(args.calls)):
        print(f"{name:12} {how:26} {cpu:12.1f} {wall:13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
