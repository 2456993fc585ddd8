"""Real servers on loopback for tests: free ports, each app on the server it runs on in production.

A sidecar is served by its own server (``sidecar.http_server``), every other app by uvicorn
(``infermeter.serving.server``), inside the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

import httpx
import uvicorn

from infermeter.serving import DEFAULT_LIMITS, ServerLimits, free_port, server as serve
from sidecar.app import Sidecar
from sidecar.http_server import HttpServer


@contextlib.asynccontextmanager
async def serving(
    app: Any,
    port: int | None = None,
    lifespan: Literal["auto", "on", "off"] = "on",
    limits: ServerLimits = DEFAULT_LIMITS,
) -> AsyncIterator[str]:
    """Serve ``app`` on loopback, with the settings of every infermeter server, for the duration of the block; yields its URL."""
    port = port or free_port()
    built: uvicorn.Server | HttpServer
    if isinstance(app, Sidecar):
        built = HttpServer(app, "127.0.0.1", port, limits=limits, lifespan=lifespan != "off")
    else:
        built = serve(app, "127.0.0.1", port, lifespan=lifespan, limits=limits)
    async with running(built) as url:
        yield url


@contextlib.asynccontextmanager
async def running(server: uvicorn.Server | HttpServer) -> AsyncIterator[str]:
    """Run an already built server inside the test's event loop; yields its URL."""
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        if isinstance(server, HttpServer):
            yield server.url
        else:
            yield f"http://{server.config.host}:{server.config.port}"
    finally:
        server.should_exit = True
        await task


def sidecar_process(
    config_path: str,
    url: str,
    replica: str = "small-0",
    seconds: float = 30.0,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``infermeter sidecar`` for ``replica`` as a process (with ``env`` for its environment, when
    given), once it answers ``url``/healthz; killed, and an AssertionError, when it exits first or
    does not answer within ``seconds``."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "sidecar",
            "--config",
            config_path,
            "--replica",
            replica,
        ],
        env=env,
    )
    try:
        wait_healthy(proc, url, seconds, what="the sidecar")
    except AssertionError:
        proc.kill()
        proc.wait()
        raise
    return proc


def wait_healthy(
    process: subprocess.Popen[Any], url: str, seconds: float = 30.0, what: str = "the service"
) -> None:
    """Return once ``url``/healthz answers 200; an AssertionError when ``process`` exits first
    or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        assert process.poll() is None, f"{what} exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{what} did not answer in {seconds:g} s"
        time.sleep(0.1)


def stop_process(process: subprocess.Popen[Any] | None, grace: float = 20.0) -> None:
    """Stop ``process`` as an orchestrator does: SIGTERM, then SIGKILL after ``grace`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
