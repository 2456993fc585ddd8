"""The proxy benchmarks' vLLM upstream (``bench.vllm_upstream``) writes what real vLLM 0.32 writes.

Its answers are checked here against the captures of real vLLM in ``tests/fixtures``: chunk
kinds in order, each kind's fields in order with their types, per-choice order with ``n = 2``,
and the whole bodies; then what it honours of a request (usage options, ``max_tokens``) and of
time (one token per engine step, an abort when the client leaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from bench.vllm_upstream import Upstream, serve
from infermeter.serving import free_port
from tests.simulator.shapes import classify, kinds_in_order, skeleton, sse_events

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "count to ten"}], "max_tokens": 6}
PROMPT = {"model": "tiny", "prompt": "one two three", "max_tokens": 5}


@contextlib.asynccontextmanager
async def upstream(step_seconds: float = 0.0) -> AsyncIterator[tuple[str, Upstream]]:
    """The upstream serving model ``tiny`` on a free loopback port."""
    port = free_port()
    ready: asyncio.Future[Upstream] = asyncio.get_running_loop().create_future()
    task = asyncio.get_running_loop().create_task(
        serve("127.0.0.1", port, "tiny", step_seconds, ready.set_result)
    )
    server = await ready
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _first_of_each(payloads: list[str]) -> dict[str, object]:
    found: dict[str, object] = {}
    for p in payloads:
        found.setdefault(classify(p), skeleton(orjson.loads(p)) if p != "[DONE]" else p)
    return found


@pytest.mark.parametrize(
    ("fixture", "options"),
    [
        ("vllm-0.32-chat-stream.sse", None),
        ("vllm-0.32-chat-stream-usage.sse", {"include_usage": True}),
        (
            "vllm-0.32-chat-stream-continuous-usage.sse",
            {"include_usage": True, "continuous_usage_stats": True},
        ),
    ],
)
async def test_a_chat_stream_has_the_captured_chunks(fixture_text, fixture, options):
    """Role, tokens, finish, usage (when asked) and [DONE]: the capture's kinds, order and fields,
    one token per chunk up to ``max_tokens``."""
    body = {**CHAT, "stream": True, **({"stream_options": options} if options else {})}
    async with upstream() as (url, _), httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json=body)
    ours, real = sse_events(response.content), sse_events(fixture_text(fixture))
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert kinds_in_order(ours) == kinds_in_order(real)
    assert _first_of_each(ours) == _first_of_each(real)
    assert sum(classify(p) in ("token", "finish") for p in ours) == 6
    assert ('"usage"' in ours[1]) == ('"usage"' in real[1])


async def test_n2_interleaves_choices_as_captured(fixture_text):
    """With ``n = 2``: a role chunk per choice, then each step's token of every choice in turn."""
    body = {
        **CHAT,
        "n": 2,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with upstream() as (url, _), httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json=body)

    def layout(payloads: list[str]) -> list[tuple[str, int | None]]:
        kinds = [classify(p) for p in payloads]
        return [
            (
                k,
                orjson.loads(p)["choices"][0]["index"]
                if k in ("role", "token", "finish")
                else None,
            )
            for k, p in zip(kinds, payloads, strict=True)
        ]

    real = fixture_text("vllm-0.32-chat-stream-n2-usage.sse")
    assert layout(sse_events(response.content)) == layout(sse_events(real))
    assert orjson.loads(sse_events(response.content)[-2])["usage"]["completion_tokens"] == 6


async def test_a_text_completion_stream_has_the_captured_chunks(fixture_text):
    """/v1/completions streamed with usage: the capture's kinds, order and fields."""
    body = {**PROMPT, "stream": True, "stream_options": {"include_usage": True}}
    async with upstream() as (url, _), httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/completions", json=body)
    ours = sse_events(response.content)
    real = sse_events(fixture_text("vllm-0.32-completions-stream-usage.sse"))
    assert kinds_in_order(ours) == kinds_in_order(real)
    assert _first_of_each(ours) == _first_of_each(real)


@pytest.mark.parametrize(
    ("path", "body", "fixture"),
    [
        ("/v1/chat/completions", CHAT, "vllm-0.32-chat-nonstream.json"),
        ("/v1/completions", PROMPT, "vllm-0.32-completions-nonstream.json"),
    ],
)
async def test_a_whole_answer_is_the_captured_body(fixture_text, path, body, fixture):
    """A non-streamed request gets vLLM's whole body: the capture's fields in order, with types."""
    async with upstream() as (url, _), httpx.AsyncClient() as client:
        response = await client.post(url + path, json=body)
    ours = response.json()
    assert response.headers["content-type"] == "application/json"
    assert skeleton(ours) == skeleton(orjson.loads(fixture_text(fixture)))
    assert ours["usage"]["completion_tokens"] == body["max_tokens"]


async def test_stream_options_on_a_whole_request_are_refused_as_vllm_does():
    """``stream_options`` without ``stream`` is vLLM's 400, not an answer."""
    body = {**CHAT, "stream_options": {"include_usage": True}}
    async with upstream() as (url, _), httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "stream" in response.json()["error"]["message"].lower()


async def test_each_engine_step_gives_each_stream_one_token():
    """Paced at 30 ms a step, ten tokens take about ten steps, and arrive one chunk per step."""
    body = {**CHAT, "max_tokens": 10, "stream": True}
    async with upstream(0.03) as (url, _), httpx.AsyncClient() as client:
        started = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            arrivals = [time.perf_counter() async for _ in response.aiter_raw()]
    assert time.perf_counter() - started >= 0.27
    assert len(arrivals) >= 8  # (a read may now and then hold two steps)


async def test_a_client_that_leaves_aborts_its_request():
    """A closed connection takes its request out of the engine's batch at once."""
    body = {**CHAT, "max_tokens": 1000, "stream": True}
    async with upstream(0.02) as (url, server), httpx.AsyncClient() as client:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_raw():
                assert len(server.running) == 1
                break
        await asyncio.sleep(0.1)
        assert server.running == set()


@pytest.mark.parametrize("stream", [True, False])
async def test_connection_close_closes_after_the_answer_as_uvicorn_does(stream):
    """A request with ``connection: close`` gets its whole answer, then the connection closes
    (uvicorn's rule, which lets a client see an answer's end by the close)."""
    body = orjson.dumps({**CHAT, "max_tokens": 4, "stream": stream})
    async with upstream(0.005) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        data = await asyncio.wait_for(reader.read(), 5)  # (to EOF: the upstream closed)
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    if stream:
        assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    else:
        assert orjson.loads(rest)["usage"]["completion_tokens"] == 4


async def test_keep_alive_is_the_default():
    """Without ``connection: close`` the connection stays open for the next request."""
    async with upstream() as (url, _), httpx.AsyncClient() as client:
        first = await client.post(f"{url}/v1/chat/completions", json=CHAT)
        second = await client.post(f"{url}/v1/chat/completions", json=CHAT)
    assert first.status_code == second.status_code == 200
    assert first.extensions["network_stream"] is second.extensions["network_stream"]
