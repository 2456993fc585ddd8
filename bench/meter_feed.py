"""CPU per chunk of ``StreamMeter.feed``, the sidecar's per-token work, now or against a revision.

Feeds one typical vLLM chunk (one event, per-chunk usage that the client did not ask for, so it
is cut out) to a meter ``--chunks`` times, and reports the best and the median of ``--rounds``
rounds in µs per chunk. With ``--against REV``, ``sidecar/stream.py`` of that git revision is
loaded beside the current one and both are measured in turns in the same process, so that a
change of a few hundred nanoseconds can be told from this machine's noise.

    .venv/bin/python -m bench.meter_feed
    .venv/bin/python -m bench.meter_feed --against HEAD~1
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.chunks import CHUNK, ROLE
from sidecar import stream


def per_chunk(module: ModuleType, chunks: int) -> float:
    """µs per ``feed`` of ``CHUNK`` on a fresh meter of ``module`` (after its role chunk)."""
    meter: Any = module.StreamMeter(False, False, 0.0)
    meter.feed(ROLE, 0.001)
    feed, now = meter.feed, 0.002
    start = time.perf_counter()
    for _ in range(chunks):
        feed(CHUNK, now)
        now += 0.0001
    return (time.perf_counter() - start) / chunks * 1e6


def load_revision(rev: str, directory: Path) -> ModuleType:
    """``sidecar/stream.py`` as it was at ``rev``, imported under another name."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "-C", str(root), "show", f"{rev}:sidecar/stream.py"],
        capture_output=True,
        check=True,
    ).stdout
    path = directory / "stream_at_revision.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("stream_at_revision", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="also measure sidecar/stream.py at REV")
    parser.add_argument("--chunks", type=int, default=50_000, help="feeds per round (50,000)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds per version (15)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"current": stream}
        if args.against:
            versions[args.against] = load_revision(args.against, Path(tmp))
        results: dict[str, list[float]] = {name: [] for name in versions}
        for _ in range(args.rounds):
            for name, module in versions.items():
                results[name].append(per_chunk(module, args.chunks))
    for name, values in results.items():
        print(
            f"{name:>10}: best {min(values):.2f} µs, median {statistics.median(values):.2f} µs "
            f"per chunk ({args.rounds} rounds of {args.chunks})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
