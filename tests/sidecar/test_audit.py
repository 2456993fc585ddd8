"""A sidecar's audit events (a budget override) are spooled before they count and reach billing's
audit trail, also when billing was down when they happened. Real billing on a DuckDB file, a real
sidecar in front of a simulated replica, on loopback."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from infermeter.audit_spool import AUDIT_DIR
from infermeter.serving import free_port
from tests.sidecar.test_keysync import billing_at

ADMIN = {"authorization": "Bearer im-demo-admin"}
OVERRIDE = {"team": "search", "minutes": 5, "reason": "launch day"}


async def trail(billing: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=billing) as client:
        events: list[dict[str, Any]] = (await client.get("/v1/audit", headers=ADMIN)).json()[
            "events"
        ]
    return events


async def test_a_budget_override_granted_while_billing_is_down_reaches_the_audit_trail(
    stack_factory, tmp_path, monkeypatch
):
    """The override is granted (201) with billing down; its event waits in the sidecar's audit
    spool, and is on billing's trail, once, soon after billing is up: who, from where, why."""
    monkeypatch.setenv("INFERMETER_INGEST_TOKEN", "im-demo-ingest")
    port = free_port()
    billing = f"http://127.0.0.1:{port}"
    stack = await stack_factory(**{"sidecar.ingest_url": f"{billing}/v1/ingest"})
    async with httpx.AsyncClient(base_url=stack.url) as client:
        granted = await client.post("/v1/admin/budget-overrides", headers=ADMIN, json=OVERRIDE)
    assert granted.status_code == 201
    spooled = b"".join(p.read_bytes() for p in (stack.spool / AUDIT_DIR).glob("seg-*.jsonl"))
    assert b'"budget.override"' in spooled
    async with billing_at(port, tmp_path / "ledger.duckdb") as url:
        deadline = time.monotonic() + 30
        while not (events := await trail(url)):
            assert time.monotonic() < deadline, "the event did not arrive"
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.5)  # another shipping round adds nothing
        assert len(await trail(url)) == 1
    [event] = events
    assert (event["action"], event["actor"], event["target"], event["why"]) == (
        "budget.override",
        "@admin",
        "team:search",
        "launch day",
    )
    assert event["address"] == "127.0.0.1"
    assert event["source"] == "@ingest"  # the sender billing authenticated, not what the line says
