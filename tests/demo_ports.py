"""Every port of the embedded configuration held by a listener, as a running demo holds them.

Tests must leave the demo's ports alone: ``make demo`` and ``make test`` run side by side on a
developer's machine. Loaded as a plugin (``PYTHONPATH=. pytest -p tests.demo_ports ...``), this
module listens on each port the embedded configuration names (every ``host:port`` or URL in it,
so a port added to ``infermeter/defaults.yaml`` is held too) from before the first test until
after the last. A test that binds one fails with "address already in use"; a test that connects
to one (it would be talking to the demo's services) gets an error at its teardown naming the
port and the request.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.ports import embedded_addresses

__all__ = ["Contacts", "hold"]


@dataclass
class Contacts:
    """What reached the held ports: one line per connection and per request."""

    seen: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, line: str) -> None:
        """Note one contact (called from the listeners' threads)."""
        with self.lock:
            self.seen.append(line)

    def since(self, mark: int) -> list[str]:
        """The contacts after the first ``mark`` ones."""
        with self.lock:
            return self.seen[mark:]


class _Listener(ThreadingHTTPServer):
    """Accepts and notes every connection; answers each request 503, as a demo starting would."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], contacts: Contacts) -> None:
        super().__init__(address, _Answer)
        self.contacts = contacts
        self.where = f"{address[0]}:{address[1]}"

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Every connection is noted, even one that never sends a request."""
        self.contacts.add(f"a connection to {self.where}")
        return True


class _Answer(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        assert isinstance(self.server, _Listener)
        self.server.contacts.add(f"{self.command} {self.path} on {self.server.where}")
        self.send_error(503, "held by tests.demo_ports")

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer  # the names http.server calls

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the contact is reported by the test it belongs to."""


@contextlib.contextmanager
def hold(addresses: Iterable[tuple[str, int]]) -> Iterator[Contacts]:
    """Listen on every address for the duration of the block; a usage error if one is taken."""
    contacts = Contacts()
    with contextlib.ExitStack() as stack:
        for host, port in sorted(addresses):
            try:
                listener = _Listener((host, port), contacts)
            except OSError as exc:
                raise pytest.UsageError(
                    f"cannot hold {host}:{port} of the embedded configuration: {exc.strerror} "
                    "(is a demo running? it holds them already)"
                ) from None
            stack.callback(listener.server_close)
            name = f"demo-port-{port}"
            threading.Thread(target=listener.serve_forever, name=name, daemon=True).start()
            stack.callback(listener.shutdown)
        yield contacts


@pytest.fixture(scope="session")
def demo_ports_contacts() -> Iterator[Contacts]:
    """The embedded configuration's ports, held for the whole session; what reached them."""
    with hold(embedded_addresses()) as contacts:
        yield contacts


@pytest.fixture(autouse=True)
def _demo_ports_untouched(demo_ports_contacts: Contacts) -> Iterator[None]:
    """Each test: nothing it did reached a port of the embedded configuration."""
    mark = len(demo_ports_contacts.since(0))
    yield
    reached = demo_ports_contacts.since(mark)
    if reached:
        pytest.fail("reached the embedded configuration's ports: " + "; ".join(reached[:5]))
