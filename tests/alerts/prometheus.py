"""The Debian Prometheus server and promtool, run for real by the alert tests."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from infermeter.serving import free_port

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"


def require(binary: str) -> str:
    """``binary``'s path, or fail the test saying how to get it (never skip: it is the check)."""
    if not Path(binary).is_file() and shutil.which(Path(binary).name) is None:
        pytest.fail(
            f"{binary} is missing: install Debian's prometheus package "
            "(`make test` does, through scripts/system-deps.sh)"
        )
    return binary if Path(binary).is_file() else str(shutil.which(Path(binary).name))


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run promtool and return what it said."""
    return subprocess.run(
        [require(PROMTOOL), *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@contextlib.contextmanager
def running_prometheus(
    tmp_path: Path, scrape_configs: list[dict[str, Any]], rule_files: list[str]
) -> Iterator[str]:
    """A Prometheus server on a free loopback port, scraping and evaluating every second.

    Yields its base URL; the process is killed when the block ends, whatever happened.
    """
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": rule_files,
        "scrape_configs": scrape_configs,
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            require(PROMETHEUS),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, tmp_path / "prometheus.log")
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"prometheus was not ready within 30 s:\n{log.read_text()}")
