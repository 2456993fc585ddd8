"""A writer that gives up on a batch mid-body (its timeout, while billing was paused) is not a
fault of billing: no traceback, no 500, and billing goes on serving."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import httpx

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config
from tests.servers import serving

HEAD = (
    b"POST /v1/ingest HTTP/1.1\r\nhost: billing\r\nauthorization: Bearer im-demo-ingest\r\n"
    b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
)


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_body_cut_off_by_its_client_is_no_server_error(
    config: Config, ledger: Ledger
) -> None:
    """The client sends part of an ingest body and hangs up: billing logs no error and still answers."""
    kept = _Kept()
    # Where the server reports a fault of the app; its handlers are set as the server starts.
    server_log = logging.getLogger("uvicorn.error")
    async with serving(create_app(config, ledger), lifespan="off") as url:
        server_log.addHandler(kept)
        try:
            parts = urlsplit(url)
            assert parts.hostname is not None
            assert parts.port is not None
            _, writer = await asyncio.open_connection(parts.hostname, parts.port)
            writer.write(HEAD + b'{"usage": [')
            await writer.drain()
            await asyncio.sleep(0.2)  # the route is reading the body
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(base_url=url) as client:
                assert (await client.get("/healthz")).status_code == 200
        finally:
            server_log.removeHandler(kept)
    assert [r.getMessage() for r in kept.records if r.levelno >= logging.ERROR] == []
