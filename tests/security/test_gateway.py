"""A gateway signature binds one request: its method, path, body and a nonce, used once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from infermeter.auth import sign_request
from infermeter.serving import free_port
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import serving
from tests.sidecar.conftest import KEYS, make_config

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
) -> dict[str, str]:
    ts = int(time.time()) if ts is None else ts
    signature = sign_request(
        SECRET, team=team, timestamp=ts, nonce=nonce, method=method, path=path, body=body
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
