"""A cProfile of the sidecar summed by module: Python calls and own time per request.

Reads the stats ``SIDECAR_VARIANT=cprofile`` writes (``bench/sidecar_variant.py``) and prints,
for each module of Python code, how many of its functions run per request (a coroutine's
resumptions count as calls, as cProfile counts them) and their own time, builtins called from
it not included. cProfile charges each call a fixed cost, so modules made of many small calls
read dearer than they are: use it as a map of where the interpreter spends its steps, not as a
measure of µs.

    SIDECAR_VARIANT=cprofile SIDECAR_PROFILE=/tmp/c16.prof .venv/bin/python -m \\
        bench.sidecar_overhead --quick --phases c16_json --sidecar-launcher bench/sidecar_variant.py
    .venv/bin/python -m bench.profile_modules /tmp/c16.prof

Requests are counted as the calls of ``infermeter.ids.request_id`` (one per generation request
started while profiling; at c=16 the window's first and last requests are partly outside it).
"""

from __future__ import annotations

import argparse
import collections
import pstats
from collections.abc import Sequence

_SKIP = ("bench/",)


def _module(filename: str) -> str:
    """``/any/where/site-packages/pkg/mod.py`` -> ``pkg/mod.py``; the project's files likewise."""
    for marker in ("site-packages/", "/lib/python3."):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail.split("/", 1)[1] if marker.startswith("/lib") else tail
    parts = filename.split("/")
    return "/".join(parts[-2:])


def by_module(stats: pstats.Stats, requests: int) -> list[tuple[str, float, float]]:
    """(module, Python calls per request, own µs per request), dearest first."""
    calls: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    table = stats.stats  # type: ignore[attr-defined]
    for (filename, _, _), (_, ncalls, tottime, _, _) in table.items():
        if filename.startswith("~"):  # builtins: counted in their caller's time by cumtime only
            continue
        module = _module(filename)
        if module.startswith(_SKIP):
            continue
        calls[module] += ncalls
        own[module] += tottime
    rows = [(m, calls[m] / requests, 1e6 * own[m] / requests) for m in own]
    return sorted(rows, key=lambda row: -row[2])


def requests_in(stats: pstats.Stats) -> int:
    """How many generation requests started while profiling (calls of ``request_id``)."""
    table = stats.stats  # type: ignore[attr-defined]
    return sum(
        ncalls
        for (filename, _, name), (_, ncalls, _, _, _) in table.items()
        if name == "request_id" and filename.endswith("infermeter/ids.py")
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stats", help="a pstats file")
    parser.add_argument(
        "--requests",
        type=int,
        help="requests the profile covers (default: the calls of request_id)",
    )
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    stats = pstats.Stats(args.stats)
    requests = args.requests or requests_in(stats)
    if not requests:
        raise SystemExit(f"{args.stats}: no request in the profile (give --requests)")
    print(f"{requests} requests")
    rows = by_module(stats, requests)
    total_calls = sum(c for _, c, _ in rows)
    total_us = sum(u for _, _, u in rows)
    print(f"{'module':48} {'calls/req':>9} {'own µs/req':>10}")
    for module, per_request, us in rows[: args.top]:
        print(f"{module:48} {per_request:9.1f} {us:10.1f}")
    print(f"{'all Python code':48} {total_calls:9.1f} {total_us:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
