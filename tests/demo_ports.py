"""Every port of the embedded configuration held by a listener, as a running demo holds them.

Tests must leave the demo's ports alone: ``make demo`` and ``make test`` run side by side on a
developer's machine. Loaded as a plugin (``PYTHONPATH=. pytest -p tests.demo_ports ...``), this
module listens on each port the embedded configuration names (every ``host:port`` or URL in it,
so a port added to ``infermeter/defaults.yaml`` is held too) from before the first test until
after the last. A test that binds one fails with "address already in use"; a test that connects
to one (it would be talking to the demo's services) gets an error at its teardown naming the
port, the request and the process. On a shared machine, connections from processes outside this
session's process tree are not blamed on a test; the summary at the end counts them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.ports import embedded_addresses

__all__ = ["Contacts", "hold"]


@dataclass
class Contacts:
    """What reached the held ports: one line per connection and per request."""

    seen: list[str] = field(default_factory=list)
    # Contacts from processes outside this session (the machine may be shared): not a test's.
    outside: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, line: str, ours: bool = True) -> None:
        """Note one contact (called from the listeners' threads)."""
        with self.lock:
            (self.seen if ours else self.outside).append(line)

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
        self.ours: dict[int, bool] = {}  # by client port: was the connection this session's
        self.where = f"{address[0]}:{address[1]}"

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Every connection of this session is noted, even one that never sends a request.

        One from a process outside this session is answered and left out of the contacts.
        """
        who, ours = _who(client_address[1])
        self.ours[client_address[1]] = ours
        self.contacts.add(f"a connection to {self.where} from {who}", ours)
        return True


class _Answer(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        assert isinstance(self.server, _Listener)
        ours = self.server.ours.get(self.client_address[1], True)
        self.server.contacts.add(f"{self.command} {self.path} on {self.server.where}", ours)
        self.send_error(503, "held by tests.demo_ports")

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer  # the names http.server calls

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the contact is reported by the test it belongs to."""


def _who(port: int) -> tuple[str, bool]:
    """Who holds the loopback client socket on ``port`` (Linux), and whether it is this session.

    The machine may be shared: a process outside this session's process tree (another
    session's fleet on the demo's ports) is not this session's test reaching them. A process
    that cannot be found counts as this session's.
    """
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
                pid = int(fd_dir.parent.name)
                argv = (fd_dir.parent / "cmdline").read_bytes().split(b"\0")
                command = " ".join(a.decode(errors="replace") for a in argv if a)
                return f"pid {pid}: {command[:160]}", _descends(pid, os.getpid())
    return f"port {port} (its process not found)", True


def _descends(pid: int, ancestor: int) -> bool:
    """True if ``pid`` is ``ancestor`` or one of its descendants (a gone parent ends the walk)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


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


_SESSIONS: list[Contacts] = []  # for the summary


@pytest.fixture(scope="session")
def demo_ports_contacts() -> Iterator[Contacts]:
    """The embedded configuration's ports, held for the whole session; what reached them."""
    with hold(embedded_addresses()) as contacts:
        _SESSIONS.append(contacts)
        yield contacts


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many contacts came from processes outside this session, and the first few."""
    for contacts in _SESSIONS:
        outside = contacts.outside
        terminalreporter.write_line(
            f"demo ports held: {len(contacts.seen)} contact(s) from this session, "
            f"{len(outside)} from other processes" + (f", such as {outside[:3]}" if outside else "")
        )


@pytest.fixture(autouse=True)
def _demo_ports_untouched(demo_ports_contacts: Contacts) -> Iterator[None]:
    """Each test: nothing it did reached a port of the embedded configuration."""
    mark = len(demo_ports_contacts.since(0))
    yield
    reached = demo_ports_contacts.since(mark)
    if reached:
        pytest.fail("reached the embedded configuration's ports: " + "; ".join(reached[:5]))
