"""What reading a request's body costs the sidecar's event loop, by what the body holds.

``sidecar.admission.parse_body`` runs on the loop that serves every team, before any limit is
asked. Each shape below is a body of at most 8 MiB (the default ``sidecar.max_body_bytes``),
timed in a fresh process: ms for ``parse_body`` (a refusal included) and the peak RSS it added.

- ``lists-8m``, ``objects-8m``, ``numbers-8m``: 8 MiB of ``[],``, ``{},`` or ``1,``, which
  parse to millions of objects;
- ``string-8m``: one 8 MiB string (a long prompt);
- ``at-bounds``: just inside both of the sidecar's bounds (``MAX_JSON_CONTAINERS`` empty
  lists and numbers up to ``MAX_JSON_VALUES``), the most a body let through costs.

    .venv/bin/python -m bench.body_parse
    .venv/bin/python -m bench.body_parse --root /tmp/before   # another tree's sidecar.admission
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

_MIB8 = 8 << 20
SHAPES = ("lists-8m", "objects-8m", "numbers-8m", "string-8m", "at-bounds")


def body(shape: str, containers: int, values: int) -> bytes:
    """The request body of ``shape`` (``containers``, ``values``: the bounds, for at-bounds)."""
    head, tail = b'{"model":"chat-small","prompt":[', b"]}"
    room = _MIB8 - len(head) - len(tail) - 2
    if shape == "lists-8m":
        return head + b"[]," * (room // 3) + b"[]" + tail
    if shape == "objects-8m":
        return head + b"{}," * (room // 3) + b"{}" + tail
    if shape == "numbers-8m":
        return head + b"1," * (room // 2) + b"1" + tail
    if shape == "string-8m":
        return b'{"model":"chat-small","prompt":"' + b"a" * (room - 4) + b'"}'
    lists = containers - 2  # (the body's own object and list)
    return head + b"[]," * lists + b"1," * (values - lists - 2) + b"1" + tail


def _one(shape: str) -> None:
    """In a fresh process: time one ``parse_body`` of ``shape`` and print ms and MB as JSON."""
    from sidecar import admission

    containers = getattr(admission, "MAX_JSON_CONTAINERS", 300_000)
    values = getattr(admission, "MAX_JSON_VALUES", 1_000_000)
    raw = body(shape, containers, values)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = admission.parse_body(raw)
    ms = (time.perf_counter() - start) * 1e3
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps({"ms": ms, "mb": grown, "refused": isinstance(out, admission.Refusal)}))


def main() -> None:
    """Print ms, MB and the outcome per shape, medians of ``--repeat`` fresh processes."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", help="a tree whose sidecar.admission to time instead")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.root:
        sys.path.insert(0, args.root)
    if args.one:
        _one(args.one)
        return
    print(f"{'body':>11} {'ms':>8} {'MB':>7}  outcome")
    for shape in SHAPES:
        command = [sys.executable, "-m", "bench.body_parse", "--one", shape]
        runs = [
            json.loads(
                subprocess.run(
                    command + (["--root", args.root] if args.root else []),
                    capture_output=True,
                    check=True,
                    text=True,
                ).stdout
            )
            for _ in range(args.repeat)
        ]
        ms = statistics.median(r["ms"] for r in runs)
        mb = statistics.median(r["mb"] for r in runs)
        outcome = "refused (413)" if runs[0]["refused"] else "parsed"
        print(f"{shape:>11} {ms:>8.1f} {mb:>7.1f}  {outcome}")


if __name__ == "__main__":
    main()
