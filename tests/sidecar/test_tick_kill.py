"""kill -9 right after clients had their whole answers, before the tick wrote their records.

A real ``infermeter sidecar`` process, real HTTP on loopback, the simulator as vLLM. The journal's
tick is a minute, so when the sidecar is killed the records of the requests that ended wait in
memory, and only their journal slots hold how they ended. The restarted sidecar must make each of
them the complete record the killed one would have written: status ok, vLLM's counts as the client
saw them, the finish reason and the response id, once each.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

import httpx
import orjson
import pytest

from tests.sidecar.conftest import KEYS
from tests.sidecar.test_journal_kill import CHAT, Fleet

# (x-request-id, streamed, n)
REQUESTS = [
    ("stream-1", True, 1),
    ("stream-2", True, 2),
    ("whole-1", False, 1),
    ("whole-2", False, 2),
]


async def answer(fleet: Fleet, rid: str, stream: bool, n: int) -> dict[str, Any]:
    """One request read to its end; what the client saw of it: vLLM's id, usage, finish reason."""
    body: dict[str, Any] = {**CHAT, "max_tokens": 5, "stream": stream, "n": n}
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {KEYS['search']}", "x-request-id": rid}
    async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    if not stream:
        whole = r.json()
        return {
            "id": whole["id"],
            "usage": whole["usage"],
            "finish": whole["choices"][0]["finish_reason"],
        }
    assert r.content.endswith(b"data: [DONE]\n\n"), "the stream was not complete"
    seen: dict[str, Any] = {}
    for event in r.content.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        chunk = orjson.loads(event[6:])
        seen["id"] = chunk["id"]
        if chunk.get("usage"):
            seen["usage"] = chunk["usage"]
        for choice in chunk["choices"]:
            seen["finish"] = choice.get("finish_reason") or seen.get("finish")
    return seen


@pytest.mark.timeout(120)
async def test_kill_9_after_complete_answers_loses_no_record_and_doubles_none(tmp_path):
    """Killed after its clients had complete answers (streamed and not, one and two choices) and
    before the tick wrote their records, then restarted: each request has exactly one record, ok,
    with the tokens its client was told, its finish reason and its response id."""
    fleet = Fleet(tmp_path, journal_mark_millis=60_000)
    async with fleet.simulator():
        proc = await asyncio.to_thread(fleet.start_sidecar)
        try:
            seen = dict(
                zip(
                    [rid for rid, *_ in REQUESTS],
                    await asyncio.gather(*(answer(fleet, *r) for r in REQUESTS)),
                    strict=True,
                )
            )
            # The records wait for the tick: none is in the spool when the kill comes.
            assert fleet.records() == []
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            proc = await asyncio.to_thread(fleet.start_sidecar)
        finally:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(proc.wait, 30)
    records = fleet.records()
    assert sorted(r["client_request_id"] for r in records) == sorted(rid for rid, *_ in REQUESTS)
    assert not list((fleet.spool / "journal").iterdir())
    for record in records:
        rid = record["client_request_id"]
        client = seen[rid]
        assert (record["status"], record["http_status"], record["usage_exact"]) == (
            "ok",
            200,
            True,
        ), rid
        assert record["prompt_tokens"] == client["usage"]["prompt_tokens"] > 0, rid
        assert record["completion_tokens"] == client["usage"]["completion_tokens"] > 0, rid
        assert record["finish_reason"] == client["finish"] == "length", rid
        assert record["response_id"] == client["id"], rid
        assert record["finished_at"] >= record["received_at"], rid
        if record["stream"]:
            assert record["first_token_at"] is not None, rid
