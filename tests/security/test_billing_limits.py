"""Billing against a hostile credential holder: body and stream limits, the statement cache,
per-caller read limits, and the server's connection, header and body deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config
from infermeter.records import KINDS
from infermeter.serving import free_port
from infermeter.wire import arrow_schema
from tests.billing.conftest import NOV, batch, usage
from tests.servers import running, serving

ADMIN, INGEST, SEARCH = "im-demo-admin", "im-demo-ingest", "im-demo-search"
MIB = 1 << 20


def with_billing(config: Config, **settings: Any) -> Config:
    """``config`` with billing settings replaced."""
    return config.model_copy(update={"billing": config.billing.model_copy(update=settings)})


@contextlib.asynccontextmanager
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """Billing served on loopback as ``infermeter billing`` serves it; yields its URL."""
    from billing.serve import billing_server

    async with running(billing_server(config, ledger, "127.0.0.1", free_port())) as url:
        yield url


def peak_rss_reset() -> None:
    """Reset this process's peak resident set size (Linux), so the next peak is measured afresh."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    """This process's peak resident set size since the last reset, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


async def exchange(
    url: str, head: bytes, chunks: AsyncIterator[bytes] | None = None, timeout: float = 10.0
) -> bytes:
    """Send ``head`` and then ``chunks`` on a raw connection; the answer, or what came before EOF.

    The answer is read while the body is still being sent, as a server may answer early.
    """
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))

    async def send() -> None:
        writer.write(head)
        if chunks is not None:
            async for chunk in chunks:
                writer.write(chunk)
                await writer.drain()

    async def receive() -> bytes:
        received = b""
        with contextlib.suppress(ConnectionError):
            while not complete(received) and (chunk := await reader.read(1 << 16)):
                received += chunk
        return received

    sending = asyncio.create_task(send())
    try:
        async with asyncio.timeout(timeout):
            return await receive()
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sending
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def complete(response: bytes) -> bool:
    """Whether ``response`` holds a whole HTTP response (head and its Content-Length of body)."""
    head, blank, body = response.partition(b"\r\n\r\n")
    if not blank:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return True


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP response."""
    return int(response.split(b" ", 2)[1])


async def test_a_body_over_the_cap_is_413_and_never_buffered(config, ledger):
    """A chunked body far over ``billing.max_body_bytes`` is 413 and the service's RSS does not grow by it."""
    config = with_billing(config, max_body_bytes=MIB)
    size = 96 * MIB
    chunk = b"x" * (MIB - 1) + b"\n"

    async def body() -> AsyncIterator[bytes]:
        for _ in range(size // MIB):
            yield b"%x\r\n%s\r\n" % (len(chunk), chunk)
        yield b"0\r\n\r\n"

    head = (
        b"POST /v1/ingest/usage HTTP/1.1\r\nhost: billing\r\n"
        b"authorization: Bearer " + INGEST.encode() + b"\r\n"
        b"content-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    async with billing(config, ledger) as url:
        peak_rss_reset()
        before = peak_rss()
        response = await exchange(url, head, body())
        grown = peak_rss() - before
    assert status_of(response) == 413
    assert b'"code":"body_too_large"' in response.replace(b" ", b"")
    assert grown < size // 4


async def test_a_declared_length_over_the_cap_is_413_before_the_body(config, ledger):
    """A Content-Length over ``billing.max_body_bytes`` is answered 413 with no body sent at all."""
    config = with_billing(config, max_body_bytes=MIB)
    head = (
        b"POST /v1/ingest HTTP/1.1\r\nhost: billing\r\n"
        b"authorization: Bearer " + INGEST.encode() + b"\r\n"
        b"content-length: %d\r\n\r\n" % (1 << 30)
    )
    async with billing(config, ledger) as url:
        response = await exchange(url, head, timeout=5.0)
    assert status_of(response) == 413


def bomb(rows: int, per_batch: int, text: int) -> tuple[bytes, int]:
    """A zstd Arrow stream of ``rows`` usage records whose request ids are ``text`` bytes each, and its decoded size.

    The same values over and over: far more decoded than on the wire.
    """
    schema = arrow_schema(KINDS["usage"])
    one = usage("search", NOV + 3600)
    one["request_id"] = "r" * text
    columns = [pa.array([one[f.name]] * per_batch, type=f.type) for f in schema]
    record_batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, schema, options=options) as writer:
        for _ in range(rows // per_batch):
            writer.write_batch(record_batch)
    encoded: bytes = sink.getvalue().to_pybytes()
    return encoded, record_batch.nbytes * (rows // per_batch)


@pytest.mark.parametrize(
    ("rows", "per_batch", "text"),
    [(1_000_000, 25_000, 8), (40_000, 1_000, 8_192), (20_000, 20_000, 8_192)],
    ids=["too-many-records", "too-many-bytes", "one-batch-too-many-bytes"],
)
async def test_a_zstd_bomb_is_refused_before_it_is_decoded(config, ledger, rows, per_batch, text):
    """An Arrow stream small on the wire but over the record or byte limits decoded is 413, never decoded whole."""
    config = with_billing(config, max_body_bytes=32 * MIB, max_batch_records=100_000)
    body, decoded = bomb(rows, per_batch, text)
    assert len(body) * 5 < decoded
    async with billing(config, ledger) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        peak_rss_reset()
        before = peak_rss()
        r = await c.post(
            "/v1/ingest/usage",
            content=body,
            headers={
                "authorization": f"Bearer {INGEST}",
                "content-type": "application/vnd.apache.arrow.stream",
            },
        )
        grown = peak_rss() - before
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "batch_too_large"
    # Beyond the body itself, which the client holds and the server receives (client and server
    # share this process, so allocator noise is in the figure): far below one decoded copy.
    assert grown - 2 * len(body) < decoded // 2


async def test_many_months_do_not_grow_the_statement_cache_past_its_bound(config, ledger):
    """A team asking for many months leaves at most ``billing.statement_cache_entries`` statements cached."""
    config = with_billing(config, statement_cache_entries=3, read_burst=1000)
    app = create_app(config, ledger)
    async with serving(app, lifespan="off") as url, httpx.AsyncClient(base_url=url) as c:
        for month in range(1, 13):
            r = await c.get(
                f"/v1/query/statement/2025-{month:02d}",
                headers={"authorization": f"Bearer {SEARCH}"},
            )
            assert r.status_code == 200
    assert len(app.state.services.statements) == 3


def computations(metrics: str) -> float:
    """``infermeter_billing_statement_computations_total`` from a /metrics text."""
    for line in metrics.splitlines():
        if line.startswith("infermeter_billing_statement_computations_total"):
            return float(line.split()[-1])
    raise AssertionError("no infermeter_billing_statement_computations_total in /metrics")


async def test_concurrent_identical_requests_compute_the_statement_once(config, ledger):
    """Twenty concurrent requests for a month's statement cause one computation, which all of them get."""
    config = with_billing(config, read_burst=1000)
    async with serving(create_app(config, ledger), lifespan="off") as url:
        async with httpx.AsyncClient(
            base_url=url, headers={"authorization": f"Bearer {INGEST}"}
        ) as c:
            r = await c.post("/v1/ingest", content=batch("usage", [usage("search", NOV + 3600)]))
            assert r.status_code == 200
        async with httpx.AsyncClient(
            base_url=url, headers={"authorization": f"Bearer {ADMIN}"}
        ) as c:
            before = computations((await c.get("/metrics")).text)
            answers = await asyncio.gather(
                *(c.get("/v1/query/statement/2026-11") for _ in range(20))
            )
            after = computations((await c.get("/metrics")).text)
    assert {r.status_code for r in answers} == {200}
    assert len({r.content for r in answers}) == 1
    assert after - before == 1


async def test_a_team_hammering_gets_429_while_the_admin_ingest_and_scrapes_do_not(config, ledger):
    """Past its burst a team key is 429 with Retry-After; the admin, ingest and /metrics are unaffected."""
    config = with_billing(config, read_burst=5, read_rate_per_second=0.5)
    async with (
        serving(create_app(config, ledger), lifespan="off") as url,
        httpx.AsyncClient(base_url=url) as c,
    ):
        team = [
            await c.get("/v1/query", headers={"authorization": f"Bearer {SEARCH}"})
            for _ in range(10)
        ]
        admin = await c.get("/v1/query", headers={"authorization": f"Bearer {ADMIN}"})
        ingest = [
            await c.post(
                "/v1/ingest",
                content=batch("usage", [usage("search", NOV + 3600)]),
                headers={"authorization": f"Bearer {INGEST}"},
            )
            for _ in range(10)
        ]
        scrapes = [
            await c.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"}) for _ in range(10)
        ]
    assert [r.status_code for r in team] == [200] * 5 + [429] * 5
    assert team[-1].json()["error"]["code"] == "rate_limited"
    assert 1 <= int(team[-1].headers["retry-after"]) <= 3
    assert admin.status_code == 200
    assert {r.status_code for r in ingest + scrapes} == {200}


async def test_a_client_trickling_its_headers_is_cut_off(config, ledger):
    """A connection whose request headers are not complete within the header deadline is closed."""
    config = with_billing(config, header_timeout_seconds=1.0)

    async def trickle() -> AsyncIterator[bytes]:
        for _ in range(50):
            yield b"x-slow: 1\r\n"
            await asyncio.sleep(0.2)

    async with billing(config, ledger) as url:
        started = time.monotonic()
        await exchange(url, b"GET /healthz HTTP/1.1\r\nhost: billing\r\n", trickle())
        took = time.monotonic() - started
    assert took < 5.0


async def test_a_kept_alive_connection_serves_request_after_request_under_the_header_deadline(
    config, ledger
):
    """Requests a little apart on one connection are all served: the deadline restarts with each."""
    config = with_billing(config, header_timeout_seconds=1.0)
    async with billing(config, ledger) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        statuses = []
        try:
            for _ in range(3):
                writer.write(b"GET /healthz HTTP/1.1\r\nhost: billing\r\n\r\n")
                answer = b""
                while not complete(answer):
                    answer += await asyncio.wait_for(reader.read(1 << 16), 5)
                statuses.append(status_of(answer))
                await asyncio.sleep(0.6)
        finally:
            writer.close()
    assert statuses == [200, 200, 200]


async def test_a_client_trickling_its_body_is_cut_off(config, ledger):
    """An ingest body not received within ``billing.body_read_timeout_seconds`` is answered 408."""
    config = with_billing(config, body_read_timeout_seconds=1.0)

    async def trickle() -> AsyncIterator[bytes]:
        for _ in range(50):
            yield b"{"
            await asyncio.sleep(0.2)

    head = (
        b"POST /v1/ingest/usage HTTP/1.1\r\nhost: billing\r\n"
        b"authorization: Bearer " + INGEST.encode() + b"\r\n"
        b"content-type: application/x-ndjson\r\ncontent-length: 1000\r\n\r\n"
    )
    async with billing(config, ledger) as url:
        started = time.monotonic()
        response = await exchange(url, head, trickle())
        took = time.monotonic() - started
    assert status_of(response) == 408
    assert took < 5.0


async def test_connections_past_the_cap_are_turned_away(config, ledger):
    """With ``billing.max_connections`` connections open, one more is closed unanswered; then served."""
    config = with_billing(config, max_connections=4)
    async with billing(config, ledger) as url:
        host, port = url.removeprefix("http://").split(":")
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
        try:
            await asyncio.sleep(0.1)
            response = await exchange(url, b"GET /healthz HTTP/1.1\r\nhost: billing\r\n\r\n")
        finally:
            for _, writer in idle:
                writer.close()
        await asyncio.sleep(0.2)
        after = await exchange(url, b"GET /healthz HTTP/1.1\r\nhost: billing\r\n\r\n")
    assert response == b""  # closed as soon as accepted: it holds nothing of the server
    assert status_of(after) == 200
