"""The sidecar relays the OpenAI API transparently and refuses what it must, in OpenAI's words."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from infermeter.auth import sign_request
from tests.sidecar.conftest import KEYS, make_config
from tests.simulator.shapes import classify, skeleton, sse_events

# The relay runs on uvloop in the sidecar process and on either loop in tests (conftest).
pytestmark = pytest.mark.both_loops

CHAT = {
    "model": "chat-small",
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 8,
}


async def test_openai_sdk_works_unchanged_streaming_and_not(stack):
    """The official SDK gets completions, streams and usage through the sidecar."""
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=KEYS["search"]) as client:
        await _sdk_calls(client)


async def _sdk_calls(client: openai.AsyncOpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
    whole = await client.chat.completions.create(
        model="chat-small", messages=messages, max_tokens=8
    )
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 8
    stream = await client.chat.completions.create(
        model="chat-small",
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    text = await client.completions.create(model="chat-small", prompt="one two", max_tokens=4)
    assert text.usage is not None
    assert text.usage.completion_tokens == 4
    models = await client.models.list()
    assert [m.id for m in models.data] == [
        "chat-small",
        "llama-3.1-8b-instruct-2024-07",
        "llama-3.1-8b-instruct",
    ]


@pytest.mark.parametrize(
    ("options", "fixture_order"),
    [
        (None, ["role", "token", "finish", "done"]),
        # Continuous stats without include_usage: vLLM sends no usage at all.
        ({"continuous_usage_stats": True}, ["role", "token", "finish", "done"]),
        ({"include_usage": True}, ["role", "token", "finish", "usage", "done"]),
        (
            {"include_usage": True, "continuous_usage_stats": True},
            ["role", "token", "finish", "usage", "done"],
        ),
    ],
)
async def test_client_sees_what_vllm_would_have_sent(stack, options, fixture_order):
    """The usage the sidecar injects is removed again unless the client asked for it."""
    body = {**CHAT, "stream": True, **({"stream_options": options} if options else {})}
    async with stack.client() as c, httpx.AsyncClient() as plain:
        via = await c.post("/v1/chat/completions", json=body)
        direct = await plain.post(
            f"{stack.upstream}/v1/chat/completions", json={**body, "model": "llama-3.1-8b-instruct"}
        )
    ours, theirs = sse_events(via.content), sse_events(direct.content)
    assert [classify(p) for p in ours] == [classify(p) for p in theirs]
    assert [classify(p) for p in ours][-len(fixture_order) + 2 :] == fixture_order[2:]
    for a, b in zip(ours, theirs, strict=True):
        if a != "[DONE]":
            assert skeleton(httpx.Response(200, content=a).json()) == skeleton(
                httpx.Response(200, content=b).json()
            )


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        ({"authorization": "Bearer nope"}, "invalid_api_key"),
        ({"authorization": "Basic abc"}, "invalid_api_key"),
    ],
)
async def test_missing_or_unknown_key_is_401_in_openai_json(stack, headers, code):
    """No key, a wrong key or a wrong scheme: 401 with OpenAI's error object."""
    async with httpx.AsyncClient(base_url=stack.url) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == code
    assert "nope" not in r.text
    assert (await stack.records()) == []


async def test_team_key_is_never_forwarded_upstream(stack_factory, monkeypatch):
    """vLLM gets the replica's own key, never the team's."""
    seen: list[dict[str, str]] = []

    async def upstream(scope, receive, send):
        seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"object":"list","data":[]}'})

    monkeypatch.setenv("INFERMETER_UPSTREAM_API_KEY", "replica-secret")
    stack = await stack_factory(upstream_app=upstream)
    async with stack.client() as c:
        await c.get(
            "/v1/models",
            headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        )
    assert seen[0]["authorization"] == "Bearer replica-secret"
    assert KEYS["search"] not in str(seen)
    assert seen[0]["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_clients_expect_100_continue_leaves_vllm_and_the_pool_in_step(stack, stream):
    """``Expect: 100-continue`` is the sidecar's to answer, not vLLM's: the request is billed
    its tokens, and the next request, another team's on the same upstream connection, gets its
    own answer (vLLM's interim 100 used to end the exchange unbilled and leave the real answer
    on the pooled connection for the next request to read)."""
    body = orjson.dumps({**CHAT, "max_tokens": 12, "ignore_eos": True, "stream": stream})
    host, port = stack.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
        b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nexpect: 100-continue\r\n\r\n%s"
        % (KEYS["research"].encode(), len(body), body)
    )
    answer = await asyncio.wait_for(reader.read(-1), 30)
    writer.close()
    final = answer.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert final.startswith(b"HTTP/1.1 200 "), answer[:300]
    async with stack.client("assistant") as c:
        after = await c.post("/v1/chat/completions", json={**CHAT, "ignore_eos": True})
    assert after.status_code == 200
    assert after.json()["usage"]["completion_tokens"] == 8
    records = {r["team"]: r for r in await stack.records()}
    assert (records["research"]["status"], records["research"]["completion_tokens"]) == ("ok", 12)
    assert (records["assistant"]["status"], records["assistant"]["completion_tokens"]) == ("ok", 8)


async def test_model_alias_maps_to_served_version_and_others_are_404(stack):
    """The alias and approved versions are served; anything else is model_not_found."""
    async with stack.client() as c:
        alias = await c.post("/v1/chat/completions", json=CHAT)
        version = await c.post(
            "/v1/chat/completions", json={**CHAT, "model": "llama-3.1-8b-instruct"}
        )
        other = await c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"})
    assert alias.json()["model"] == version.json()["model"] == "llama-3.1-8b-instruct"
    assert other.status_code == 404
    assert other.json()["error"]["code"] == "model_not_found"
    assert [r["status"] for r in (await stack.records())] == ["ok", "ok", "rejected"]


async def test_rolling_back_a_version_takes_effect_without_restart(stack):
    """Removing the replica's version from approved_versions stops serving it on reload."""
    async with stack.client() as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        stack.sidecar.reload(
            make_config(
                stack.upstream,
                **{
                    "models.1.approved_versions": ["llama-3.1-8b-instruct-2024-07"],
                    "models.1.serve_version": "llama-3.1-8b-instruct-2024-07",
                },
            )
        )
        refused = await c.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "model_not_found"


async def test_requests_per_minute_limit_gives_429_with_headers(stack_factory):
    """Over the team's requests/min: 429, Retry-After and the x-ratelimit-* headers."""
    stack = await stack_factory(**{"teams.0.limits": {"requests_per_minute": 2}})
    async with stack.client() as c:
        ok = [await c.post("/v1/chat/completions", json=CHAT) for _ in range(2)]
        limited = await c.post("/v1/chat/completions", json=CHAT)
    assert ok[1].headers["x-ratelimit-limit-requests"] == "2"
    assert ok[1].headers["x-ratelimit-remaining-requests"] == "0"
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["retry-after"]) >= 1
    assert "x-ratelimit-reset-requests" in limited.headers
    assert (await stack.records())[-1]["status"] == "rate_limited"


async def test_tokens_per_minute_limit_reserves_max_tokens(stack_factory):
    """A request whose max_tokens does not fit in what is left of the minute is refused."""
    stack = await stack_factory(**{"teams.0.limits": {"tokens_per_minute": 600}})
    async with stack.client() as c:
        first = await c.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 400, "ignore_eos": True}
        )
        second = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 400})
    assert first.status_code == 200
    assert second.status_code == 429
    assert second.json()["error"]["type"] == "tokens"


async def test_concurrency_limit_refuses_while_full(stack_factory):
    """With max_concurrent 1, a second request during the first is refused."""
    stack = await stack_factory(**{"teams.0.limits": {"max_concurrent": 1}})
    async with stack.client() as c:
        slow = asyncio.create_task(
            c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 300, "ignore_eos": True})
        )
        await asyncio.sleep(0.1)
        refused = await c.post("/v1/chat/completions", json=CHAT)
        assert (await slow).status_code == 200
        after = await c.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 429
    assert after.status_code == 200


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b"x" * 9_000_000, 413, "request_too_large"),
    ],
)
async def test_bad_bodies_get_openai_errors(stack, content, status, code):
    """Invalid JSON is 400, an oversized body 413, each in OpenAI's error JSON."""
    async with stack.client() as c:
        r = await c.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
    assert r.status_code == status
    assert r.json()["error"]["code"] == code


async def test_vllm_errors_pass_through_and_are_recorded(stack):
    """A request vLLM refuses reaches the client unchanged and is recorded as bad_request."""
    async with stack.client() as c:
        r = await c.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 100_000, "stream": True}
        )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    assert (await stack.records())[-1]["status"] == "bad_request"


async def test_gateway_mode_accepts_only_fresh_signed_team_headers(stack_factory, monkeypatch):
    """A signed team header is accepted; unsigned or stale ones are 401."""
    monkeypatch.setenv("INFERMETER_GATEWAY_SECRET", "s3cret")
    stack = await stack_factory(**{"sidecar.gateway": {"enabled": True}})
    now = int(time.time())

    body = orjson.dumps(CHAT)

    def signed(ts: int) -> dict[str, str]:
        nonce = f"nonce-{ts}-0123456789"
        signature = sign_request(
            b"s3cret",
            team="research",
            timestamp=ts,
            nonce=nonce,
            audience="chat-small",
            method="POST",
            path="/v1/chat/completions",
            body=body,
        )
        return {
            "x-infermeter-team": "research",
            "x-infermeter-timestamp": str(ts),
            "x-infermeter-nonce": nonce,
            "x-infermeter-signature": signature,
        }

    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        good = await c.post("/v1/chat/completions", content=body, headers=signed(now))
        stale = await c.post("/v1/chat/completions", content=body, headers=signed(now - 3600))
        unsigned = await c.post(
            "/v1/chat/completions", content=body, headers={"x-infermeter-team": "research"}
        )
    assert good.status_code == 200
    assert (await stack.records())[0]["team"] == "research"
    assert (stale.status_code, unsigned.status_code) == (401, 401)


async def test_health_endpoints(stack):
    """/healthz is always up; /readyz checks the upstream."""
    async with httpx.AsyncClient(base_url=stack.url) as c:
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/readyz")).json() == {"ready": True, "problems": []}


async def test_metrics_need_the_metrics_token(stack):
    """/metrics shows every team's usage, so it needs the metrics or admin token."""
    async with httpx.AsyncClient(base_url=stack.url) as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (
            await c.get("/metrics", headers={"authorization": f"Bearer {KEYS['search']}"})
        ).status_code == 401
        assert (
            await c.get("/metrics", headers={"authorization": "Bearer im-demo-metrics"})
        ).status_code == 200
