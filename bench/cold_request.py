"""CPU of the sidecar per request one at a time (c=1), where each request runs cold.

At c=1 the client and the replica have the core between two requests (and between two chunks),
so each request finds the caches holding their memory, not the sidecar's: the same Python costs
several times what it does on a busy sidecar (``bench.cold_steps``). This runs streamed chat
completions of each ``--tokens`` count, one at a time, through a sidecar (or, with
``--paths nginx,sidecar``, nginx too) in front of the simulated fast replica, in ``--windows``
windows of ``--requests`` requests each, and prints the CPU per request of each window and
their median. From two token counts: the CPU per request the chunks add (the slope) and what a
request costs besides (the intercept).

    .venv/bin/python -m bench.cold_request                                  # 2 tokens, 5 x 300
    .venv/bin/python -m bench.cold_request --tokens 2,16,64 --paths nginx,sidecar
    .venv/bin/python -m bench.cold_request --sidecar-launcher LAUNCHER      # another tree
    BENCH_FLOOR_WORK=1 BENCH_EVENT_LOOP=uvloop .venv/bin/python -m bench.cold_request \\
        --tokens 2,64 --sidecar-launcher bench/protocol_floor.py            # the floor

Read medians of runs made in turns: single windows move by a tenth with the machine.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import sidecar_overhead as so

__all__ = ["main"]


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def run(
    tokens: Sequence[int],
    paths: Sequence[str],
    windows: int,
    requests: int,
    launcher: Path | None,
) -> dict[tuple[str, int], list[float]]:
    """CPU µs per request of each window, per (path, token count)."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    client = so.Client()
    found: dict[tuple[str, int], list[float]] = {}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="cold-request-") as tmp,
            so.stack(Path(tmp), so.FAST, nginx, "cold", launcher) as st,
        ):
            for _ in range(windows):
                for count in tokens:
                    for path in paths:
                        port = st.ports[path]
                        if path == "sidecar":
                            request = so.request_bytes(port, so.SIDECAR_MODEL, count, so.API_KEY)
                        else:
                            request = so.request_bytes(port, st.served_model, count, None)
                        spec = so.LoadSpec(
                            port,
                            request,
                            concurrency=1,
                            warmup_s=0.5,
                            duration_s=60.0,
                            max_requests=requests,
                        )
                        window = so.measure(client, st, path, f"c1_{count}tok", spec, count)
                        if window.us_per_request is None or window.errors:
                            raise SystemExit(f"{path}, {count} tokens: {window.errors} errors")
                        found.setdefault((path, count), []).append(window.us_per_request)
    finally:
        client.proc.terminate()
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print one line per path and token count, then the slopes."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=_ints, default=[2], help="token counts (2)")
    parser.add_argument("--paths", default="sidecar", help="of nginx,sidecar (sidecar)")
    parser.add_argument("--windows", type=int, default=5, help="windows per count (5)")
    parser.add_argument("--requests", type=int, default=300, help="requests per window (300)")
    parser.add_argument(
        "--sidecar-launcher",
        type=Path,
        help="run `python SCRIPT sidecar ARGS` instead of `python -m launcher sidecar ARGS`",
    )
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    found = run(args.tokens, paths, args.windows, args.requests, args.sidecar_launcher)
    who = str(args.sidecar_launcher or "the sidecar")
    for (path, count), values in sorted(found.items()):
        shown = ", ".join(f"{v:.0f}" for v in values)
        median = statistics.median(values)
        name = who if path == "sidecar" else path
        print(f"{name}, {count} tokens: µs per request {shown}; median {median:.0f}")
    if len(args.tokens) > 1:
        low, high = min(args.tokens), max(args.tokens)
        for path in paths:
            a = statistics.median(found[(path, low)])
            b = statistics.median(found[(path, high)])
            slope = (b - a) / (high - low)
            name = who if path == "sidecar" else path
            print(f"{name}: {slope:.1f} µs per chunk, {a - slope * low:.0f} µs per request besides")
    return 0


if __name__ == "__main__":
    sys.exit(main())
