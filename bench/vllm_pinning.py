"""How late other processes run while real vLLM (CPU build) generates, pinned and unpinned.

The test suite runs real vLLM beside its own processes (the sidecar under test among them).
vLLM's default CPU binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) pins its worker to one core and
leaves the others to "other processes"; on a 2-core machine the busy pinned worker kept every
other process off the CPU for seconds, so the tests start vLLM with ``nobind``
(``tests/conformance/real_vllm.py``). This measures that: for each binding, vLLM is started,
warmed with one answer, then asked for 480-token answers back to back for ``--seconds`` while a
separate process sleeps 10 ms at a time and notes how late each wake-up comes. Printed per
binding: the answers finished, and the wake-ups' lateness (median, 99th percentile, maximum).

    .venv/bin/python -m bench.vllm_pinning
    .venv/bin/python -m bench.vllm_pinning --binds auto,nobind --seconds 10
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.conformance.real_vllm import ensure_vllm_ready, free_port, start_real_vllm

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hello world 123"}],
    "max_tokens": 480,
    "ignore_eos": True,
}
# A process that sleeps 10 ms at a time for argv[1] seconds and prints how late each wake-up was.
_SLEEPER = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    started = time.perf_counter()
    time.sleep(0.01)
    print(time.perf_counter() - started - 0.01)
"""


def measure(bind: str, seconds: float) -> tuple[int, list[float]]:
    """Answers finished and the sleeper's lateness (seconds) while vLLM generates with ``bind``."""
    venv, model = ensure_vllm_ready(ROOT)
    with (
        tempfile.TemporaryDirectory() as scratch,
        start_real_vllm(
            venv, model, free_port(), Path(scratch), env={"VLLM_CPU_OMP_THREADS_BIND": bind}
        ) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        client.post("/v1/chat/completions", json=BODY).raise_for_status()
        sleeper = subprocess.Popen(
            [sys.executable, "-c", _SLEEPER, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        answers, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            client.post("/v1/chat/completions", json=BODY).raise_for_status()
            answers += 1
        out, _ = sleeper.communicate()
    return answers, [float(line) for line in out.split()]


def main() -> None:
    """Print, per binding, the answers and the lateness of a sleeping process beside vLLM."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--binds", default="auto,nobind", help="VLLM_CPU_OMP_THREADS_BIND values")
    parser.add_argument("--seconds", type=float, default=10.0, help="generation time per binding")
    args = parser.parse_args()
    for bind in args.binds.split(","):
        answers, late = measure(bind, args.seconds)
        late_ms = sorted(x * 1000 for x in late)
        p99 = late_ms[min(len(late_ms) - 1, int(len(late_ms) * 0.99))]
        print(
            f"{bind:>7}: {answers} answers of 480 tokens in {args.seconds:g} s; a sleeper's "
            f"wake-ups late by median {statistics.median(late_ms):.1f} ms, p99 {p99:.0f} ms, "
            f"max {late_ms[-1]:.0f} ms ({len(late_ms)} wake-ups)"
        )


if __name__ == "__main__":
    main()
