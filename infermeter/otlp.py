"""Whether and how a service exports metrics over OTLP, read from the standard OTEL_* variables.

Export is on when the variables ask for it the way the OpenTelemetry specification reads them:
``OTEL_METRICS_EXPORTER`` names ``otlp`` (the specification's default), and an endpoint is given
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``) or the exporter is
named explicitly. ``OTEL_SDK_DISABLED=true`` or ``OTEL_METRICS_EXPORTER=none`` turns it off.
With no variable set nothing is exported and nothing of the SDK is imported: this module reads
the environment only, and ``infermeter.otlp_export`` (the SDK's exporter and the export loop)
is imported by a service only once this says yes.

The SDK's exporter reads everything else itself: endpoint, headers, timeout, compression and
certificates (``OTEL_EXPORTER_OTLP_[METRICS_]*``). Values that would make export silently do
something else (an unknown protocol, an interval that is not a positive number, a timeout that
is not a positive number of seconds or is longer than the interval) are refused at start with
``OtlpConfigError``, which names the variable and the value. The sidecar's span exporter reads
its timeout the same way (``OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT``, seconds):
``check_span_export_timeout`` refuses one longer than ``OTEL_BSP_EXPORT_TIMEOUT``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from infermeter.config import process_environment

__all__ = [
    "GEN_AI_LATEST",
    "OtlpConfigError",
    "OtlpSettings",
    "check_span_export_timeout",
    "metrics_export_configured",
    "otlp_settings",
    "semconv_opt_in",
]

# The protocols OpenTelemetry's Python SDK has metric exporters for (no http/json).
PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_INTERVAL_MILLIS = 60_000.0
# OTEL_BSP_EXPORT_TIMEOUT's default: the specification's bound on one span export.
DEFAULT_SPAN_EXPORT_TIMEOUT_MILLIS = 30_000.0
# OTEL_SEMCONV_STABILITY_OPT_IN's value for the latest experimental GenAI conventions.
GEN_AI_LATEST = "gen_ai_latest_experimental"


class OtlpConfigError(ValueError):
    """An OTEL_* variable whose value export cannot honour; the message names both."""


@dataclass(frozen=True, slots=True)
class OtlpSettings:
    """How metrics leave the process: the wire protocol, the time between exports, and the
    semantic-convention categories opted into (``OTEL_SEMCONV_STABILITY_OPT_IN``)."""

    protocol: str
    interval_seconds: float
    opt_in: frozenset[str] = frozenset()


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return process_environment() if environ is None else environ


def metrics_export_configured(environ: Mapping[str, str] | None = None) -> bool:
    """True when the standard variables ask for metric export over OTLP."""
    env = _env(environ)
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_METRICS_EXPORTER", "").split(",")}
    if "none" in exporters:
        return False
    return "otlp" in exporters or bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    )


def otlp_settings(environ: Mapping[str, str] | None = None) -> OtlpSettings:
    """The protocol (the metrics-specific variable first) and the export interval.

    OtlpConfigError for a protocol the SDK has no metric exporter for, or an interval that is
    not a positive number of milliseconds.
    """
    env = _env(environ)
    name = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
    if not env.get(name):
        name = "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = env.get(name, "").strip().lower() or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise OtlpConfigError(
            f"{name}={env.get(name)!r}: metrics can be exported over {' or '.join(PROTOCOLS)}"
        )
    millis = _millis(env, "OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_INTERVAL_MILLIS)
    _check_timeout(env, "METRICS", millis / 1000, "the export interval")
    return OtlpSettings(protocol, millis / 1000, semconv_opt_in(env))


def check_span_export_timeout(environ: Mapping[str, str] | None = None) -> None:
    """OtlpConfigError for a span export timeout the SDK's exporter would read as hours.

    The span exporter reads OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT in seconds, as the metric
    exporter does: the specification's 10000 would hold every later span behind one send to a
    receiver that does not answer, and the way out for the 30 s the SDK's batch processor waits
    for it. A timeout longer than OTEL_BSP_EXPORT_TIMEOUT (the specification's bound on one
    export, milliseconds, default 30000, which Python's SDK reads but does not apply) is
    refused, the unit named.
    """
    env = _env(environ)
    millis = _millis(env, "OTEL_BSP_EXPORT_TIMEOUT", DEFAULT_SPAN_EXPORT_TIMEOUT_MILLIS)
    _check_timeout(env, "TRACES", millis / 1000, "OTEL_BSP_EXPORT_TIMEOUT")


def _millis(env: Mapping[str, str], name: str, default: float) -> float:
    """The positive number of milliseconds ``name`` holds (``default`` when unset), else
    OtlpConfigError naming it."""
    raw = env.get(name, "").strip()
    try:
        millis = float(raw) if raw else default
    except ValueError:
        millis = -1.0
    if not 0 < millis < float("inf"):
        raise OtlpConfigError(f"{name}={raw!r}: not a positive number of milliseconds")
    return millis


def _check_timeout(env: Mapping[str, str], signal: str, bound_seconds: float, bound: str) -> None:
    """OtlpConfigError for an export timeout the SDK's exporter would read as hours.

    The exporters read OTEL_EXPORTER_OTLP_[<signal>_]TIMEOUT in seconds where the specification
    says milliseconds: the specification's 10000 would let one send (sends go one at a time)
    and the way out wait 10,000 s on a receiver that does not answer. A timeout longer than
    ``bound_seconds`` (``bound``: what it is, for the message) is refused, the unit named.
    """
    name = f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT"
    if not env.get(name):
        name = "OTEL_EXPORTER_OTLP_TIMEOUT"
    raw = env.get(name, "").strip()
    if not raw:
        return
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise OtlpConfigError(
            f"{name}={raw!r}: not a positive number of seconds (the exporter's unit, not the "
            "specification's milliseconds)"
        )
    if seconds > bound_seconds:
        raise OtlpConfigError(
            f"{name}={raw!r}: {seconds:g} s, longer than {bound} ({bound_seconds:g} s); "
            "the exporter reads seconds, not the specification's milliseconds"
        )


def semconv_opt_in(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The categories OTEL_SEMCONV_STABILITY_OPT_IN lists (comma-separated, case as given)."""
    raw = _env(environ).get("OTEL_SEMCONV_STABILITY_OPT_IN", "")
    return frozenset(v.strip() for v in raw.split(",") if v.strip())
