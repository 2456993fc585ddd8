"""What signing in with a configured team key costs a request, as the number of keys grows.

Every proxied request names its team by its key (``infermeter.auth.KeyRing``): the key is
hashed with SHA-256 and its digest looked up among the configured ones. Two figures per number
of configured keys, µs per lookup:

- ``known``: a configured key, each in turn;
- ``unknown``: a key that is configured nowhere (refused).

    .venv/bin/python -m bench.key_lookup
    .venv/bin/python -m bench.key_lookup --root /tmp/before   # another tree's infermeter.auth

The median of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from typing import Any


def _ring(keys: int) -> tuple[Any, list[str]]:
    from infermeter.auth import KeyRing

    names = [f"sk-team-{i:05d}-{'x' * 24}" for i in range(keys)]
    teams = [(f"team-{i}", [hashlib.sha256(k.encode()).hexdigest()]) for i, k in enumerate(names)]
    return KeyRing(teams), names


def known(keys: int, n: int) -> float:
    """µs per lookup of a configured key."""
    ring, names = _ring(keys)
    start = time.perf_counter()
    for i in range(n):
        ring.caller_for(names[i % keys], 0.0)
    return (time.perf_counter() - start) / n * 1e6


def unknown(keys: int, n: int) -> float:
    """µs per lookup of a key that no team holds (refused)."""
    from infermeter.auth import AuthError

    ring, _ = _ring(keys)
    start = time.perf_counter()
    for i in range(n):
        try:  # noqa: SIM105 (contextlib.suppress would add its own cost to each lookup timed)
            ring.caller_for(f"sk-nobody-{i:05d}-{'y' * 24}", 0.0)
        except AuthError:
            pass
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    """Print the two figures for each number of configured keys."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[4, 100, 1000, 10000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--root", help="a tree whose infermeter.auth to time instead")
    args = parser.parse_args()
    if args.root:
        sys.path.insert(0, args.root)
    print(f"{'keys':>6} {'known µs':>10} {'unknown µs':>11}")
    for keys in args.keys:
        n = 20_000 if keys <= 1000 else 2_000
        found = [known(keys, n) for _ in range(args.repeat)]
        refused = [unknown(keys, n) for _ in range(args.repeat)]
        print(f"{keys:>6} {statistics.median(found):>10.2f} {statistics.median(refused):>11.2f}")


if __name__ == "__main__":
    main()
