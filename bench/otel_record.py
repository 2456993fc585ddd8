"""What keeping one request's GenAI metrics costs the sidecar, in process: the plain histograms
of ``sidecar.otel_metrics`` against the OpenTelemetry SDK's own ``Histogram.record``.

Per request the sidecar observes five figures (duration, TTFT, time per output token, input and
output tokens); this times those five, both ways, with the attributes the sidecar sends, and
the building of one export's points from 64 series (what an export costs the event loop).

    .venv/bin/python -m bench.otel_record            # about 10 s
"""

from __future__ import annotations

import asyncio
import time

from infermeter.otlp import GEN_AI_LATEST
from sidecar.otel_metrics import (
    DURATION_BOUNDS,
    TOKEN_BOUNDS,
    TPOT_BOUNDS,
    TTFT_BOUNDS,
    GenAiMetrics,
)
from sidecar.stream import UsageCounts

__all__ = ["main"]

N = 50_000


def _ours(latest: bool) -> float:
    genai = GenAiMetrics(
        "http://127.0.0.1:8000", frozenset({GEN_AI_LATEST}) if latest else frozenset()
    )
    usage = UsageCounts(120, 64, 0)
    key = ("chat", "search", "chat-small", "llama-3.1-8b-instruct")
    start = time.perf_counter()
    for _ in range(N):
        genai.observe(key, None, 1.2, 0.05, 0.018, usage)
    return (time.perf_counter() - start) / N * 1e6


def _sdk() -> float:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    meter = MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("bench")
    hists = [
        meter.create_histogram(name, unit="s", explicit_bucket_boundaries_advisory=bounds)
        for name, bounds in (
            ("d", DURATION_BOUNDS),
            ("t", TTFT_BOUNDS),
            ("p", TPOT_BOUNDS),
            ("u", TOKEN_BOUNDS),
        )
    ]
    base: dict[str, str | int] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "chat-small",
        "gen_ai.response.model": "llama-3.1-8b-instruct",
        "server.address": "127.0.0.1",
        "server.port": 8000,
        "infermeter.team": "search",
    }
    inp: dict[str, str | int] = {**base, "gen_ai.token.type": "input"}
    out: dict[str, str | int] = {**base, "gen_ai.token.type": "output"}
    d, t, p, u = hists
    start = time.perf_counter()
    for _ in range(N // 10):
        d.record(1.2, base)
        t.record(0.05, base)
        p.record(0.018, base)
        u.record(120, inp)
        u.record(64, out)
    return (time.perf_counter() - start) / (N // 10) * 1e6


def _export_build() -> float:
    genai = GenAiMetrics("http://127.0.0.1:8000")
    usage = UsageCounts(120, 64, 0)
    for team in range(16):
        for model in range(4):
            genai.observe(
                ("chat", f"team-{team}", f"model-{model}", ""), None, 1.2, 0.05, 0.018, usage
            )

    async def build() -> float:
        start = time.perf_counter()
        for _ in range(200):
            await genai.produce(0, 1)
        return (time.perf_counter() - start) / 200 * 1e6

    return asyncio.run(build())


def main() -> None:
    """Print µs per request both ways, and µs per export build."""
    for _ in range(2):  # the first round warms caches and imports
        ours, latest, sdk = _ours(False), _ours(True), _sdk()
    print(
        f"sidecar.otel_metrics, 5 figures per request: {ours:.2f} µs (latest conventions {latest:.2f} µs)"
    )
    print(f"OpenTelemetry SDK Histogram.record x5:       {sdk:.2f} µs")
    print(
        f"one export's points from 64 series:          {_export_build():.0f} µs (on a worker thread)"
    )


if __name__ == "__main__":
    main()
