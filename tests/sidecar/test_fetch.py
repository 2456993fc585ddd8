"""The sidecar's GETs to its replica (/health, /v1/models, /metrics) on the protocol pool."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from infermeter.serving import free_port
from sidecar.direct import Pools
from sidecar.fetch import fetch
from sidecar.pool import UpstreamError
from sidecar.upstream import UPSTREAM_ERRORS, upstream_failure
from tests.servers import serving
from tests.sidecar.conftest import METRICS_TOKEN, StackFactory

pytestmark = pytest.mark.both_loops


async def test_readiness_models_and_engine_metrics_come_through_the_pool(
    stack_factory: StackFactory,
) -> None:
    """The three GETs answer from the replica, reusing one pooled connection."""
    stack = await stack_factory()
    async with stack.client() as c:
        ready = await c.get("/readyz")
        models = await c.get("/v1/models")
        engine = await c.get(
            "/engine/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}
        )
        ready_again = await c.get("/readyz")
    assert ready.json() == ready_again.json() == {"ready": True, "problems": []}
    assert models.status_code == 200
    assert "chat-small" in {m["id"] for m in models.json()["data"]}
    assert engine.status_code == 200
    assert engine.headers["content-type"].startswith("text/plain")
    assert "vllm:num_requests_running" in engine.text
    pool = stack.sidecar.relay.pools.get(stack.upstream).pool
    assert len(pool._all) == 1, "the GETs share one kept-alive connection"


async def test_an_unreachable_replica_is_not_ready_and_its_model_list_is_502(
    stack_factory: StackFactory,
) -> None:
    stack = await stack_factory()
    stack.sidecar.upstream = f"http://127.0.0.1:{free_port()}"
    async with stack.client() as c:
        ready = await c.get("/readyz")
        models = await c.get("/v1/models")
    assert ready.status_code == 503
    [problem] = ready.json()["problems"]
    assert problem.startswith("upstream unreachable: ")
    assert models.status_code == 502
    assert models.json()["error"]["code"] == "upstream_unreachable"


async def test_a_replica_that_does_not_answer_health_in_time_is_not_ready(
    stack_factory: StackFactory,
) -> None:
    """/readyz gives the replica 2 s: a /health that hangs is a problem, not a hung probe."""
    hung = asyncio.Event()

    async def silent(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await hung.wait()

    stack = await stack_factory(upstream_app=silent)
    try:
        async with stack.client() as c:
            ready = await asyncio.wait_for(c.get("/readyz"), 10)
    finally:
        hung.set()
    assert ready.status_code == 503
    assert ready.json()["problems"] == ["upstream unreachable: TimeoutError"]


async def test_a_body_and_status_are_passed_on_whole() -> None:
    """A large body in many reads and a non-200 status reach the caller as the replica sent them."""
    page = b"x" * 300_000

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        status = 200 if scope["path"] == "/big" else 418
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        for i in range(0, len(page), 65_536):
            await send(
                {"type": "http.response.body", "body": page[i : i + 65_536], "more_body": True}
            )
        await send({"type": "http.response.body", "body": b""})

    port = free_port()
    pools = Pools(1.0, 5.0)
    async with serving(app, port, lifespan="off"):
        big = await fetch(pools, f"http://127.0.0.1:{port}", "/big", {}, 5.0)
        teapot = await fetch(pools, f"http://127.0.0.1:{port}", "/teapot", {}, 5.0)
    await pools.close()
    assert (big.status, big.content_type, big.body) == (200, b"text/plain", page)
    assert teapot.status == 418


def _certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl's command-line tool)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=replica",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.asynccontextmanager
async def _https_replica(cert: Path, key: Path, seen: list[bytes]) -> AsyncIterator[str]:
    """A replica on TLS that answers every request ``ok``, keeping each request's head."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                seen.append(head)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                             b"content-length: 2\r\n\r\nok")  # fmt: skip
                await writer.drain()
        writer.close()

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"https://user:p%40ss@127.0.0.1:{port}/base"


async def test_an_https_replica_is_spoken_to_over_tls_with_its_url_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An https upstream takes the same pool over TLS, its certificate checked against the
    trusted CAs; the URL's path prefixes every request and its user and password go as Basic
    credentials unless the request carries its own."""
    cert, key = _certificate(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # read when the pool makes its SSL context
    seen: list[bytes] = []
    pools = Pools(1.0, 5.0)
    async with _https_replica(cert, key, seen) as base:
        first = await fetch(pools, base, "/health", {}, 5.0)
        second = await fetch(pools, base, "/v1/models", {"authorization": "Bearer k"}, 5.0)
        assert len(pools.get(base).pool._all) == 1, "one kept-alive TLS connection"
    await pools.close()
    assert (first.status, first.body, second.status) == (200, b"ok", 200)
    assert seen[0].startswith(b"GET /base/health HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"authorization: Basic " + base64.b64encode(b"user:p@ss") in seen[0]
    assert seen[1].startswith(b"GET /base/v1/models ")
    assert b"authorization: Bearer k\r\n" in seen[1]
    assert b"Basic" not in seen[1]


async def test_an_https_replica_with_an_untrusted_certificate_is_an_upstream_error(
    tmp_path: Path,
) -> None:
    """A certificate no trusted CA signed fails the connection: a 502, as a refused one."""
    cert, key = _certificate(tmp_path)
    async with _https_replica(cert, key, []) as base:
        with pytest.raises(UpstreamError) as caught:
            await fetch(Pools(1.0, 5.0), base, "/health", {}, 2.0)
    assert isinstance(caught.value, UPSTREAM_ERRORS)
    assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)
    assert upstream_failure(caught.value)[0] == 502
