"""A loopback HTTP server answering GETs from a function, for stand-ins of what a part reads
over HTTP (an identity provider's documents, a /metrics page)."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Answer", "serving"]

# A path's answer: status, body and content type.
Answer = tuple[int, bytes, str]


@contextlib.contextmanager
def serving(answer: Callable[[str], Answer], name: str = "stub") -> Iterator[str]:
    """Serve ``answer(path)`` to every GET on a loopback port, in a thread; yields the base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body, kind = answer(self.path)
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
