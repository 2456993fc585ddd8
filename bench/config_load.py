"""What reading a fleet's configuration costs, as the number of teams grows.

Every service reads the file at start and again on each reload. For a file of ``--teams`` teams
(each with a key, limits and a budget, as ``bench.faithful_overhead --teams`` writes it), each
measured in a fresh process so that no earlier read's memory is counted:

- ``read ms``: ``load_config`` (YAML parse, overrides, validation), the median of ``--repeat``;
- ``RSS +MB``: how much larger the process is after one read (what the parse's peak leaves);
- ``held MB``: what the parsed configuration itself keeps alive (``tracemalloc``).

    .venv/bin/python -m bench.config_load
    .venv/bin/python -m bench.config_load --root /tmp/before   # another tree's infermeter.config
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def measure(path: Path, repeat: int) -> dict[str, float]:
    """In this process: the RSS one read leaves, what the result holds, the median read time."""
    from infermeter.config import load_config

    gc.collect()
    before = _rss_mb()
    load_config(path, environ={})
    gc.collect()
    grown = _rss_mb() - before
    tracemalloc.start()
    config = load_config(path, environ={})
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    del config
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        load_config(path, environ={})
        times.append((time.perf_counter() - start) * 1000)
    return {"read_ms": statistics.median(times), "rss_mb": grown, "held_mb": held}


def write(path: Path, teams: int) -> None:
    """The benchmark's configuration with ``teams`` teams."""
    from bench.faithful_overhead import with_teams
    from bench.sidecar_overhead import Engine, write_config

    write_config(path, path.parent, 9, Engine(step_base_ms=1, step_per_seq_ms=0))
    with_teams(path, teams)


def main() -> None:
    """Print the three figures for each number of teams (or, with --measure, one JSON line)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--teams", type=int, nargs="+", default=[4, 100, 1000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--root", help="a tree whose infermeter.config to time instead")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child's file
    args = parser.parse_args()
    if args.root:
        sys.path.insert(0, args.root)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.repeat)))
        return
    print(f"{'teams':>6} {'read ms':>9} {'RSS +MB':>8} {'held MB':>8}")
    with tempfile.TemporaryDirectory(prefix="config-load-") as tmp:
        for teams in args.teams:
            path = Path(tmp) / f"teams-{teams}.yaml"
            write(path, teams)
            child = [sys.executable, "-m", "bench.config_load", "--measure", str(path)]
            child += ["--repeat", str(args.repeat)] + (["--root", args.root] if args.root else [])
            out = json.loads(subprocess.run(child, check=True, capture_output=True).stdout)
            print(f"{teams:>6} {out['read_ms']:>9.1f} {out['rss_mb']:>8.1f} {out['held_mb']:>8.2f}")


if __name__ == "__main__":
    main()
