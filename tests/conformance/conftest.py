"""Fixtures of the conformance tests that go through a sidecar."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn

from infermeter.serving import free_port
from sidecar.app import Sidecar
from tests.conformance.sidecar_front import sidecar_config
from tests.servers import running, serving


@pytest.fixture(params=["own server", "plain uvicorn"])
async def sidecar(
    real_vllm: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[str, Sidecar]]:
    """A sidecar in front of real vLLM; its URL and itself. Served by its own server (the client
    connection's raw writer) and by plain uvicorn (ASGI messages only, ``sidecar.send_writer``):
    the relay's two client paths on its one upstream transport."""
    app = Sidecar(sidecar_config(real_vllm), "small-0", spool_dir=tmp_path)
    if request.param == "own server":
        server = serving(app)
    else:
        config = uvicorn.Config(app, "127.0.0.1", free_port(), lifespan="on", log_level="warning")
        server = running(uvicorn.Server(config))
    async with server as url:
        yield url, app
