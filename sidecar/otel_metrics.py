"""The sidecar's GenAI semantic-convention metrics, kept for export over OTLP.

The figures are the ones accounting already has when a request ends (``sidecar.accounting``),
for the same requests as the Prometheus histograms and counters of ``sidecar.metrics``, so the
two agree: per team and model the same counts and sums. Each observation is a dictionary look-up
and a bucket increment (under a microsecond); the points are built only when an export is due
(``infermeter.otlp_export``). No chunk ever reaches this module.

What is emitted follows OTEL_SEMCONV_STABILITY_OPT_IN as the GenAI conventions' transition plan
asks (``docs/sidecar.md``, OpenTelemetry):

- by default, the GenAI conventions of semantic conventions v1.41.0, the last release that
  carried them (the sidecar's spans follow the same version): ``gen_ai.server.request.duration``,
  ``gen_ai.server.time_to_first_token``, ``gen_ai.server.time_per_output_token`` (histograms,
  ``s``) and ``gen_ai.client.token.usage`` (histogram, ``{token}``, ``gen_ai.token.type``
  ``input`` or ``output``), with the conventions' bucket boundaries;
- with ``gen_ai_latest_experimental``, the conventions as the semantic-conventions-genai
  repository develops them: the three server histograms are unchanged there, and token usage is
  counted by ``gen_ai.client.inference.usage.input_tokens``, ``.output_tokens`` and
  ``.cache_read.input_tokens`` (counters, ``gen_ai.token.modality`` ``unknown``: vLLM does not
  split usage by modality) instead of the histogram.

Every point carries ``gen_ai.operation.name``, ``gen_ai.provider.name`` (``vllm``),
``gen_ai.request.model``, ``gen_ai.response.model`` (once routed), ``server.address`` and
``server.port`` (the replica the sidecar fronts) and ``infermeter.team``; the request duration
also ``error.type`` (the record status) for a request that did not end well. Team and model take
configured names only (``sidecar.bounds``), so no request can add a series.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from infermeter.otlp import GEN_AI_LATEST
from sidecar import tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import Metric

    from infermeter.otlp_export import Attributes
    from infermeter.records import UsageRecord
    from sidecar.stream import UsageCounts

__all__ = [
    "DURATION_BOUNDS",
    "SCHEMA_URL",
    "TOKEN_BOUNDS",
    "TPOT_BOUNDS",
    "TTFT_BOUNDS",
    "GenAiMetrics",
]

# The bucket boundaries the conventions recommend, metric by metric.
DURATION_BOUNDS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
TTFT_BOUNDS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
TPOT_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BOUNDS = (
    1.0,
    4.0,
    16.0,
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262144.0,
    1048576.0,
    4194304.0,
    16777216.0,
    67108864.0,
)
# The published version of the default conventions (the latest ones have none yet).
SCHEMA_URL = "https://opentelemetry.io/schemas/1.41.0"
PROVIDER = "vllm"
ERROR_TYPE = tracing.ERROR_TYPE
TOKEN_TYPE = "gen_ai.token.type"
TOKEN_MODALITY = "gen_ai.token.modality"

# A series: (operation, team, model, response model); "" for a response model not yet known.
Key = tuple[str, str, str, str]
# A histogram's series as copied for one export: (key, counts, overflow, sum, min, max).
Snapshot = list[tuple[tuple[str, ...], list[float]]]


class _Histogram:
    """Explicit-bucket histogram series: counts per bucket, the overflow, sum, min and max."""

    __slots__ = ("bounds", "series")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        """One observation of ``value`` (bucket ``i`` holds values up to ``bounds[i]``)."""
        s = self.series.get(key)
        n = len(self.bounds) + 1
        if s is None:
            s = self.series[key] = [0.0] * n + [0.0, float("inf"), float("-inf")]
        s[bisect_left(self.bounds, value)] += 1
        s[n] += value
        if value < s[n + 1]:
            s[n + 1] = value
        if value > s[n + 2]:
            s[n + 2] = value

    def snapshot(self) -> Snapshot:
        """A copy of every series, taken at once (on the event loop that observes)."""
        return [(key, list(s)) for key, s in self.series.items()]


class GenAiMetrics:
    """The GenAI metrics of one sidecar: observed at each request's end, built at export."""

    def __init__(self, upstream_url: str, opt_in: frozenset[str] = frozenset()) -> None:
        self.server = tracing.server_attributes(upstream_url)
        self.latest = GEN_AI_LATEST in opt_in
        self.duration = _Histogram(DURATION_BOUNDS)
        self.ttft = _Histogram(TTFT_BOUNDS)
        self.tpot = _Histogram(TPOT_BOUNDS)
        self.tokens = _Histogram(TOKEN_BOUNDS)
        # (key, "input" | "output" | "cache_read") -> tokens, for the latest conventions' counters
        self.token_totals: dict[tuple[Key, str], float] = {}

    @property
    def schema_url(self) -> str:
        """The schema of the conventions emitted ("" for the unpublished latest ones)."""
        return "" if self.latest else SCHEMA_URL

    def observe(
        self,
        key: Key,
        error: str | None,
        duration: float | None,
        ttft: float | None,
        tpot: float | None,
        usage: UsageCounts | None,
    ) -> None:
        """One ended request's figures (None: not measured for it, as on ``/metrics``)."""
        if duration is not None:
            self.duration.observe((*key, error or ""), duration)
        if ttft is not None:
            self.ttft.observe(key, ttft)
        if tpot is not None:
            self.tpot.observe(key, tpot)
        if usage is not None:
            self.usage(key, usage.prompt, usage.completion, usage.cached)

    def usage(self, key: Key, prompt: int, completion: int, cached: int) -> None:
        """A request's tokens, as vLLM counted them."""
        if not self.latest:
            self.tokens.observe((*key, "input"), prompt)
            self.tokens.observe((*key, "output"), completion)
            return
        totals = self.token_totals
        for kind, n in (("input", prompt), ("output", completion), ("cache_read", cached)):
            totals[(key, kind)] = totals.get((key, kind), 0.0) + n

    def recovered(
        self,
        records: Iterable[UsageRecord],
        team_names: frozenset[str],
        model_names: frozenset[str],
        operations: dict[str, str],
    ) -> None:
        """The tokens of requests a killed predecessor left running (as ``count_recovered``)."""
        from sidecar.bounds import label

        for r in records:
            key = (
                operations.get(r.endpoint, r.endpoint),
                label(r.team, team_names),
                label(r.model, model_names),
                label(r.served_version, model_names),
            )
            self.usage(key, r.prompt_tokens, r.completion_tokens, r.cached_prompt_tokens)

    def _attributes(self, key: Key) -> dict[str, str | int]:
        operation, team, model, response = key
        attrs: dict[str, str | int] = {
            tracing.OPERATION: operation,
            tracing.PROVIDER: PROVIDER,
            tracing.REQUEST_MODEL: model,
        }
        if response:
            attrs[tracing.RESPONSE_MODEL] = response
        attrs.update(self.server)
        attrs[tracing.TEAM] = team
        return attrs

    def _series(
        self, bounds: Sequence[float], series: Snapshot, extra: str | None
    ) -> tuple[Sequence[float], list[tuple[Attributes, list[float]]]]:
        """Each series with its attributes; ``extra`` names the key's fifth element, if any."""
        out: list[tuple[Attributes, list[float]]] = []
        for key, s in series:
            attrs = self._attributes(key[:4])  # type: ignore[arg-type]
            if extra is not None and key[4]:
                attrs[extra] = key[4]
            out.append((attrs, s))
        return bounds, out

    async def produce(self, start_ns: int, now_ns: int) -> Sequence[Metric]:
        """The points of one export: the figures copied at once on the event loop that keeps
        them (tens of microseconds), the points built from the copy on a worker thread (a few
        milliseconds for a hundred series, which the loop's requests should not wait for)."""
        copied = (
            self.duration.snapshot(),
            self.ttft.snapshot(),
            self.tpot.snapshot(),
            self.tokens.snapshot(),
            list(self.token_totals.items()),
        )
        return await asyncio.to_thread(self._build, copied, start_ns, now_ns)

    def _build(
        self,
        copied: tuple[Snapshot, Snapshot, Snapshot, Snapshot, list[tuple[tuple[Key, str], float]]],
        start_ns: int,
        now_ns: int,
    ) -> list[Metric]:
        from infermeter.otlp_export import histogram, monotonic_sum

        duration, ttft, tpot, tokens, totals = copied

        def hist(
            name: str,
            unit: str,
            text: str,
            h: _Histogram,
            series: Snapshot,
            extra: str | None = None,
        ) -> Metric:
            return histogram(
                name, unit, text, *self._series(h.bounds, series, extra), start_ns, now_ns
            )

        metrics = [
            hist(
                "gen_ai.server.request.duration",
                "s",
                "Generative AI server request duration such as time-to-last byte or last output token.",
                self.duration,
                duration,
                ERROR_TYPE,
            ),
            hist(
                "gen_ai.server.time_to_first_token",
                "s",
                "Time to generate first token for successful responses.",
                self.ttft,
                ttft,
            ),
            hist(
                "gen_ai.server.time_per_output_token",
                "s",
                "Time per output token generated after the first token for successful responses.",
                self.tpot,
                tpot,
            ),
        ]
        if not self.latest:
            metrics.append(
                hist(
                    "gen_ai.client.token.usage",
                    "{token}",
                    "Number of input and output tokens used.",
                    self.tokens,
                    tokens,
                    TOKEN_TYPE,
                )
            )
            return metrics
        texts = {
            "input": (
                "gen_ai.client.inference.usage.input_tokens",
                "The number of input (prompt) tokens used, including cached tokens.",
            ),
            "output": (
                "gen_ai.client.inference.usage.output_tokens",
                "The number of output (completion) tokens used, including reasoning tokens.",
            ),
            "cache_read": (
                "gen_ai.client.inference.usage.cache_read.input_tokens",
                "The number of input tokens served from the provider's cache.",
            ),
        }
        for kind, (name, text) in texts.items():
            values = [
                ({**self._attributes(key), TOKEN_MODALITY: "unknown"}, n)
                for (key, k), n in totals
                if k == kind
            ]
            metrics.append(monotonic_sum(name, "{token}", text, values, start_ns, now_ns))
        return metrics
