"""The dashboard's waitress server keeps infermeter's client limits and stops gracefully."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx
import pytest

from dashboards.wsgi import WsgiServer
from infermeter.http_guard import ServerLimits
from infermeter.serving import free_port

LIMITS = ServerLimits(header_timeout_seconds=0.5, max_header_bytes=4096, max_connections=8)


def slow_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """Answers after ``?seconds=`` (default 0), so a test can keep a request in flight."""
    seconds = float(environ.get("QUERY_STRING", "").partition("=")[2] or 0)
    time.sleep(seconds)
    start_response("200 OK", [("content-type", "text/plain")])
    return [b"done"]


@pytest.fixture
def served() -> Iterator[tuple[WsgiServer, str, threading.Thread]]:
    port = free_port()
    server = WsgiServer(slow_app, "127.0.0.1", port, LIMITS, threads=4, graceful_seconds=3)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    server.started.wait(5)
    yield server, f"http://127.0.0.1:{port}", thread
    server.stop()
    thread.join(10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the peer closes ``sock`` within ``seconds`` (it sends nothing first)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_headers_trickled_past_the_deadline_close_the_connection(served):
    """A client sending a header byte at a time is cut off after header_timeout_seconds."""
    _, url, _ = served
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        for _ in range(20):
            try:
                sock.sendall(b"X")
            except OSError:
                break
            time.sleep(0.1)
        assert _closed_within(sock, 3)
    assert time.monotonic() - started < 2.5


def test_oversized_headers_are_refused(served):
    """Headers past max_header_bytes are answered 431, as uvicorn's guard answers them."""
    _, url, _ = served
    r = httpx.get(url, headers={"x-big": "a" * 8000})
    assert r.status_code == 431


def test_stop_lets_a_request_in_flight_finish_and_refuses_new_ones(served):
    """After stop(), a request already being served is answered; the port then refuses connections."""
    server, url, thread = served
    answers: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: answers.append(httpx.get(f"{url}/?seconds=1", timeout=10))
    )
    worker.start()
    time.sleep(0.3)
    server.stop()
    worker.join(10)
    thread.join(10)
    assert [a.text for a in answers] == ["done"]
    assert not thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=2)


def test_a_stop_that_runs_late_never_writes_to_the_closed_trigger():
    """``stop`` sets the flag, and the loop may see it and close waitress's trigger before
    ``stop`` pulls it (a thread descheduled under load): here the flag's ``set`` waits for the
    loop to finish, as the worst scheduling would. The pull comes first or not at all: no
    write to a closed descriptor (EBADF, or whatever the number was given to since)."""
    port = free_port()
    server = WsgiServer(slow_app, "127.0.0.1", port, LIMITS, threads=1, graceful_seconds=0.1)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    assert server.started.wait(10)

    class LateEvent(threading.Event):
        def set(self) -> None:
            super().set()
            thread.join(1.0)  # the loop runs to its end meanwhile, if nothing holds it

    late = LateEvent()
    server._stop = late
    server.stop()
    thread.join(10)
    assert not thread.is_alive()
