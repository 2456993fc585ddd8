"""small-0's and small-1's sidecars as real ``infermeter sidecar`` processes in front of one
simulated replica: for the tests of what a fleet's sidecars share (Redis) or judge apart (their
clocks)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import serving, wait_healthy

__all__ = ["SKEWED", "TwoSidecars"]

# A sidecar's clock, started ``offset`` seconds from the real one (Python's ``time.time``, which
# stamps its records): ``python -c SKEWED OFFSET sidecar ...``.
SKEWED = (
    "import runpy, sys, time; _real = time.time; _off = float(sys.argv.pop(1)); "
    "time.time = lambda: _real() + _off; sys.argv[0] = 'launcher'; "
    "runpy.run_module('launcher', run_name='__main__', alter_sys=True)"
)
REPLICAS = ("small-0", "small-1")


class TwoSidecars:
    """The embedded configuration with ``search`` (the first team) updated by ``search`` and the
    ``sidecar`` section given (its spool under ``tmp_path``), written where the processes read
    it; small-0 and small-1 on free ports, both in front of one simulated replica."""

    def __init__(self, tmp_path: Path, sidecar: dict[str, Any], search: dict[str, Any]) -> None:
        self.up_port = free_port()
        self.urls: list[str] = []
        data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
        for r in data["replicas"]:
            if r["id"] in REPLICAS:
                port = free_port()
                r.update(
                    upstream_url=f"http://127.0.0.1:{self.up_port}",
                    sidecar_listen=f"127.0.0.1:{port}",
                )
                self.urls.append(f"http://127.0.0.1:{port}")
        data["teams"][0].update(search)
        self.spool = tmp_path / "spool"
        data["sidecar"] = {"spool_dir": str(self.spool), **sidecar}
        self.config = Config.model_validate(data)
        self.path = tmp_path / "infermeter.yaml"
        self.path.write_text(yaml.safe_dump(data))

    @contextlib.asynccontextmanager
    async def running(self, offsets: tuple[float, float] = (0.0, 0.0)) -> AsyncIterator[list[str]]:
        """Both sidecars up, their clocks ``offsets`` seconds off; yields their URLs."""
        procs: list[subprocess.Popen[bytes]] = []
        async with serving(ReplicaSim(replica_spec(self.config, REPLICAS[0])), self.up_port):
            try:
                for replica, url, offset in zip(REPLICAS, self.urls, offsets, strict=True):
                    argv = [sys.executable, "-c", SKEWED, repr(offset)]
                    argv += ["sidecar", "--config", str(self.path), "--replica", replica]
                    procs.append(subprocess.Popen(argv))
                    await asyncio.to_thread(wait_healthy, procs[-1], url, 30.0, replica)
                yield self.urls
            finally:
                for p in procs:
                    p.kill()
                    await asyncio.to_thread(p.wait)
