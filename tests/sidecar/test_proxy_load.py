"""The sidecar under load: many streams, a flooding team, and a kill -9 in the middle."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from infermeter.config import DEFAULT_CONFIG
from infermeter.records import KINDS
from infermeter.serving import free_port
from infermeter.spool import read_segment
from infermeter.wire import ARROW_STREAM, decode_arrow
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import serving, sidecar_process, stop_process
from tests.sidecar.conftest import KEYS, METRICS_TOKEN, make_config

# The relay runs on uvloop in the sidecar process and on either loop in tests (conftest).
pytestmark = pytest.mark.both_loops

CHAT = {
    "model": "chat-small",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 20,
    "ignore_eos": True,
}


async def test_a_thousand_concurrent_streams_without_error(tmp_path):
    """1000 concurrent streamed requests through one sidecar process all complete and are recorded."""
    up_port, side_port = free_port(), free_port()
    upstream, url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{side_port}"
    path = _sidecar_config(
        tmp_path,
        upstream,
        f"127.0.0.1:{side_port}",
        None,
        replica={"max_num_seqs": 1024},
        engine={"step_base_ms": 5, "step_per_seq_ms": 0.01},
    )
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher",
            "simulate",
            "--config",
            str(path),
            "--replica",
            "small-0",
        ]
    )
    proc = None
    try:
        await asyncio.to_thread(_wait_up, f"{upstream}/health")
        proc = await asyncio.to_thread(sidecar_process, str(path), url)
        limits = httpx.Limits(max_connections=1100, max_keepalive_connections=1100)
        async with httpx.AsyncClient(
            base_url=url,
            headers={"authorization": f"Bearer {KEYS['search']}"},
            timeout=120,
            limits=limits,
        ) as c:

            async def one() -> bool:
                async with c.stream(
                    "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
                ) as r:
                    body = await r.aread()
                return r.status_code == 200 and body.endswith(b"data: [DONE]\n\n")

            results = await asyncio.gather(*(one() for _ in range(1000)))
    finally:
        for p in (proc, sim):
            stop_process(p)
    assert sum(results) == 1000
    records = [
        r
        for seg in (tmp_path / "spool" / "small-0").glob("seg-*.jsonl")
        for r in read_segment(seg)[0]
    ]
    assert len(records) == 1000
    assert {r["status"] for r in records} == {"ok"}
    assert sum(r["completion_tokens"] for r in records) == 20_000


def _wait_up(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


async def _ttft(client: httpx.AsyncClient, team_key: str) -> float:
    start = time.perf_counter()
    body = {**CHAT, "stream": True, "max_tokens": 8}
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {team_key}"}
    ) as r:
        async for line in r.aiter_lines():
            if '"content":"' in line and '"role"' not in line:
                return time.perf_counter() - start
    raise AssertionError("no token")


async def _p95_under_flood(
    stack: Any, flood: int, rounds: int = 30, flood_tokens: int = 400
) -> float:
    """p95 TTFT of two well-behaved teams while analytics keeps ``flood`` long requests going."""
    stop = asyncio.Event()
    async with httpx.AsyncClient(
        base_url=stack.url, timeout=120, limits=httpx.Limits(max_connections=flood + 20)
    ) as c:

        async def flooder() -> None:
            body = {**CHAT, "max_tokens": flood_tokens}
            while not stop.is_set():
                await c.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {KEYS['analytics']}"},
                )

        tasks = [asyncio.create_task(flooder()) for _ in range(flood)]
        await asyncio.sleep(1.0 if flood else 0)
        samples = []
        for _ in range(rounds):
            for team in ("search", "assistant"):
                samples.append(await _ttft(c, KEYS[team]))
                await asyncio.sleep(0.02)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return statistics.quantiles(samples, n=20)[18]


FLOOD_TEAMS: dict[str, Any] = {"teams.2.limits": {}, "teams.0.limits": {}, "teams.1.limits": {}}
# The demo fleet's own chat-small timing (9 ms a step + 0.12 ms per running sequence), with KV
# room for the whole flood, so a slow batch comes from batching, not from preemption.
SLOW_ENGINE = {
    "simulator.engines.chat-small": {
        "step_base_ms": 9,
        "step_per_seq_ms": 0.12,
        "prefill_tokens_per_second": 30000,
        "kv_cache_tokens": 400000,
    }
}


async def test_a_flooding_team_does_not_starve_the_others(stack_factory):
    """With analytics at 10x the replica's capacity, other teams' p95 TTFT stays within 2x, plus
    the one engine step a request admitted to a busy engine waits for (an idle engine steps at
    once; a full batch's step is 9 + 0.12 x 16 ms here). Starving them would cost the seconds a
    400-token flood request holds its slot.

    Client, sidecar and simulated replica share this process and a 2-core machine with the
    rest of the suite, so one measurement can catch a scheduler hiccup; the pair of
    measurements is taken up to three times and one within the bound passes. Starvation is
    not a hiccup: without fair share every attempt is far over the bound.
    """
    seqs = 16
    stack = await stack_factory(**{"replicas.1.max_num_seqs": seqs, **FLOOD_TEAMS, **SLOW_ENGINE})
    engine = SLOW_ENGINE["simulator.engines.chat-small"]
    busy_step = (engine["step_base_ms"] + engine["step_per_seq_ms"] * seqs) / 1000
    attempts = []
    for _ in range(3):
        unloaded = await _p95_under_flood(stack, 0)
        loaded = await _p95_under_flood(stack, 160)
        attempts.append((unloaded, loaded))
        print(
            f"\nfair share on: p95 TTFT unloaded {unloaded * 1000:.1f} ms, flooded {loaded * 1000:.1f} ms"
        )
        if loaded <= 2 * unloaded + busy_step:
            break
    assert any(loaded <= 2 * unloaded + busy_step for unloaded, loaded in attempts), attempts


async def test_a_request_of_several_choices_takes_a_slot_for_each(stack_factory):
    """The fair share counts sequences, as vLLM's ``max_num_seqs`` does: a team's two requests
    of n=8 on a replica of 16 hold 8 sequences, not 2 requests, so the second waits in the
    sidecar, vLLM's batch keeps room, and another team's first request goes straight in. (Counted
    as requests, both ran, vLLM's 16 slots were full, and the other team queued behind them.)"""
    stack = await stack_factory(**{"replicas.1.max_num_seqs": 16, **FLOOD_TEAMS, **SLOW_ENGINE})
    fair = stack.sidecar.fair
    assert fair is not None
    body = {**CHAT, "max_tokens": 300, "ignore_eos": True, "n": 8}
    async with stack.client("analytics") as c:
        flood = [asyncio.create_task(c.post("/v1/chat/completions", json=body)) for _ in range(2)]
        for _ in range(500):  # both admitted or waiting, at most 5 s
            if fair.waiting("analytics") + min(1, fair.in_flight.get("analytics", 0)) >= 2 or (
                fair.in_flight.get("analytics", 0) >= 2 and fair.waiting("analytics") == 0
            ):
                break
            await asyncio.sleep(0.01)
        assert (fair.in_flight["analytics"], fair.waiting("analytics")) == (8, 1)
        async with stack.client("search") as s:
            first = await s.post("/v1/chat/completions", json=CHAT)
        assert first.status_code == 200
        # The other team's request ran beside the first of n=8, the second still waiting.
        assert not all(t.done() for t in flood)
        assert fair.waiting("analytics") == 1
        for answer in await asyncio.gather(*flood):
            assert answer.status_code == 200
            assert len(answer.json()["choices"]) == 8


def _sidecar_config(
    tmp_path: Path,
    upstream: str,
    listen: str,
    ingest: str | None,
    replica: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
) -> Path:
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["replicas"][1].update(upstream_url=upstream, sidecar_listen=listen, **(replica or {}))
    data["simulator"]["engines"]["chat-small"].update(engine or {})
    data["teams"][0]["limits"] = {}
    data["sidecar"] = {"spool_dir": str(tmp_path / "spool"), "ingest_url": ingest}
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def test_kill_9_loses_no_completed_response_and_duplicates_none(tmp_path):
    """Records of every response a client saw complete survive kill -9, once each, and ship after restart."""
    up_port, side_port = free_port(), free_port()
    upstream, url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{side_port}"
    received: dict[str, int] = {}
    statuses: dict[str, str] = {}

    async def ingest(scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["path"].endswith("/instances"):
            ids, status = [], []  # the sidecar's lifetime events: not what this test counts
        elif dict(scope["headers"]).get(b"content-type") == ARROW_STREAM.encode():
            table = decode_arrow(KINDS["usage"], body)
            ids, status = table.column("request_id").to_pylist(), table.column("status").to_pylist()
        else:  # NDJSON, for batches that do not convert exactly
            lines = [orjson.loads(line) for line in body.splitlines()]
            ids, status = [r["request_id"] for r in lines], [r["status"] for r in lines]
        for rid, st in zip(ids, status, strict=True):
            received[rid] = received.get(rid, 0) + 1
            statuses[rid] = st
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"accepted": 0, "rejected": []}'})

    config = make_config(upstream, **{"simulator.engines.chat-small": {"step_base_ms": 5}})
    sim = ReplicaSim(replica_spec(config, "small-0"))
    async with serving(sim, up_port), serving(ingest, lifespan="off") as ingest_url:
        path = _sidecar_config(tmp_path, upstream, f"127.0.0.1:{side_port}", None)
        proc = await asyncio.to_thread(sidecar_process, str(path), url)
        completed: list[str] = []
        async with httpx.AsyncClient(
            base_url=url,
            headers={"authorization": f"Bearer {KEYS['search']}"},
            timeout=30,
            limits=httpx.Limits(max_connections=300),
        ) as c:

            async def one(i: int) -> None:
                body = {**CHAT, "max_tokens": 10 + i % 50, "stream": i % 2 == 0}
                try:
                    r = await c.post("/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    return
                if r.status_code == 200 and (
                    not body["stream"] or r.content.endswith(b"data: [DONE]\n\n")
                ):
                    completed.append(r.headers["x-infermeter-request-id"])

            async def killer() -> None:
                deadline = time.monotonic() + 60
                while len(completed) < 100 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                os.kill(proc.pid, signal.SIGKILL)

            await asyncio.gather(killer(), *(one(i) for i in range(400)))
        proc.wait(10)
        spooled = [
            r["request_id"]
            for seg in sorted((tmp_path / "spool" / "small-0").glob("seg-*.jsonl"))
            for r in read_segment(seg)[0]
        ]
        assert len(completed) >= 100
        # The records of the last tick were not written yet: their endings are in the journal.
        assert len(spooled) == len(set(spooled))
        # Restart with billing configured: everything spooled is shipped, each id once.
        path = _sidecar_config(tmp_path, upstream, f"127.0.0.1:{side_port}", ingest_url)
        proc = await asyncio.to_thread(sidecar_process, str(path), url)
        try:
            deadline = time.monotonic() + 20
            segments = (tmp_path / "spool" / "small-0").glob
            while (
                not set(spooled) <= set(received) or list(segments("seg-*.jsonl"))
            ) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            # The restarted sidecar counts what its start recorded as interrupted.
            async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                page = await c.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
            interrupted = sum(
                sample.value
                for family in text_string_to_metric_families(page.text)
                for sample in family.samples
                if sample.name == "infermeter_requests_total"
                and sample.labels.get("status") == "interrupted"
            )
        finally:
            stop_process(proc, grace=10)
    # Every response a client saw complete is billed as it ended, once: spooled before the kill,
    # or made from its journal slot at the restart.
    assert set(completed) <= set(received)
    assert {statuses[r] for r in completed} == {"ok"}
    # Besides what was spooled, only the requests running at the kill (interrupted) and those
    # that had ended, their records waiting for the tick, made from the journal.
    assert set(spooled) <= set(received)
    made = set(received) - set(spooled)
    running = {r for r in made if statuses[r] == "interrupted"}
    assert {statuses[r] for r in made - running} <= {"ok", "client_aborted"}
    assert interrupted == len(running)
    assert set(received.values()) == {1}
    assert not list((tmp_path / "spool" / "small-0").glob("seg-*.jsonl"))
