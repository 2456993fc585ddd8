"""Where a proxy's CPU goes below Python: system calls, context switches, and the share of its
CPU samples in the kernel, the interpreter and each C extension, from Linux ``perf``.

py-spy sees Python frames only; what it files under the event loop (``Runner.run``) is uvloop's
C code, the kernel's work for the system calls, and the interpreter itself. This runs one phase
of ``bench.sidecar_overhead`` (the sidecar on its own: ``--sidecar-launcher`` picks the
unchanged sidecar, the protocol floor or a variant) and attaches ``perf`` to the sidecar's
process for the length of its stack: ``perf stat`` counts its system calls
(``raw_syscalls:sys_enter``) and context switches; a second run with ``perf record``
samples it at 2 kHz with call stacks.

Per request: the tool's interval also covers the phase's warm-up, where the benchmark counts no
requests, so the requests in it are estimated as the sidecar's CPU time while the tool was
attached over the benchmark's CPU per request in its window. The counters cost the process some
CPU of their own (a tracepoint on every system call): compare these figures between proxies,
not with the benchmark's. With ``--strace``, a third run under ``strace -c`` gives the system
calls by name (strace slows every call, so more chunks wait per read: counts only). Needs ``perf`` (Debian's
``linux-perf``) and root or a permissive ``kernel.perf_event_paranoid``.

    .venv/bin/python -m bench.perf_split --strace                         # the sidecar, c16_json
    BENCH_FLOOR_WORK=1 BENCH_EVENT_LOOP=uvloop .venv/bin/python -m bench.perf_split --strace \\
        --sidecar-launcher bench/protocol_floor.py                        # the floor with the work
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_EVENTS = "raw_syscalls:sys_enter,context-switches"


def _proxy_pid(bench: subprocess.Popen[bytes], pattern: str, timeout: float = 60.0) -> int:
    """The pid of the sidecar process this benchmark run starts: a child of it whose command
    line has ``pattern`` (not another run's sidecar)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and bench.poll() is None:
        found = subprocess.run(
            ["pgrep", "-P", str(bench.pid), "-f", pattern], capture_output=True, text=True
        ).stdout
        pids = [int(p) for p in found.split()]
        if pids:
            return pids[0]
        time.sleep(0.05)
    raise SystemExit(f"no process matching {pattern!r} appeared")


class _CpuWatch:
    """Polls a process's CPU time (all its threads, /proc/PID/stat) until it exits, keeping the
    last reading: the tool's interval ends with the process, before it can be read once more."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.first = self.last = _cpu_seconds(pid) or 0.0
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while (now := _cpu_seconds(self.pid)) is not None:
            self.last = now
            time.sleep(0.05)

    def seconds(self) -> float:
        self._thread.join(timeout=5)
        return self.last - self.first


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # utime and stime, the 14th and 15th fields (the 12th and 13th after the command's ")").
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(
    tool: list[str], phase: str, launcher: str | None, settle: float
) -> tuple[dict[str, Any], Path, float]:
    """One benchmark run of ``phase`` with ``tool`` (perf or strace, writing to ``-o``)
    attached to its sidecar: the run's summary, the tool's output file, and the CPU seconds the
    sidecar spent while the tool was attached."""
    out = Path(tempfile.mkdtemp(prefix="perf-split-")) / "tool.out"
    cmd = [sys.executable, "-m", "bench.sidecar_overhead", "--phases", phase, "--json"]
    if launcher:
        cmd += ["--sidecar-launcher", launcher]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    pattern = "sidecar --config" if launcher is None else f"{Path(launcher).name} sidecar --config"
    pid = _proxy_pid(bench, pattern)
    # Past its start-up (imports, compiling), long before its window: the benchmark measures
    # the direct path and nginx first.
    time.sleep(settle)
    cpu = _CpuWatch(pid)
    watcher = subprocess.Popen(
        [*tool, "-p", str(pid), "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stdout, _ = bench.communicate()
    # The sidecar has exited with its stack; the tool ends on its own then, or on SIGINT.
    try:
        watcher.wait(timeout=5)
    except subprocess.TimeoutExpired:
        watcher.send_signal(signal.SIGINT)
        watcher.wait(timeout=30)
    if bench.returncode:
        raise SystemExit(f"the benchmark failed (exit {bench.returncode})")
    return json.loads(stdout), out, cpu.seconds()


def _syscalls(path: Path) -> dict[str, int]:
    """``strace -c`` output: system call to calls."""
    out = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        # "% time  seconds  usecs/call  calls  [errors]  syscall"
        if len(fields) in (5, 6) and fields[0][0].isdigit() and fields[-1] != "total":
            out[fields[-1]] = int(fields[3])
    return out


def _window(summary: dict[str, Any], phase: str) -> dict[str, Any]:
    return next(w for w in summary["windows"] if w["phase"] == phase and w["path"] == "sidecar")


def _counters(path: Path) -> dict[str, float]:
    """``perf stat -x,`` output: event name to value."""
    out = {}
    for line in path.read_text().splitlines():
        fields = line.split(",")
        if len(fields) > 2 and not line.startswith("#"):
            try:
                out[fields[2]] = float(fields[0])
            except ValueError:
                continue
    return out


def _shares(
    perf_bin: str, data: Path, top: int
) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Self shares of samples by shared object and by symbol, from a ``perf record`` file."""
    report = subprocess.run(
        [
            perf_bin,
            "report",
            "-i",
            str(data),
            "--no-children",
            "--sort",
            "dso,sym",
            "-g",
            "none",
            "--stdio",
            "-F",
            "overhead,dso,sym",
            "--field-separator",
            "\t",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    by_dso: dict[str, float] = collections.defaultdict(float)
    by_sym: list[tuple[str, float]] = []
    for line in report.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split("\t")]
        if len(parts) < 3 or not parts[0].endswith("%"):
            continue
        share = float(parts[0].rstrip("%"))
        by_dso[parts[1]] += share
        by_sym.append((f"{parts[2]} ({parts[1]})", share))
    by_sym.sort(key=lambda item: -item[1])
    return sorted(by_dso.items(), key=lambda item: -item[1])[:top], by_sym[:top]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the phase twice under perf (counters, then samples) and print the split."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", default="c16_json", help="a phase of bench.sidecar_overhead")
    parser.add_argument("--sidecar-launcher", help="as bench.sidecar_overhead takes it")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument(
        "--strace",
        action="store_true",
        help="a third run under strace -c: the system calls by name",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=4.0,
        help="seconds after the sidecar starts before perf attaches",
    )
    args = parser.parse_args(argv)
    perf_bin = shutil.which("perf")
    if perf_bin is None:
        raise SystemExit("perf not found (Debian: apt-get install linux-perf)")

    stat = [perf_bin, "stat", "-x,", "-e", _EVENTS]
    summary, counts_file, cpu_s = _run(stat, args.phase, args.sidecar_launcher, args.settle)
    window = _window(summary, args.phase)
    counters = _counters(counts_file)
    per_request_us = window["proxy_us_per_request"]
    requests = 1e6 * cpu_s / per_request_us if per_request_us else 0.0
    print(
        f"{args.phase}, {args.sidecar_launcher or 'the sidecar'}: {window['requests']} requests "
        f"in the window, {per_request_us} µs of CPU each (with the counters on)"
    )
    if requests:
        for event in ("raw_syscalls:sys_enter", "context-switches"):
            print(f"  {event} per request: {counters.get(event, 0.0) / requests:.1f}")

    record = [perf_bin, "record", "-F", "2000", "-g"]
    _, data, _ = _run(record, args.phase, args.sidecar_launcher, args.settle)
    by_dso, by_sym = _shares(perf_bin, data, args.top)
    print("  CPU samples by shared object:")
    for name, share in by_dso:
        print(f"    {share:5.1f}%  {name}")
    print("  by symbol:")
    for name, share in by_sym:
        print(f"    {share:5.1f}%  {name}")

    if args.strace:
        strace_bin = shutil.which("strace")
        if strace_bin is None:
            raise SystemExit("strace not found (Debian: apt-get install strace)")
        summary, calls_file, cpu_s = _run(
            [strace_bin, "-f", "-c"], args.phase, args.sidecar_launcher, args.settle
        )
        per_request_us = _window(summary, args.phase)["proxy_us_per_request"]
        requests = 1e6 * cpu_s / per_request_us if per_request_us else 0.0
        print(
            f"  system calls per request, by call (strace -c; {per_request_us} µs of CPU "
            "per request under strace):"
        )
        calls = sorted(_syscalls(calls_file).items(), key=lambda item: -item[1])
        for name, count in calls[: args.top]:
            if requests and count / requests >= 0.01:
                print(f"    {count / requests:6.2f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
