"""A started sidecar says once, at INFO, where it serves and how, and nothing secret."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG
from infermeter.serving import free_port


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["replicas"][1].update(
        upstream_url=f"http://svc:hunter2@127.0.0.1:{free_port()}/?key=s3cret",
        sidecar_listen=f"127.0.0.1:{port}",
    )
    data["sidecar"] = {"spool_dir": str(tmp_path / "spool")}
    path = tmp_path / "infermeter.yaml"
    path.write_text(yaml.safe_dump(data))
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "sidecar",
        "--config",
        str(path),
        "--replica",
        "small-0",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    return proc, port


@pytest.mark.timeout(60)
def test_the_sidecar_logs_one_ready_line_with_its_address_and_nothing_secret(tmp_path):
    """One INFO line names address, replica group, instance, upstream and limits; no credentials."""
    proc, port = _start(tmp_path)
    lines: list[str] = []
    assert proc.stderr is not None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("ready" in x for x in lines):
            lines.append(proc.stderr.readline())
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1]
    ready = [x for x in [*lines, *rest.splitlines()] if "sidecar ready" in x]
    assert len(ready) == 1, lines
    line = ready[0]
    assert line.startswith("INFO infermeter.sidecar: ")
    assert f"http://127.0.0.1:{port}" in line
    assert "replica group small-0" in line
    assert "instance small-0" in line
    assert "limits local" in line
    assert "event loop uvloop" in line  # sidecar.event_loop "auto", and uvloop is a dependency
    assert "upstream http://127.0.0.1:" in line
    assert "hunter2" not in line
    assert "s3cret" not in line
