"""A real OTLP receiver on loopback for tests: it decodes what exporters send with the protobuf
definitions of ``opentelemetry-proto``, as an OpenTelemetry Collector would.

``OtlpHttpReceiver`` serves ``POST /v1/metrics`` (and ``/v1/traces``, counted only) on its own
thread; ``OtlpGrpcReceiver`` serves the metrics service over gRPC. Both keep every decoded
request, and can be told to answer with an error status or to answer slowly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric

from infermeter.serving import free_port

__all__ = ["OtlpGrpcReceiver", "OtlpHttpReceiver", "Point", "attributes"]


def attributes(kvs: Any) -> dict[str, Any]:
    """A protobuf attribute list as a dict of plain values."""
    out: dict[str, Any] = {}
    for kv in kvs:
        assert isinstance(kv, KeyValue)
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


@dataclass
class Point:
    """One data point as received: its metric's name, unit and kind, and its figures."""

    name: str
    unit: str
    kind: str
    attributes: dict[str, Any]
    value: float = 0.0
    count: int = 0
    sum: float = 0.0
    bounds: list[float] = field(default_factory=list)
    bucket_counts: list[int] = field(default_factory=list)
    monotonic: bool = False
    cumulative: bool = False


def _points(metric: Metric) -> Iterator[Point]:
    kind = metric.WhichOneof("data") or ""
    data = getattr(metric, kind)
    for p in data.data_points:
        point = Point(metric.name, metric.unit, kind, attributes(p.attributes))
        if kind == "histogram":
            point.count, point.sum = p.count, p.sum
            point.bounds, point.bucket_counts = list(p.explicit_bounds), list(p.bucket_counts)
            point.cumulative = data.aggregation_temporality == 2
        else:
            point.value = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
            if kind == "sum":
                point.monotonic, point.cumulative = (
                    data.is_monotonic,
                    data.aggregation_temporality == 2,
                )
        yield point


class _Requests:
    """What a receiver got, and how it is to answer (shared with its serving threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.traces = 0
        self.status = 200
        self.delay_seconds = 0.0
        self.attempts = 0

    def take(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        with self.lock:
            self.metrics.append(request)

    def resources(self) -> list[dict[str, Any]]:
        """The resource attributes of every request received."""
        with self.lock:
            return [
                attributes(rm.resource.attributes)
                for r in self.metrics
                for rm in r.resource_metrics
            ]

    def scopes(self) -> list[tuple[str, str]]:
        """(name, schema URL) of every scope received."""
        with self.lock:
            return [
                (sm.scope.name, sm.schema_url)
                for r in self.metrics
                for rm in r.resource_metrics
                for sm in rm.scope_metrics
            ]

    def latest(self) -> list[Point]:
        """The points of the last request that held each metric (exports are cumulative)."""
        last: dict[str, list[Point]] = {}
        with self.lock:
            for request in self.metrics:
                for rm in request.resource_metrics:
                    for sm in rm.scope_metrics:
                        for m in sm.metrics:
                            last[m.name] = list(_points(m))
        return [p for points in last.values() for p in points]


class OtlpHttpReceiver(_Requests):
    """OTLP/HTTP (protobuf) on a free loopback port; ``url`` is its base, as OTEL_EXPORTER_OTLP_ENDPOINT."""

    def __init__(self) -> None:
        super().__init__()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: ThreadingHTTPServer | None = None

    def __enter__(self) -> OtlpHttpReceiver:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Listen (again, on the same port)."""
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with received.lock:
                    received.attempts += 1
                    status, delay = received.status, received.delay_seconds
                time.sleep(delay)
                if status == 200:
                    if self.path == "/v1/metrics":
                        received.take(body)
                    else:
                        received.traces += 1
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    reply = b"failing on purpose"
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Stop listening: the receiver is down."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class OtlpGrpcReceiver(_Requests):
    """The OTLP metrics service over gRPC (plaintext) on a free loopback port."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

        super().__init__()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        received = self

        class Service(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> ExportMetricsServiceResponse:
                received.take(request.SerializeToString())
                return ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Service(), self._server)  # type: ignore[no-untyped-call]
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    def __enter__(self) -> OtlpGrpcReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
