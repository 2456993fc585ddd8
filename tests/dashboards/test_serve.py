"""``infermeter dashboard`` as a process: its URL line, its pages, a clean stop, a taken port."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from infermeter.config import DEFAULT_CONFIG
from infermeter.serving import ensure_free, free_port
from launcher.cli import main

NO_BILLING = "http://127.0.0.1:1"  # the sign-in page needs no billing service
# Named explicitly: falling back to the embedded demo configuration prints a warning.
CONFIG = ["--config", str(DEFAULT_CONFIG)]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 0), (signal.SIGTERM, 128 + 15)])
def test_dashboard_serves_until_signalled(sig, code):
    """The dashboard prints its URL, serves Dash's page and layout, and stops at once on a signal."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "dashboard",
            *CONFIG,
            "--listen",
            f"127.0.0.1:{port}",
            "--billing-url",
            NO_BILLING,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == f"dashboard: http://127.0.0.1:{port}/ (reading billing at {NO_BILLING})\n"
        deadline = time.monotonic() + 30
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the dashboard never answered"
                time.sleep(0.2)
        assert page.status_code == 200
        assert "<title>infermeter</title>" in page.text
        assert httpx.get(f"http://127.0.0.1:{port}/_dash-layout", timeout=5).status_code == 200
    finally:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == code
    assert err == ""
    ensure_free("127.0.0.1", port, "the stopped dashboard's port")


def test_taken_port_is_a_one_line_error(capsys):
    """A dashboard address in use stops start-up with exit 2 and one line naming it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert (
            main(
                ["dashboard", *CONFIG, "--listen", f"127.0.0.1:{port}", "--billing-url", NO_BILLING]
            )
            == 2
        )
    assert capsys.readouterr().err == (
        f"infermeter: port {port} on 127.0.0.1 (dashboard listen address) is already in use\n"
    )
