"""One team key cannot write unbounded bytes to the spool or mint unbounded metric series."""

from __future__ import annotations

import logging

import httpx
import pytest

from infermeter.spool import Spool, SpoolError
from tests.sidecar import conftest as sidecar_fixtures
from tests.sidecar.conftest import METRICS_TOKEN, Stack

# The replica-and-sidecar fixtures of the sidecar's own tests.
stack, stack_factory = sidecar_fixtures.stack, sidecar_fixtures.stack_factory

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HUGE_MODEL = 100_000  # characters of one model name


def _spool_bytes(stack: Stack) -> int:
    return sum(p.stat().st_size for p in stack.spool.glob("seg-*.jsonl"))


async def _metrics(stack: Stack) -> str:
    async with httpx.AsyncClient(base_url=stack.url) as c:
        r = await c.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
    assert r.status_code == 200
    return r.text


def _series(page: str) -> int:
    return sum(1 for line in page.splitlines() if line and not line.startswith("#"))


async def test_huge_unknown_model_names_stay_bounded(stack_factory):
    """Twenty requests naming 100 kB models: metrics, series and spool stay small, and each is a 404."""
    stack = await stack_factory(**{"teams.0.limits.requests_per_minute": 15})
    before = await _metrics(stack)
    statuses = []
    async with stack.client() as c:
        for i in range(20):
            model = f"{i:02d}" + "m" * HUGE_MODEL
            r = await c.post("/v1/chat/completions", json={**CHAT, "model": model})
            statuses.append(r.status_code)
            assert len(r.content) < 4096, "the refusal does not echo the name back"
    after = await _metrics(stack)
    # Refusals take nothing from the limits: past the 15 requests a minute, still 404s.
    assert statuses == [404] * 20
    assert len(after) < len(before) + 20_000
    assert _series(after) - _series(before) < 60
    assert _spool_bytes(stack) < 20 * 2048
    records = await stack.records()
    assert len(records) == 20
    assert all(len(r["model"]) <= 256 for r in records)


@pytest.mark.parametrize(
    ("body", "status"),
    [(b"{not json", 400), (b"[1, 2]", 400), (b"x" * 70_000, 413)],
    ids=["bad-json", "not-object", "too-large"],
)
async def test_refusals_take_nothing_from_the_request_limit(stack_factory, body, status):
    """400 and 413 refusals leave the team's requests per minute whole for the requests it serves."""
    stack = await stack_factory(
        **{"teams.0.limits.requests_per_minute": 3, "sidecar.max_body_bytes": 65_536}
    )
    async with stack.client() as c:
        got = [(await c.post("/v1/chat/completions", content=body)).status_code for _ in range(4)]
        served = [(await c.post("/v1/chat/completions", json=CHAT)).status_code for _ in range(4)]
    assert got == [status] * 4
    assert served == [200, 200, 200, 429]


async def test_metric_labels_name_only_registry_models(stack):
    """A refused unknown model is labelled "unknown", never with the name the client sent."""
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "made-up-model-xyz"})
    assert r.status_code == 404
    page = await _metrics(stack)
    assert "made-up-model-xyz" not in page
    assert 'model="unknown"' in page


async def _served_then_tick(stack: Stack, c: httpx.AsyncClient) -> int:
    """One request's status, then the tick that writes its record (which may find the spool full)."""
    status = (await c.post("/v1/chat/completions", json=CHAT)).status_code
    await stack.sidecar.accounting.flush()
    return status


async def test_full_spool_refuses_with_503(stack_factory):
    """When the spool reaches sidecar.spool_max_bytes, on_spool_failure: refuse answers 503."""
    stack = await stack_factory(**{"sidecar.spool_max_bytes": 4096})
    async with stack.client() as c:
        statuses = [await _served_then_tick(stack, c) for _ in range(20)]
    assert statuses[0] == 200
    assert statuses[-1] == 503
    assert _spool_bytes(stack) <= 4096


async def test_full_spool_serves_unmetered_when_told_to(stack_factory, caplog):
    """With on_spool_failure: serve_unmetered a full spool still serves, and says so loudly."""
    stack = await stack_factory(
        **{"sidecar.spool_max_bytes": 4096, "sidecar.on_spool_failure": "serve_unmetered"}
    )
    with caplog.at_level(logging.ERROR, logger="infermeter.sidecar"):
        async with stack.client() as c:
            statuses = [await _served_then_tick(stack, c) for _ in range(20)]
    assert statuses == [200] * 20
    assert _spool_bytes(stack) <= 4096
    assert any("UNMETERED" in r.getMessage() for r in caplog.records)


async def test_spool_size_cap_is_freed_by_acknowledgement(tmp_path):
    """A spool at max_bytes refuses appends until billing acknowledges a segment; a restart adopts the size."""
    spool = Spool(tmp_path, max_bytes=900)
    spool.open()
    try:
        for i in range(9):
            await spool.append({"i": i, "pad": "p" * 80})
        with pytest.raises(SpoolError, match="is full"):
            await spool.append({"i": 9, "pad": "p" * 80})
        spool._roll()
        (segment,) = await spool.closed_segments()
        spool.acknowledge(segment)
        await spool.append({"i": 9, "pad": "p" * 80})
    finally:
        await spool.close()
    reopened = Spool(tmp_path, max_bytes=900)
    reopened.open()
    try:
        assert reopened.size_bytes == sum(p.stat().st_size for p in tmp_path.glob("seg-*.jsonl"))
    finally:
        await reopened.close()


@pytest.mark.parametrize("shared", [False, True], ids=["local-bucket", "redis-bucket"])
async def test_refusals_take_nothing_from_the_token_limit(stack_factory, redis_server, shared):
    """A 70 kB body refused with 413 and two 400s leave the team's tokens per minute whole: after
    them the sidecar serves exactly what a sidecar that refused nothing serves (a 9 MiB body
    once emptied the bucket, 5,999,978 tokens to 2,162)."""
    changes = {"teams.0.limits.tokens_per_minute": 50, "sidecar.max_body_bytes": 65_536}

    async def served(refused_first: bool) -> list[int]:
        # (Redis given 2 s, not 100 ms: one slow answer on a loaded machine turns the sidecar to
        # its local fail-open share, and the two runs no longer count against the same bucket.)
        extra = (
            {
                "sidecar.shared_limits.redis_url": redis_server.url,
                "sidecar.shared_limits.timeout_millis": 2000,
            }
            if shared
            else {}
        )
        if shared:
            redis_server.flush()
        stack = await stack_factory(**changes, **extra)
        async with stack.client() as c:
            if refused_first:
                for body, status in ((b"x" * 70_000, 413), (b"{not json", 400), (b"[1, 2]", 400)):
                    r = await c.post("/v1/chat/completions", content=body)
                    assert r.status_code == status
            return [
                (await c.post("/v1/chat/completions", json=CHAT)).status_code for _ in range(12)
            ]

    expected = await served(refused_first=False)
    assert 200 in expected, expected
    assert 429 in expected, expected  # the bucket runs out within the run
    assert await served(refused_first=True) == expected
