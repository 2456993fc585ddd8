"""What dropping many idle upstream connections costs the event loop, in one call.

After a burst of streams, the sidecar's pool to its replica (``sidecar.pool.Pool``) holds one
idle keep-alive connection per stream of the burst. They go stale after a few seconds, and two
things then drop them, each in one callback of the loop:

- ``stale``: the next request, which pops the idle connections newest first and closes every
  stale one before it opens a new connection;
- ``lost``: the replica closing them (``connection_lost``), newest first.

Each figure is the pool's own bookkeeping, ms for the whole drop (median of ``--repeat``): the
connections are made without sockets, so the kernel's part of a close, the same for any pool,
is left out.

    .venv/bin/python -m bench.pool_idle
    .venv/bin/python -m bench.pool_idle --root /tmp/before   # another tree's sidecar.pool
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from typing import Any


def _pool(idle: int, stale: bool) -> tuple[Any, list[Any]]:
    from sidecar.pool import Connection, Pool

    pool = Pool("127.0.0.1", 9, 1.0, 1.0)
    conns = [Connection(pool) for _ in range(idle)]
    for conn in conns:
        pool._all.add(conn)
        pool.release(conn)
        if stale:
            conn.idle_since -= 60.0
    return pool, conns


def stale(idle: int) -> float:
    """ms for the next request to drop ``idle`` stale connections (its own connect refused)."""
    from sidecar.pool import UpstreamError

    pool, _ = _pool(idle, stale=True)

    async def next_request() -> float:
        start = time.perf_counter()
        with contextlib.suppress(UpstreamError):
            await pool.connection()
        return (time.perf_counter() - start) * 1e3

    return asyncio.run(next_request())


def lost(idle: int) -> float:
    """ms for ``idle`` idle connections to leave the pool as the replica closes them."""
    pool, conns = _pool(idle, stale=False)
    start = time.perf_counter()
    for conn in reversed(conns):
        pool.forget(conn)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    """Print both figures for each number of idle connections."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--idle", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--root", help="a tree whose sidecar.pool to time instead")
    args = parser.parse_args()
    if args.root:
        sys.path.insert(0, args.root)
    print(f"{'idle':>6} {'stale ms':>9} {'lost ms':>8}")
    for idle in args.idle:
        dropped = statistics.median(stale(idle) for _ in range(args.repeat))
        gone = statistics.median(lost(idle) for _ in range(args.repeat))
        print(f"{idle:>6} {dropped:>9.2f} {gone:>8.2f}")


if __name__ == "__main__":
    main()
