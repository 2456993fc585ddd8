"""A gateway signature binds one request: its audience (the model), method, path, body and a nonce,
served once in the fleet.

A request captured in flight and sent again is refused by the same sidecar, by the same sidecar
after a kill -9 and restart (its nonces are on disk in its spool directory), and, when the
sidecars share Redis, by every other sidecar; a signature for one model is refused by another
model's sidecars. Real sidecars on loopback: in this process, or a real ``infermeter sidecar``
process for the kill; a real redis-server.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from prometheus_client.parser import text_string_to_metric_families

from infermeter.auth import sign_request
from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.redis_server import RedisServer
from tests.servers import serving, sidecar_process
from tests.sidecar.conftest import KEYS, METRICS_TOKEN, make_config

SECRET = b"s3cret"
CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class _Recorder:
    """The simulated replica, noting the headers of every request it receives."""

    app: Any
    seen: list[dict[str, str]] = field(default_factory=list)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


@dataclass
class _Pod:
    url: str
    upstream: _Recorder
    spool: Path


@contextlib.asynccontextmanager
async def _pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **changes: Any
) -> AsyncIterator[_Pod]:
    monkeypatch.setenv("INFERMETER_GATEWAY_SECRET", SECRET.decode())
    port = free_port()
    config = make_config(
        f"http://127.0.0.1:{port}", **{"sidecar.gateway": {"enabled": True}}, **changes
    )
    recorder = _Recorder(ReplicaSim(replica_spec(config, "small-0")))
    async with (
        serving(recorder, port),
        serving(Sidecar(config, "small-0", spool_dir=tmp_path / "spool")) as url,
    ):
        yield _Pod(url, recorder, tmp_path / "spool")


def _signed(
    body: bytes,
    *,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    team: str = "research",
    ts: int | None = None,
    nonce: str = "n-0123456789abcdef",
    audience: str = "chat-small",
) -> dict[str, str]:
    ts = int(time.time()) if ts is None else ts
    signature = sign_request(
        SECRET,
        team=team,
        timestamp=ts,
        nonce=nonce,
        audience=audience,
        method=method,
        path=path,
        body=body,
    )
    return {
        "content-type": "application/json",
        "x-infermeter-team": team,
        "x-infermeter-timestamp": str(ts),
        "x-infermeter-nonce": nonce,
        "x-infermeter-signature": signature,
    }


async def test_a_signed_request_is_served_once(tmp_path, monkeypatch):
    """The same signed request sent twice is served once; the replay is 401."""
    body = orjson.dumps(CHAT)
    headers = _signed(body)
    async with _pod(tmp_path, monkeypatch) as pod, httpx.AsyncClient(base_url=pod.url) as c:
        first = await c.post("/v1/chat/completions", content=body, headers=headers)
        again = await c.post("/v1/chat/completions", content=body, headers=headers)
    assert first.status_code == 200
    assert again.status_code == 401
    assert again.json()["error"]["code"] == "invalid_team_signature"


@pytest.mark.parametrize("moved", ["path", "body", "method-path"])
async def test_a_signature_does_not_move_to_another_request(tmp_path, monkeypatch, moved):
    """A signature made for one path or body is refused on another path or body."""
    body = orjson.dumps(CHAT)
    headers = _signed(body, path="/v1/embeddings")
    other = orjson.dumps({**CHAT, "max_tokens": 400})
    async with _pod(tmp_path, monkeypatch) as pod, httpx.AsyncClient(base_url=pod.url) as c:
        if moved == "path":
            r = await c.post("/v1/chat/completions", content=body, headers=headers)
        elif moved == "body":
            r = await c.post("/v1/embeddings", content=other, headers=headers)
        else:
            r = await c.get("/v1/models", headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_team_signature"


async def test_gateway_and_key_headers_are_not_forwarded(tmp_path, monkeypatch):
    """vLLM never sees the gateway's headers nor the caller's team key."""
    body = orjson.dumps(CHAT)
    async with _pod(tmp_path, monkeypatch) as pod, httpx.AsyncClient(base_url=pod.url) as c:
        signed = await c.post("/v1/chat/completions", content=body, headers=_signed(body))
        keyed = await c.post(
            "/v1/chat/completions",
            json=CHAT,
            headers={"authorization": f"Bearer {KEYS['search']}"},
        )
    assert (signed.status_code, keyed.status_code) == (200, 200)
    generation = [h for h in pod.upstream.seen if "content-length" in h]
    assert len(generation) == 2
    for headers in generation:
        assert not [k for k in headers if k.startswith("x-infermeter-")]
        assert KEYS["search"] not in str(headers)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-infermeter-timestamp", "9" * 400),
        ("x-infermeter-timestamp", "-1"),
        ("x-infermeter-timestamp", "1e9"),
        ("x-infermeter-nonce", ""),
        ("x-infermeter-nonce", "n" * 5000),
        ("x-infermeter-signature", "zz"),
        ("x-infermeter-team", "r\u00e9search"),
    ],
    ids=["400-digits", "negative", "float", "empty-nonce", "long-nonce", "short-sig", "latin-1"],
)
async def test_malformed_gateway_headers_are_401_in_openai_json(tmp_path, monkeypatch, name, value):
    """A malformed gateway header is a 401 in OpenAI's error JSON, never a 500."""
    body = orjson.dumps(CHAT)
    headers = {**_signed(body), name: value}
    raw = [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]
    async with _pod(tmp_path, monkeypatch) as pod, httpx.AsyncClient(base_url=pod.url) as c:
        r = await c.post("/v1/chat/completions", content=body, headers=raw)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_a_signature_for_another_model_is_refused(tmp_path, monkeypatch):
    """A request signed for chat-large's sidecars is refused by chat-small's (the audience)."""
    body = orjson.dumps(CHAT)
    async with _pod(tmp_path, monkeypatch) as pod, httpx.AsyncClient(base_url=pod.url) as c:
        r = await c.post(
            "/v1/chat/completions", content=body, headers=_signed(body, audience="chat-large")
        )
        ok = await c.post("/v1/chat/completions", content=body, headers=_signed(body))
    assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_team_signature")
    assert ok.status_code == 200


def _shared(redis: RedisServer, upstream: str, **shared: Any) -> Config:
    """The demo config with small-0 and small-1 at ``upstream``, gateway mode on, sharing Redis."""
    settings = {"redis_url": redis.url, "timeout_millis": 2000, "retry_seconds": 60, **shared}
    return make_config(
        upstream,
        **{
            "sidecar.gateway": {"enabled": True},
            "sidecar.shared_limits": settings,
            "replicas.2.upstream_url": upstream,
        },
    )


@contextlib.asynccontextmanager
async def _two_sidecars(config: Config, tmp_path: Path, port: int) -> AsyncIterator[list[str]]:
    """small-0's and small-1's sidecars, both in front of one simulated replica on ``port``."""
    async with (
        serving(ReplicaSim(replica_spec(config, "small-0")), port),
        serving(Sidecar(config, "small-0", spool_dir=tmp_path / "spool-0")) as small_0,
        serving(Sidecar(config, "small-1", spool_dir=tmp_path / "spool-1")) as small_1,
    ):
        yield [small_0, small_1]


async def test_a_captured_request_is_refused_by_every_other_sidecar_sharing_redis(
    tmp_path, monkeypatch, redis_server
):
    """Served by small-0, then replayed to small-1 (same model, same Redis): 401 there."""
    monkeypatch.setenv("INFERMETER_GATEWAY_SECRET", SECRET.decode())
    port = free_port()
    config = _shared(redis_server, f"http://127.0.0.1:{port}")
    body = orjson.dumps(CHAT)
    captured = _signed(body, nonce="captured-0123456789")
    async with (
        _two_sidecars(config, tmp_path, port) as (small_0, small_1),
        httpx.AsyncClient(timeout=30) as c,
    ):
        first = await c.post(f"{small_0}/v1/chat/completions", content=body, headers=captured)
        replayed = await c.post(f"{small_1}/v1/chat/completions", content=body, headers=captured)
        fresh = await c.post(
            f"{small_1}/v1/chat/completions",
            content=body,
            headers=_signed(body, nonce="fresh-0123456789ab"),
        )
    assert first.status_code == 200
    assert replayed.status_code == 401, replayed.text
    assert replayed.json()["error"]["message"] == "Replayed gateway signature."
    assert fresh.status_code == 200


def _unshared(text: str, policy: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["infermeter_gateway_nonces_unshared"].samples
    return sum(
        s.value for s in samples if s.labels.get("policy") == policy and s.name.endswith("_total")
    )


async def test_without_redis_fail_open_serves_once_per_sidecar_and_counts_it(
    tmp_path, monkeypatch, redis_server
):
    """Redis gone, fail_open: served on small-0's own memory (counted), refused again there."""
    monkeypatch.setenv("INFERMETER_GATEWAY_SECRET", SECRET.decode())
    port = free_port()
    config = _shared(redis_server, f"http://127.0.0.1:{port}", timeout_millis=200)
    body = orjson.dumps(CHAT)
    captured = _signed(body)
    redis_server.kill()
    async with (
        _two_sidecars(config, tmp_path, port) as (small_0, _),
        httpx.AsyncClient(timeout=30) as c,
    ):
        first = await c.post(f"{small_0}/v1/chat/completions", content=body, headers=captured)
        again = await c.post(f"{small_0}/v1/chat/completions", content=body, headers=captured)
        metrics = await c.get(
            f"{small_0}/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}
        )
    assert (first.status_code, again.status_code) == (200, 401)
    assert _unshared(metrics.text, "fail_open") == 1


async def test_without_redis_fail_closed_refuses_signed_requests(
    tmp_path, monkeypatch, redis_server
):
    """Redis gone, fail_closed: a signed request is refused with 503 rather than risk a replay."""
    monkeypatch.setenv("INFERMETER_GATEWAY_SECRET", SECRET.decode())
    port = free_port()
    config = _shared(
        redis_server, f"http://127.0.0.1:{port}", timeout_millis=200, on_failure="fail_closed"
    )
    body = orjson.dumps(CHAT)
    redis_server.kill()
    async with (
        _two_sidecars(config, tmp_path, port) as (small_0, _),
        httpx.AsyncClient(timeout=30) as c,
    ):
        r = await c.post(f"{small_0}/v1/chat/completions", content=body, headers=_signed(body))
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "replay_memory_unavailable"
    assert r.headers["retry-after"] == "1"


class _Process:
    """A real ``infermeter sidecar`` process for small-0, without Redis, and its simulated replica."""

    def __init__(self, tmp_path: Path) -> None:
        self.up_port, port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
        data["replicas"][1].update(
            upstream_url=f"http://127.0.0.1:{self.up_port}", sidecar_listen=f"127.0.0.1:{port}"
        )
        data["sidecar"] = {"spool_dir": str(tmp_path / "spool"), "gateway": {"enabled": True}}
        self.config = Config.model_validate(data)
        self.path = tmp_path / "infermeter.yaml"
        self.path.write_text(yaml.safe_dump(data))
        self.spool = tmp_path / "spool" / "small-0"

    def start(self) -> subprocess.Popen[bytes]:
        """Start it and wait for /healthz."""
        return sidecar_process(str(self.path), self.url)


@pytest.mark.timeout(120)
async def test_a_captured_request_is_refused_after_a_kill_9_and_restart(tmp_path, monkeypatch):
    """Served, then the sidecar process is killed (-9) and restarted on its spool: the same
    request is refused; a new one is served."""
    monkeypatch.setenv("INFERMETER_GATEWAY_SECRET", SECRET.decode())
    pod = _Process(tmp_path)
    body = orjson.dumps(CHAT)
    captured = _signed(body, nonce="before-the-kill-0123")
    async with serving(ReplicaSim(replica_spec(pod.config, "small-0")), pod.up_port):
        proc = await asyncio.to_thread(pod.start)
        try:
            async with httpx.AsyncClient(base_url=pod.url, timeout=30) as c:
                first = await c.post("/v1/chat/completions", content=body, headers=captured)
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
            proc = await asyncio.to_thread(pod.start)
            async with httpx.AsyncClient(base_url=pod.url, timeout=30) as c:
                replayed = await c.post("/v1/chat/completions", content=body, headers=captured)
                fresh = await c.post(
                    "/v1/chat/completions",
                    content=body,
                    headers=_signed(body, nonce="after-the-kill-01234"),
                )
        finally:
            proc.kill()
            await asyncio.to_thread(proc.wait)
    assert first.status_code == 200
    assert replayed.status_code == 401, replayed.text
    assert replayed.json()["error"]["message"] == "Replayed gateway signature."
    assert fresh.status_code == 200
    assert list((pod.spool / "gateway-nonces").glob("nonces-*.log"))
