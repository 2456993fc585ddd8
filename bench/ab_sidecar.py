"""This revision's sidecar against another revision's, in alternating runs: paired figures.

On a shared machine, two runs of ``bench.sidecar_overhead`` of the same code differ by more than
a few-percent change (nginx's own CPU per paced chunk moved from 16.8 to 20.4 µs within an hour
here). This runs the benchmark ``--pairs`` times for each sidecar, in turns (the order
alternating, so that a drift in one direction hits both alike), with the other revision's
sidecar started from a ``git worktree`` of it (``--root``). Each CPU figure is taken as a ratio
to nginx's in the same run, and each pair gives one ratio of the two sidecars; the report is the
median of each side and of the pairs, and in how many pairs this revision came out lower.

    git worktree add /tmp/base d337e09
    .venv/bin/python -m bench.ab_sidecar --root /tmp/base --pairs 4   # about 10 minutes

Only the benchmark's sidecar changes between the runs: the replica and nginx come from this
tree, and both sidecars read the same generated configuration.

The other sidecar can instead be this tree's run through a launcher with its own environment,
such as a variant of ``bench/sidecar_variant.py`` (what one part costs, in paired runs):

    .venv/bin/python -m bench.ab_sidecar --phases c16_json --pairs 6 \
        --other-launcher bench/sidecar_variant.py --other-env SIDECAR_VARIANT=norecord
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# (label, key in the benchmark's per-path summary, compared to nginx's figure in the same run)
FIGURES = (
    ("CPU per 64-token request, x nginx", "cpu_us_per_64tok_request", True),
    ("CPU per 1-token request, x nginx", "cpu_us_per_1tok_request", True),
    ("CPU per non-streamed request, x nginx", "cpu_us_per_json_request", True),
    ("CPU per paced chunk, x nginx", "paced_cpu_us_per_chunk", True),
    ("RSS MB idle", "idle_rss_mb", False),
    ("RSS MB at 1000 streams", "rss_1000_streams_mb", False),
)
PHASES = "c64_1tok,c16_json,c64_64tok,paced_500,rss_1000"

_LAUNCHER = """import os, sys
sys.path.insert(0, {root!r})
if os.path.isdir(os.path.join({root!r}, "launcher")):
    from launcher.cli import main
else:  # a revision from before the launcher package
    from infermeter.cli import main
import sidecar
assert sidecar.__file__.startswith({root!r}), sidecar.__file__
raise SystemExit(main(sys.argv[1:]))
"""


def one_run(
    launcher: Path | None, phases: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """One quick benchmark run's per-path summary (sidecar and nginx); ``env`` is added to the
    benchmark's environment (its processes inherit it)."""
    cmd = [sys.executable, "-m", "bench.sidecar_overhead", "--quick", "--json", "--phases", phases]
    if launcher is not None:
        cmd += ["--sidecar-launcher", str(launcher)]
    full_env = {**os.environ, **env} if env else None
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=full_env)
    if out.returncode != 0:
        raise SystemExit(f"benchmark run failed ({out.returncode}):\n{out.stderr[-2000:]}")
    paths: dict[str, Any] = json.loads(out.stdout)["paths"]
    return paths


def figure(paths: dict[str, Any], key: str, to_nginx: bool) -> float | None:
    """The sidecar's figure, as a ratio to nginx's in the same run when ``to_nginx``."""
    mine = paths["sidecar"].get(key)
    if mine is None:
        return None
    if not to_nginx:
        return float(mine)
    theirs = paths["nginx"].get(key)
    return float(mine) / float(theirs) if theirs else None


def report(this: list[dict[str, Any]], other: list[dict[str, Any]], name: str) -> list[str]:
    """One line per figure: both medians, the median paired ratio, the pairs this one won."""
    lines = [f"{'':40} {'this':>8} {name:>8} {'this/it':>8}  lower in"]
    runs: list[str] = []
    for label, key, to_nginx in FIGURES:
        pairs = [
            (a, b)
            for a, b in (
                (figure(x, key, to_nginx), figure(y, key, to_nginx))
                for x, y in zip(this, other, strict=True)
            )
            if a is not None and b is not None
        ]
        if not pairs:
            continue
        ratios = [a / b for a, b in pairs if b]
        won = sum(1 for a, b in pairs if a < b)
        lines.append(
            f"{label:40} {statistics.median(a for a, _ in pairs):8.2f} "
            f"{statistics.median(b for _, b in pairs):8.2f} {statistics.median(ratios):8.3f}  "
            f"{won} of {len(pairs)}"
        )
        runs.append(
            f"  {label}: this {', '.join(f'{a:.2f}' for a, _ in pairs)}; "
            f"{name} {', '.join(f'{b:.2f}' for _, b in pairs)}"
        )
    return [*lines, "each run, pair by pair:", *runs]


def main() -> int:
    """Run the pairs and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--root", help="a worktree of the other revision")
    which.add_argument(
        "--other-launcher",
        type=Path,
        help="this tree's sidecar run through this launcher (bench.sidecar_overhead's "
        "--sidecar-launcher), as the other",
    )
    parser.add_argument(
        "--other-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set in the other's runs only (repeatable)",
    )
    parser.add_argument("--pairs", type=int, default=4, help="runs of each sidecar (4)")
    parser.add_argument("--phases", default=PHASES, help=f"benchmark phases ({PHASES})")
    args = parser.parse_args()
    bad = [item for item in args.other_env if "=" not in item]
    if bad:
        parser.error(f"--other-env: expected KEY=VALUE, got {bad[0]!r}")
    other_env = dict(item.split("=", 1) for item in args.other_env)
    this: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.root is not None:
            root = str(Path(args.root).resolve())
            launcher = Path(tmp) / "other_sidecar.py"
            launcher.write_text(_LAUNCHER.format(root=root))
            name = Path(root).name
        else:
            launcher = args.other_launcher.resolve()
            name = "other"
        for i in range(args.pairs):
            order = ((this, None, None), (other, launcher, other_env))
            for runs, script, env in order if i % 2 == 0 else reversed(order):
                runs.append(one_run(script, args.phases, env))
                print(f"pair {i + 1}: {'other' if script else 'this'} done", flush=True)
    print("\n".join(report(this, other, name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
