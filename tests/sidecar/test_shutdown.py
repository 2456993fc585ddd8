"""A sidecar process that is killed or told to stop: no request it admitted ends without a record.

Each test runs the simulator and the billing service (its DuckDB ledger) inside the test, and the
sidecar as a process of its own, so that SIGKILL and SIGTERM reach a real ``infermeter sidecar``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest
import yaml

from billing.serve import billing_server, open_ledger
from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from sidecar.drain import drain
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import running, serving, sidecar_process, stop_process
from tests.sidecar.conftest import KEYS

# The relay runs on uvloop in the sidecar process and on either loop in tests (conftest).
pytestmark = pytest.mark.both_loops

INGEST_TOKEN = "im-demo-ingest"
CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
BILLABLE = {"ok", "client_aborted", "upstream_error", "interrupted"}


class Fleet:
    """The simulator, billing and one sidecar process on loopback, with the paths they use."""

    def __init__(self, tmp_path: Path, **sidecar: Any) -> None:
        self.up_port, self.side_port, self.billing_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.side_port}"
        self.spool = tmp_path / "spool" / "small-0"
        self.ledger_path = tmp_path / "ledger.duckdb"
        data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
        data["replicas"][1].update(
            upstream_url=f"http://127.0.0.1:{self.up_port}",
            sidecar_listen=f"127.0.0.1:{self.side_port}",
        )
        data["simulator"]["engines"]["chat-small"].update(step_base_ms=5, step_per_seq_ms=0)
        data["teams"][0]["limits"] = {}
        # Billing takes the shared ingest token the sidecar ships with here.
        data["billing"].update(database=str(self.ledger_path), shared_ingest_token=True)
        data["sidecar"] = {
            "spool_dir": str(tmp_path / "spool"),
            "ingest_url": f"http://127.0.0.1:{self.billing_port}/v1/ingest",
            **sidecar,
        }
        self.config_path = tmp_path / "infermeter.yaml"
        self.config_path.write_text(yaml.safe_dump(data))
        self.config = Config.model_validate(data)
        self.upstream = _Counting(ReplicaSim(replica_spec(self.config, "small-0")))

    @property
    def upstream_requests(self) -> int:
        """Generation requests that reached vLLM."""
        return self.upstream.requests

    @contextlib.asynccontextmanager
    async def up(self) -> AsyncIterator[None]:
        """Serve the simulator and billing for the block; the ledger is closed at its end."""
        ledger = open_ledger(self.config)
        try:
            billing = billing_server(self.config, ledger, "127.0.0.1", self.billing_port)
            async with serving(self.upstream, self.up_port), running(billing):
                yield
        finally:
            ledger.close()

    def start_sidecar(self) -> subprocess.Popen[bytes]:
        """A sidecar process, once it answers /healthz."""
        env = {**os.environ, "INFERMETER_INGEST_TOKEN": INGEST_TOKEN}
        return sidecar_process(str(self.config_path), self.url, env=env)

    def client(self) -> httpx.AsyncClient:
        """A client of team search, with room for every test's streams."""
        return httpx.AsyncClient(
            base_url=self.url,
            timeout=60,
            limits=httpx.Limits(max_connections=400),
            headers={"authorization": f"Bearer {KEYS['search']}"},
        )

    def ledger(self) -> list[dict[str, Any]]:
        """Every usage row in the ledger (billing must be stopped)."""
        con = duckdb.connect(str(self.ledger_path), read_only=True)
        try:
            cur = con.execute("SELECT * FROM usage")
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        finally:
            con.close()

    def spooled(self) -> list[Path]:
        """Files still in the spool: segments and journals."""
        return [*self.spool.glob("seg-*.jsonl"), *self.spool.glob("journal/journal-*.log")]

    async def generation_tokens(self) -> float:
        """vLLM's own counter of generated tokens (the simulator's /metrics)."""
        async with httpx.AsyncClient() as c:
            text = (await c.get(f"http://127.0.0.1:{self.up_port}/metrics")).text
        line = next(x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total{"))
        return float(line.rsplit(" ", 1)[1])


class _Counting:
    """The simulated replica, counting the generation requests that reach it."""

    def __init__(self, app: ReplicaSim) -> None:
        self.app = app
        self.requests = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Count, then serve as the replica."""
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            self.requests += 1
        await self.app(scope, receive, send)


def content_events(body: bytes) -> int:
    """Generated-token events in an SSE body (not vLLM's empty role chunk)."""
    return sum(1 for e in body.split(b"\n\n") if b'"content":"' in e and b'"role"' not in e)


@pytest.mark.timeout(180)
async def test_kill_9_under_load_leaves_a_record_of_every_admitted_request(tmp_path):
    """After kill -9 and a restart, the ledger holds every request that reached vLLM, once each."""
    fleet = Fleet(tmp_path, journal_mark_millis=100)
    seen: list[str] = []  # ids the clients got in response headers
    async with fleet.up():
        proc = await asyncio.to_thread(fleet.start_sidecar)
        try:
            async with fleet.client() as c:

                async def one(i: int) -> None:
                    stream = i % 8 != 0
                    body = {
                        **CHAT,
                        "max_tokens": 50 + 4 * (i % 50) if stream else 20,
                        "stream": stream,
                    }
                    with contextlib.suppress(httpx.HTTPError):
                        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                            seen.append(r.headers["x-infermeter-request-id"])
                            await r.aread()

                async def killer() -> None:
                    deadline = time.monotonic() + 60
                    while len(seen) < 80 and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(1.0)  # streams under way, ticks written
                    os.kill(proc.pid, signal.SIGKILL)

                await asyncio.gather(killer(), *(one(i) for i in range(240)))
            proc.wait(10)
            generated = await fleet.generation_tokens()
            proc = await asyncio.to_thread(fleet.start_sidecar)
            deadline = time.monotonic() + 30
            # (The running sidecar keeps its own journal file open: only segments are awaited.)
            while list(fleet.spool.glob("seg-*.jsonl")) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        finally:
            # In a thread: billing runs on this event loop and must take the sidecar's last shipment.
            await asyncio.to_thread(stop_process, proc, 30)
    rows = fleet.ledger()
    billable = [r for r in rows if r["status"] in BILLABLE]
    interrupted = [r for r in billable if r["status"] == "interrupted"]
    assert not fleet.spooled()
    assert set(seen) <= {r["request_id"] for r in rows}
    assert {r["status"] for r in billable} <= {"ok", "interrupted"}
    assert interrupted, "the kill found no request running"
    assert any(r["completion_tokens"] for r in interrupted), "no progress was recorded"
    # Every request vLLM received has its record. Beyond those, only requests admitted but not yet
    # forwarded when the kill came: interrupted, with no tokens.
    never_sent = sum(
        1 for r in interrupted if not r["prompt_tokens"] and not r["completion_tokens"]
    )
    assert fleet.upstream_requests <= len(billable) <= fleet.upstream_requests + never_sent
    # Tokens: at most what vLLM generated; what is missing is at most, for each killed stream, what
    # vLLM had sent and the sidecar not yet read when it died (its slot has every chunk read: 40
    # tokens, 0.2 s at 5 ms a step, for a loaded machine), and for each killed non-streamed
    # request what came after the last tick (0.1 s: its whole output, 20 tokens, at most).
    ledger_tokens = sum(r["completion_tokens"] for r in billable)
    lost = sum(40 if r["stream"] else 20 for r in interrupted)
    assert generated - lost <= ledger_tokens <= generated


@pytest.mark.timeout(120)
async def test_sigterm_drains_streams_records_all_and_ships_the_spool(tmp_path):
    """SIGTERM with 10 streams: short ones finish, long ones end with an SSE error, all 10 are billed."""
    fleet = Fleet(tmp_path, drain_seconds=3, drain_ship_seconds=20)
    bodies: dict[str, bytes] = {}
    first_token = asyncio.Event()
    started: set[int] = set()
    async with fleet.up():
        proc = await asyncio.to_thread(fleet.start_sidecar)
        try:
            async with fleet.client() as c:

                async def one(i: int) -> None:
                    body = {**CHAT, "max_tokens": 100 if i < 5 else 4000, "stream": True}
                    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        rid = r.headers["x-infermeter-request-id"]
                        out = b""
                        async for part in r.aiter_bytes():
                            out += part
                            if b'"content":"' in out and i not in started:
                                started.add(i)
                                if len(started) == 10:
                                    first_token.set()
                        bodies[rid] = out

                streams = [asyncio.create_task(one(i)) for i in range(10)]
                await asyncio.wait_for(first_token.wait(), 30)
                stopped_at = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                ready = await c.get("/readyz")
                refused = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
                await asyncio.gather(*streams)
            exit_status = await asyncio.to_thread(proc.wait, 30)
            exited_after = time.monotonic() - stopped_at
        finally:
            await asyncio.to_thread(stop_process, proc, 30)
    assert ready.status_code == 503
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert exit_status == 0
    assert exited_after < 3 + 10
    assert not fleet.spooled(), "the spool was not shipped before exit"
    rows = {r["request_id"]: r for r in fleet.ledger()}
    assert set(bodies) <= set(rows)
    done = [rid for rid, b in bodies.items() if b.endswith(b"data: [DONE]\n\n")]
    cut = [rid for rid, b in bodies.items() if b'"code":"server_shutting_down"' in b]
    assert (len(done), len(cut)) == (5, 5)
    assert {rows[rid]["status"] for rid in done} == {"ok"}
    assert {rows[rid]["status"] for rid in cut} == {"interrupted"}
    for rid in cut:
        # Billed exactly what the client received: vLLM's counts up to the last chunk relayed.
        assert rows[rid]["usage_exact"]
        assert rows[rid]["completion_tokens"] == content_events(bodies[rid])
        assert 0 < rows[rid]["completion_tokens"] < 4000
        # vLLM's response id, the one in the chunks the client holds.
        assert f'"id":"{rows[rid]["response_id"]}"'.encode() in bodies[rid]


async def test_drain_ends_a_non_streamed_request_with_503_and_a_record(stack_factory):
    """Past the drain period a non-streamed request gets 503 server_shutting_down and an interrupted record.

    The request was read from vLLM as a stream (``sidecar.non_streamed_via_stream``), so its
    record has the tokens spent until the cut, exactly.
    """
    stack = await stack_factory(**{"simulator.engines.chat-small.step_base_ms": 5})
    async with stack.client() as c:
        long = asyncio.create_task(
            c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4000})
        )
        while stack.sidecar.journal.running == 0:
            await asyncio.sleep(0.01)
        await drain(stack.sidecar, 0.3)
        response = await long
        ready = await c.get("/readyz")
    assert ready.status_code == 503
    assert "shutting down" in ready.json()["problems"][0]
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "server_shutting_down"
    (record,) = await stack.records()
    assert record["request_id"] == response.headers["x-infermeter-request-id"]
    assert (record["status"], record["http_status"], record["usage_exact"]) == (
        "interrupted",
        503,
        True,
    )
    assert record["prompt_tokens"] > 0
    assert record["completion_tokens"] > 0
    assert record["response_id"].startswith("chatcmpl-")  # vLLM's, from its stream


async def test_drain_answers_requests_waiting_for_a_batch_slot(stack_factory):
    """Requests queued for a fair batch slot when the drain starts get 503, not a dropped connection."""
    stack = await stack_factory(
        **{"replicas.1.max_num_seqs": 4, "simulator.engines.chat-small.step_base_ms": 5}
    )
    assert stack.sidecar.fair is not None

    async def one(c: httpx.AsyncClient) -> tuple[int, bytes]:
        body = {**CHAT, "max_tokens": 4000, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            return r.status_code, await r.aread()

    async with stack.client() as c:
        calls = [asyncio.create_task(one(c)) for _ in range(5)]
        while stack.sidecar.journal.running < 3 or stack.sidecar.fair.waiting() < 2:
            await asyncio.sleep(0.01)
        await drain(stack.sidecar, 0.3)
        answers = await asyncio.gather(*calls)
    assert sorted(status for status, _ in answers) == [200, 200, 200, 503, 503]
    assert all(b"server_shutting_down" in body for _, body in answers)
    assert (
        sorted(r["status"] for r in (await stack.records()))
        == ["interrupted"] * 3 + ["rejected"] * 2
    )
