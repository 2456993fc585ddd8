"""The OTEL_* variables read as the OpenTelemetry specification reads them, and bad ones refused."""

from __future__ import annotations

import pytest

from infermeter.otlp import (
    GEN_AI_LATEST,
    OtlpConfigError,
    OtlpSettings,
    check_span_export_timeout,
    metrics_export_configured,
    otlp_settings,
)

ENDPOINT = "http://collector:4318"


@pytest.mark.parametrize(
    ("environ", "configured"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, True),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"{ENDPOINT}/v1/metrics"}, True),
        ({"OTEL_METRICS_EXPORTER": "otlp"}, True),
        ({"OTEL_METRICS_EXPORTER": "console,otlp"}, True),
        ({"OTEL_METRICS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, False),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, False),
    ],
)
def test_export_is_on_when_the_variables_ask_for_it(environ, configured):
    """An endpoint or the otlp exporter turns metric export on; none or a disabled SDK off."""
    assert metrics_export_configured(environ) is configured


@pytest.mark.parametrize(
    ("environ", "settings"),
    [
        ({}, OtlpSettings("http/protobuf", 60.0)),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, OtlpSettings("grpc", 60.0)),
        (
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
            },
            OtlpSettings("http/protobuf", 60.0),
        ),
        ({"OTEL_METRIC_EXPORT_INTERVAL": "5000"}, OtlpSettings("http/protobuf", 5.0)),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "10"}, OtlpSettings("http/protobuf", 60.0)),
        (
            {"OTEL_SEMCONV_STABILITY_OPT_IN": f"http, {GEN_AI_LATEST}"},
            OtlpSettings("http/protobuf", 60.0, frozenset({"http", GEN_AI_LATEST})),
        ),
    ],
)
def test_settings_follow_the_metrics_variable_first(environ, settings):
    """The metrics-specific protocol wins over the general one; the interval is milliseconds."""
    assert otlp_settings(environ) == settings


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json': metrics can be exported over http/protobuf or grpc",
        ),
        (
            {"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "thrift"},
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL='thrift': metrics can be exported over http/protobuf or grpc",
        ),
        (
            {"OTEL_METRIC_EXPORT_INTERVAL": "soon"},
            "OTEL_METRIC_EXPORT_INTERVAL='soon': not a positive number of milliseconds",
        ),
        (
            {"OTEL_METRIC_EXPORT_INTERVAL": "0"},
            "OTEL_METRIC_EXPORT_INTERVAL='0': not a positive number of milliseconds",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"},
            "OTEL_EXPORTER_OTLP_TIMEOUT='10000': 10000 s, longer than the export interval (60 s); "
            "the exporter reads seconds, not the specification's milliseconds",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TIMEOUT": "5", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "30000"},
            "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT='30000': 30000 s, longer than the export "
            "interval (60 s); the exporter reads seconds, not the specification's milliseconds",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TIMEOUT": "never"},
            "OTEL_EXPORTER_OTLP_TIMEOUT='never': not a positive number of seconds (the "
            "exporter's unit, not the specification's milliseconds)",
        ),
    ],
)
def test_a_value_export_cannot_honour_is_refused_by_name(environ, message):
    """The error names the variable and its value."""
    with pytest.raises(OtlpConfigError) as caught:
        otlp_settings(environ)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"OTEL_EXPORTER_OTLP_TIMEOUT": "10"},
        {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "30"},
        {"OTEL_EXPORTER_OTLP_TIMEOUT": "10000", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "5"},
        {"OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "10000"},
        {"OTEL_BSP_EXPORT_TIMEOUT": "120000", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "100"},
    ],
)
def test_a_span_export_timeout_in_seconds_is_taken(environ):
    """Seconds up to OTEL_BSP_EXPORT_TIMEOUT (30 s by default) start; the metrics' own variable
    is not the span exporter's."""
    check_span_export_timeout(environ)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "10000"},
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='10000': 10000 s, longer than "
            "OTEL_BSP_EXPORT_TIMEOUT (30 s); the exporter reads seconds, not the "
            "specification's milliseconds",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TIMEOUT": "10000", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "5"},
            "OTEL_EXPORTER_OTLP_TIMEOUT='10000': 10000 s, longer than OTEL_BSP_EXPORT_TIMEOUT "
            "(30 s); the exporter reads seconds, not the specification's milliseconds",
        ),
        (
            {"OTEL_BSP_EXPORT_TIMEOUT": "5000", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "10"},
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='10': 10 s, longer than OTEL_BSP_EXPORT_TIMEOUT "
            "(5 s); the exporter reads seconds, not the specification's milliseconds",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "0"},
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='0': not a positive number of seconds (the "
            "exporter's unit, not the specification's milliseconds)",
        ),
        (
            {"OTEL_BSP_EXPORT_TIMEOUT": "30s"},
            "OTEL_BSP_EXPORT_TIMEOUT='30s': not a positive number of milliseconds",
        ),
    ],
)
def test_a_span_export_timeout_read_as_hours_is_refused_by_name(environ, message):
    """The span exporter reads OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT in seconds too: the
    specification's 10000 is refused, the variable that carried it named."""
    with pytest.raises(OtlpConfigError) as caught:
        check_span_export_timeout(environ)
    assert str(caught.value) == message
