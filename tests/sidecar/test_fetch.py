"""The sidecar's GETs to its replica (/health, /v1/models, /metrics) on the protocol pool."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from infermeter.serving import free_port
from sidecar.direct import Pools
from sidecar.fetch import fetch
from sidecar.pool import UpstreamError
from sidecar.upstream import upstream_errors, upstream_failure
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
    pool = stack.sidecar.relay.pools.get(stack.upstream)
    assert pool is not None
    assert len(pool[0]._all) == 1, "the GETs share one kept-alive connection"


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


async def test_an_https_replica_is_fetched_with_httpx_and_fails_as_an_upstream_error() -> None:
    """The pool speaks plain HTTP only: an https base takes httpx, whose error comes back as the
    pool's own, with httpx's as its cause."""
    with pytest.raises(UpstreamError) as caught:
        await fetch(Pools(1.0, 5.0), f"https://127.0.0.1:{free_port()}", "/health", {}, 2.0)
    assert isinstance(caught.value, upstream_errors())
    assert isinstance(caught.value.__cause__, httpx.ConnectError)
    assert upstream_failure(caught.value)[0] == 502
