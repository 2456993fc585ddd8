"""What fair sharing costs the event loop per request, as the number of teams grows.

``sidecar.fairness.FairShare`` decides every admission and every freed slot on the loop that
relays every stream. Two figures per number of teams:

- ``acquire+release``: a request admitted at once and its slot given back, on a replica with
  room, after every team has had requests here (the usual case);
- ``freed slot``: a slot given back on a full replica with two requests of every team waiting,
  so that the slot goes to one of them (the busy case, when fairness matters).

    .venv/bin/python -m bench.fair_share
    .venv/bin/python -m bench.fair_share --root /tmp/before   # another tree's sidecar.fairness

µs per operation, the median of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any


def _fair_share() -> Any:
    from sidecar.fairness import FairShare

    return FairShare


async def admit_release(teams: int, n: int) -> float:
    """µs per request admitted at once and released, every team seen before."""
    fair = _fair_share()(2048, 0.125, 64, 30.0)
    names = [f"team-{i}" for i in range(teams)]
    for i, name in enumerate(names):
        slot = await fair.acquire(name)
        if i % 2:
            slot.release()  # half the teams keep one in flight
    start = time.perf_counter()
    for i in range(n):
        slot = await fair.acquire(names[i % teams])
        slot.release()
    return (time.perf_counter() - start) / n * 1e6


async def freed_slot(teams: int, n: int) -> float:
    """µs per slot freed on a full replica while every team has two requests waiting."""
    capacity = 64
    # (No headroom, so that one team may fill the replica before the others come.)
    fair = _fair_share()(capacity, 0.0, 64, 300.0)
    held = [await fair.acquire("filler") for _ in range(capacity)]
    names = [f"team-{i}" for i in range(teams)]
    waiters = [asyncio.ensure_future(fair.acquire(name)) for _ in range(2) for name in names]
    await asyncio.sleep(0)
    assert fair.waiting() == 2 * teams
    n = min(n, len(held))
    start = time.perf_counter()
    for slot in held[:n]:
        slot.release()
    took = (time.perf_counter() - start) / n * 1e6
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    return took


def main() -> None:
    """Print the two figures for each number of teams."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--teams", type=int, nargs="+", default=[4, 50, 200, 500])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--root", help="a tree whose sidecar.fairness to time instead")
    args = parser.parse_args()
    if args.root:
        sys.path.insert(0, args.root)
    print(f"{'teams':>6} {'acquire+release µs':>20} {'freed slot µs':>15}")
    for teams in args.teams:
        quick = [asyncio.run(admit_release(teams, 20_000)) for _ in range(args.repeat)]
        busy = [asyncio.run(freed_slot(teams, 64)) for _ in range(args.repeat)]
        print(f"{teams:>6} {statistics.median(quick):>20.2f} {statistics.median(busy):>15.1f}")


if __name__ == "__main__":
    main()
