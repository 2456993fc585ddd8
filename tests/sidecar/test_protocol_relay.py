"""The relay on asyncio protocols (``sidecar.protocol_relay``) gives what the ASGI relay gives."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from infermeter.serving import free_port
from tests.sidecar.conftest import KEYS

# The relay runs on uvloop in the sidecar process and on either loop in tests (conftest).
pytestmark = pytest.mark.both_loops

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


def _capture_upstream(body: bytes) -> Any:
    """An upstream that answers every request with ``body`` as an SSE stream, in two writes."""

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        half = len(body) // 2
        await send({"type": "http.response.body", "body": body[:half], "more_body": True})
        await send({"type": "http.response.body", "body": body[half:]})

    return app


@pytest.mark.parametrize(
    "options",
    [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}],
)
async def test_a_stream_is_the_same_byte_for_byte_on_either_relay(
    stack_factory, fixture_text, options
):
    """A real vLLM capture reaches the client identically through both relays."""
    capture = fixture_text("vllm-0.32-chat-stream-continuous-usage.sse").encode()
    body = {**CHAT, "stream": True, **({"stream_options": options} if options else {})}
    seen = []
    for on in (False, True):
        stack = await stack_factory(
            upstream_app=_capture_upstream(capture), **{"sidecar.protocol_relay": on}
        )
        async with stack.client() as c:
            r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        seen.append(r.content)
        assert (await stack.records())[-1]["status"] == "ok"
    assert seen[0] == seen[1]
    assert seen[1].endswith(b"data: [DONE]\n\n")


async def test_whole_answers_and_refusals_are_the_same_on_either_relay(stack_factory):
    """A non-streamed completion and a 404 for an unknown model answer alike on both relays."""
    results = []
    for on in (False, True):
        stack = await stack_factory(**{"sidecar.protocol_relay": on})
        async with stack.client() as c:
            whole = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
            missing = await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        results.append((whole.status_code, missing.status_code, sorted(whole.json())))
        assert (await stack.records())[-2]["completion_tokens"] == 4
    assert results[0] == results[1] == (200, 404, results[0][2])


async def test_an_unreachable_upstream_is_502_on_the_protocol_relay(stack_factory):
    """No vLLM listening: a stream is refused with 502 before any SSE, and recorded."""
    stack = await stack_factory(**{"sidecar.protocol_relay": True})
    stack.sidecar.upstream = f"http://127.0.0.1:{free_port()}"
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unreachable"
    assert (await stack.records())[-1]["status"] == "upstream_error"


async def test_a_client_that_stops_reading_pauses_the_upstream(stack_factory):
    """A client that reads nothing holds the upstream back instead of the sidecar buffering it all."""
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 900 + b'"}}]}\n\n'
    total = 64 << 20
    sent = 0

    async def flood(scope, receive, send):
        nonlocal sent
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        block = event * 64
        while sent < total:
            await send({"type": "http.response.body", "body": block, "more_body": True})
            sent += len(block)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    stack = await stack_factory(upstream_app=flood, **{"sidecar.protocol_relay": True})
    host, port = stack.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = b'{"model":"chat-small","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + KEYS["search"].encode() + b"\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
    )
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    deadline = time.monotonic() + 1.5
    previous = -1
    while time.monotonic() < deadline and sent != previous:
        previous = sent
        await asyncio.sleep(0.5)
    assert sent < total // 2, f"the upstream wrote {sent} bytes to a client that read none"
    writer.close()
