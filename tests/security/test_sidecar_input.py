"""The sidecar answers malformed input with an OpenAI error, and its in-flight gauge stays true."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infermeter.auth import sign_request
from tests.sidecar.conftest import (
    METRICS_TOKEN,
    Stack,
    stack as stack,
    stack_factory as stack_factory,
)

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _in_flight(stack: Stack) -> dict[tuple[str, str], float]:
    """infermeter_requests_in_flight per (team, model), as the sidecar's /metrics shows it."""
    async with httpx.AsyncClient(base_url=stack.url) as c:
        r = await c.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
    return {
        (s.labels["team"], s.labels["model"]): s.value
        for family in text_string_to_metric_families(r.text)
        if family.name == "infermeter_requests_in_flight"
        for s in family.samples
    }


def _is_openai_error(response: httpx.Response, status: int) -> bool:
    body = response.json()
    return response.status_code == status and {"message", "type", "code"} <= set(body["error"])


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("options", ["x", 1, True, ["include_usage"], {"include_usage": "x"}])
async def test_stream_options_that_are_not_an_object_are_a_400(stack, stream, options):
    """stream_options of the wrong type: 400 in OpenAI's error JSON, and nothing left in flight."""
    body: dict[str, Any] = {**CHAT, "stream": stream, "stream_options": options}
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json=body)
        ok = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert set((await _in_flight(stack)).values()) <= {0.0}
    if isinstance(options, dict):
        # An object with odd values is vLLM's to judge; the sidecar only needs an object.
        assert r.status_code in (200, 400)
    else:
        assert _is_openai_error(r, 400), r.text
        assert r.json()["error"]["param"] == "stream_options"
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "changes",
    [
        {"max_tokens": 10**400},
        {"max_completion_tokens": 10**400},
        {"n": 10**400},
        {"max_tokens": 10**400, "n": 10**400, "stream": True},
    ],
)
async def test_huge_integers_in_the_body_never_crash_the_sidecar(stack, changes):
    """A 400-digit max_tokens or n is passed to vLLM to refuse, not a 500 from the sidecar."""
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, **changes})
        ok = await c.post("/v1/chat/completions", json=CHAT)
    assert _is_openai_error(r, 400), r.text
    assert ok.status_code == 200
    assert set((await _in_flight(stack)).values()) <= {0.0}


@pytest.mark.parametrize("stamp", ["9" * 400, "-" + "9" * 400, "1e400", "+1", "1_000"])
async def test_a_malformed_gateway_timestamp_is_an_openai_401(stack_factory, monkeypatch, stamp):
    """A 400-digit (or otherwise malformed) gateway timestamp is refused, not a 500."""
    monkeypatch.setenv("INFERMETER_GATEWAY_SECRET", "s3cret")
    stack = await stack_factory(**{"sidecar.gateway": {"enabled": True}})
    now = int(time.time())
    nonce = "n" * 16
    signature = sign_request(
        b"s3cret",
        team="research",
        timestamp=now,
        nonce=nonce,
        audience="chat-small",
        method="POST",
        path="/v1/chat/completions",
        body=orjson.dumps(CHAT),
    )
    headers = {
        "x-infermeter-team": "research",
        "x-infermeter-timestamp": stamp,
        "x-infermeter-signature": signature,
        "x-infermeter-nonce": nonce,
    }
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
        models = await c.get("/v1/models", headers=headers)
    assert _is_openai_error(r, 401), r.text
    assert r.json()["error"]["code"] == "invalid_team_signature"
    assert _is_openai_error(models, 401), models.text
    assert set((await _in_flight(stack)).values()) <= {0.0}
