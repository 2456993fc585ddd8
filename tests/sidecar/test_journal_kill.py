"""kill -9 of a sidecar process mid-request: each request is billed at least what its client got.

A real ``infermeter sidecar`` process, real HTTP on loopback, the simulator as vLLM. Streamed and
non-streamed requests, of one choice and of two, are in flight when the sidecar is killed; the
restarted sidecar records them from the journal it left. The simulator's side of each exchange is
watched (what vLLM sent, its response id and prompt tokens), and so is each client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from infermeter.spool import read_segment
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import serving, sidecar_process
from tests.sidecar.conftest import KEYS

CHAT = {
    "model": "chat-small",
    "messages": [{"role": "user", "content": "how far did it get?"}],
    "ignore_eos": True,
    "max_tokens": 3000,
}
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
# (x-request-id, streamed, n, the client asks for vLLM's running usage)
REQUESTS = [
    ("stream-1", True, 1, False),
    ("stream-1-usage", True, 1, True),
    ("stream-2", True, 2, False),
    ("stream-2-usage", True, 2, True),
    ("whole-1", False, 1, False),
    ("whole-2", False, 2, False),
]


@dataclass
class Sent:
    """What vLLM sent for one request: its response id, prompt tokens and token events."""

    response_id: str | None = None
    prompt: int | None = None
    tokens: int = 0
    head: bytes = b""


@dataclass
class Got:
    """What one streaming client received: vLLM's response id and the tokens in its chunks."""

    response_id: str | None = None
    events: int = 0
    # The latest completion count of each choice (clients that asked for running usage).
    counted: dict[int, int] = field(default_factory=dict)
    status: int = 0

    @property
    def tokens(self) -> int:
        """Tokens received: content events, or vLLM's own counts when the client had them."""
        return max(self.events, sum(self.counted.values()))


class Watched:
    """The simulated replica, noting what it sends for each request (by its ``x-request-id``)."""

    def __init__(self, app: ReplicaSim) -> None:
        self.app = app
        self.sent: dict[str, Sent] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Serve as the replica; count what goes out."""
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            await self.app(scope, receive, send)
            return
        rid = dict(scope["headers"]).get(b"x-request-id", b"").decode()
        sent = self.sent.setdefault(rid, Sent())

        async def watching(message: Any) -> None:
            if message["type"] == "http.response.body":
                body: bytes = message.get("body", b"")
                sent.tokens += body.count(b'"delta":{"content":')
                if sent.prompt is None:
                    sent.head += body
                    for event in sent.head.split(b"\n\n")[:-1]:
                        if event.startswith(b"data: {"):
                            chunk = orjson.loads(event[6:])
                            sent.response_id = chunk["id"]
                            sent.prompt = chunk["usage"]["prompt_tokens"]
                            break
            await send(message)

        await self.app(scope, receive, watching)


class Fleet:
    """The simulator in this process, a sidecar process in front of it, and its spool."""

    def __init__(self, tmp_path: Path, **sidecar: Any) -> None:
        self.up_port, side_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{side_port}"
        self.spool = tmp_path / "spool" / "small-0"
        data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
        data["replicas"][1].update(
            upstream_url=f"http://127.0.0.1:{self.up_port}", sidecar_listen=f"127.0.0.1:{side_port}"
        )
        # 20 ms a step: every request is still running, a few tokens in, when the kill comes.
        data["simulator"]["engines"]["chat-small"].update(step_base_ms=20, step_per_seq_ms=0)
        data["teams"][0]["limits"] = {}
        data["sidecar"] = {"spool_dir": str(tmp_path / "spool"), **sidecar}
        self.config_path = tmp_path / "infermeter.yaml"
        self.config_path.write_text(yaml.safe_dump(data))
        self.upstream = Watched(ReplicaSim(replica_spec(Config.model_validate(data), "small-0")))

    @contextlib.asynccontextmanager
    async def simulator(self) -> AsyncIterator[None]:
        """Serve the simulated replica for the block."""
        async with serving(self.upstream, self.up_port):
            yield

    def start_sidecar(self) -> subprocess.Popen[bytes]:
        """A sidecar process, once it answers /healthz."""
        return sidecar_process(str(self.config_path), self.url)

    def records(self) -> list[dict[str, Any]]:
        """Every record in the spool."""
        return [r for seg in sorted(self.spool.glob("seg-*.jsonl")) for r in read_segment(seg)[0]]


def take(got: Got, data: bytes) -> None:
    """Note the complete SSE events of ``data``: the response id, content events, running usage."""
    for event in data.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        chunk = orjson.loads(event[6:])
        got.response_id = got.response_id or chunk.get("id")
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") or {}).get("content") and "role" not in choice["delta"]:
                got.events += 1
            if chunk.get("usage") is not None:
                got.counted[choice["index"]] = chunk["usage"]["completion_tokens"]


async def client(fleet: Fleet, rid: str, stream: bool, n: int, usage: bool, got: Got) -> None:
    """One request, read until the connection ends (the kill ends it)."""
    body: dict[str, Any] = {**CHAT, "stream": stream, "n": n}
    if usage:
        body["stream_options"] = CONTINUOUS
    headers = {"authorization": f"Bearer {KEYS['search']}", "x-request-id": rid}
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as c:
        with contextlib.suppress(httpx.HTTPError):
            async with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                got.status = r.status_code
                pending = b""
                async for part in r.aiter_bytes():
                    pending += part
                    cut = pending.rfind(b"\n\n") + 2
                    take(got, pending[:cut])
                    pending = pending[cut:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mark_millis",
    [
        # No tick before the kill: the slots alone hold the progress.
        60_000,
        # Ticks every 100 ms: non-streamed requests get their tokens from the tick too.
        100,
    ],
)
async def test_kill_9_bills_each_request_at_least_what_its_client_received(tmp_path, mark_millis):
    """Killed with streamed and non-streamed requests of one and two choices in flight, then
    restarted: each is recorded once, interrupted, with vLLM's prompt tokens, at least the tokens
    its client received and at most those vLLM sent, and the response id vLLM gave it."""
    fleet = Fleet(tmp_path, journal_mark_millis=mark_millis)
    got = {rid: Got() for rid, *_ in REQUESTS}
    async with fleet.simulator():
        proc = await asyncio.to_thread(fleet.start_sidecar)
        try:
            clients = [
                asyncio.create_task(client(fleet, rid, stream, n, usage, got[rid]))
                for rid, stream, n, usage in REQUESTS
            ]
            deadline = time.monotonic() + 30

            def under_way() -> bool:
                sent = fleet.upstream.sent
                return all(
                    got[rid].events >= 3 * n if stream else sent.get(rid, Sent()).tokens >= 3 * n
                    for rid, stream, n, _ in REQUESTS
                )

            while not under_way():
                assert time.monotonic() < deadline, "the requests did not get under way"
                await asyncio.sleep(0.005)
            if mark_millis < 1000:
                await asyncio.sleep(3 * mark_millis / 1000)  # ticks have written the whole ones
            os.kill(proc.pid, signal.SIGKILL)
            await asyncio.gather(*clients)
            proc.wait(10)
            proc = await asyncio.to_thread(fleet.start_sidecar)
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 30)
    records = {r["client_request_id"]: r for r in fleet.records()}
    assert len(records) == len(fleet.records()) == len(REQUESTS)
    assert not list((fleet.spool / "journal").iterdir())
    for rid, stream, _, _ in REQUESTS:
        record, sent = records[rid], fleet.upstream.sent[rid]
        assert (record["status"], record["usage_exact"]) == ("interrupted", False), rid
        assert record["response_id"] == sent.response_id, rid
        assert record["prompt_tokens"] == sent.prompt, rid
        assert record["prompt_tokens"] > 0, rid
        assert record["completion_tokens"] <= sent.tokens, rid
        if stream:
            client_got = got[rid]
            assert (client_got.status, record["http_status"]) == (200, 200), rid
            assert client_got.response_id == sent.response_id, rid
            assert client_got.tokens >= 3, rid
            assert record["completion_tokens"] >= client_got.tokens, rid
            assert record["first_token_at"] is not None, rid
        else:
            assert record["http_status"] == 502, rid
            assert got[rid].status == 0, rid  # the client got nothing, not even a head
            if mark_millis < 1000:
                assert record["completion_tokens"] > 0, rid
