"""Real servers on loopback for tests: free ports and uvicorn inside the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Literal

import uvicorn

from infermeter.netutil import free_port


@contextlib.asynccontextmanager
async def serving(
    app: Any, port: int | None = None, lifespan: Literal["auto", "on", "off"] = "on"
) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on loopback for the duration of the block; yields its URL."""
    port = port or free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
        http="httptools", lifespan=lifespan, timeout_graceful_shutdown=1,
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
