"""An OTLP/HTTP endpoint that takes every export and counts it, for the overhead benchmark.

It answers ``POST /v1/metrics`` (and any other path) with 200 at once, without decoding: the
figure measured is what exporting costs the sidecar, not what a receiver does with it. It runs
on a thread of the benchmark's parent process, on loopback.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from infermeter.serving import free_port

__all__ = ["OtlpSink"]


class OtlpSink:
    """``with OtlpSink() as sink``: ``sink.url`` takes exports; ``sink.exports``, ``sink.bytes``,
    and ``sink.traces`` (those to ``/v1/traces``)."""

    def __init__(self) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.exports = 0
        self.bytes = 0
        self.traces = 0
        self._server: ThreadingHTTPServer | None = None

    def __enter__(self) -> OtlpSink:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                self.rfile.read(n)
                sink.exports += 1
                sink.bytes += n
                sink.traces += self.path == "/v1/traces"
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        port = int(self.url.rsplit(":", 1)[1])
        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
