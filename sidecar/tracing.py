"""OpenTelemetry spans for requests, with the GenAI semantic-convention attributes.

Export is configured by the standard variables: a span exporter is installed only when
``OTEL_TRACES_EXPORTER`` is ``otlp`` or an ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` is set, and
then ``OTLPSpanExporter`` reads the rest (endpoint, headers, timeout) itself; a timeout it would
read as hours (``infermeter.otlp.check_span_export_timeout``) is refused first. Without one, spans
are not recorded at all, but a caller's W3C ``traceparent`` is still passed on to vLLM, so a
trace that starts upstream of the sidecar continues into the engine. The SDK (and the
exporter) are imported only when export is configured: a sidecar that records no spans needs
only the API.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from infermeter.config import process_environment
from infermeter.otlp import check_span_export_timeout

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["PROPAGATOR", "export_configured", "make_tracer_provider", "server_attributes"]

PROPAGATOR = TraceContextTextMapPropagator()

# GenAI semantic conventions (opentelemetry-semantic-conventions, gen_ai.* attributes).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
REQUEST_STREAM = "gen_ai.request.stream"
TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
# How a request that did not end well ended (general conventions; conditionally required on a
# GenAI span that ended in an error): the usage record's status, a handful of values.
ERROR_TYPE = "error.type"
TEAM = "infermeter.team"
REPLICA = "infermeter.replica"
# Who the request is for (general semantic conventions) and its project tag: span attributes
# only, never metric labels (there may be a great many).
END_USER = "enduser.id"
PROJECT = "infermeter.project"


def export_configured(environ: Mapping[str, str] | None = None) -> bool:
    """True when the standard OTEL_* variables ask for trace export over OTLP."""
    env = process_environment() if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "none":
        return False
    return exporter == "otlp" or bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def make_tracer_provider(
    service_name: str,
    environ: Mapping[str, str] | None = None,
    attributes: Mapping[str, str] | None = None,
) -> TracerProvider | None:
    """A provider exporting over OTLP/HTTP when configured, else None (no spans recorded).

    ``attributes`` join ``service.name`` on the resource: the instance (``service.instance.id``)
    is named there, once per process, rather than on every span.

    OtlpConfigError for an export timeout the exporter would read as hours (it reads
    OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT in seconds, not the specification's milliseconds).
    """
    if not export_configured(environ):
        return None
    check_span_export_timeout(process_environment() if environ is None else environ)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({**(attributes or {}), "service.name": service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def extract(headers: Mapping[str, str]) -> Context:
    """The caller's trace context from its W3C headers."""
    return PROPAGATOR.extract(headers)


def tracer(provider: TracerProvider | None) -> trace.Tracer | None:
    """The sidecar's tracer, or None when spans are not recorded."""
    return provider.get_tracer("infermeter.sidecar") if provider is not None else None


@functools.lru_cache(maxsize=8)
def server_attributes(upstream_url: str) -> Mapping[str, str | int]:
    """``server.address`` and ``server.port`` of the replica a request went to, for its span and
    the GenAI metrics (the conventions recommend them), made once per URL and shared, so read
    only: a reload that moves the replica gives the next span the new one."""
    parts = urlsplit(upstream_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return {SERVER_ADDRESS: parts.hostname or "", SERVER_PORT: port}
