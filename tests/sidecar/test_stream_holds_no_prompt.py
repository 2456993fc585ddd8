"""An open stream does not keep its request's parsed body (the prompt) or its rate-limit headers.

A sidecar holds as many streams as vLLM runs, each for as long as it generates; a prompt of a
few megabytes kept for each of them would be the largest thing in the process. Once the request
is sent upstream, its parsed body is dropped (``Relay.open_stream``). Measured with tracemalloc
on the allocations made where the body is parsed (``sidecar/admission.py``), while the stream is
open: the upstream here reads the request and throws it away, so nothing else holds the prompt.
Likewise for the ``x-ratelimit-*`` headers of a team with limits (about 1 kB a request, made in
``sidecar/limits.py``): once the response has started with them, they are not kept.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

import httpx

from infermeter.asgi import Receive, Scope, Send, read_body
from tests.sidecar.conftest import StackFactory

_CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"%s"},"logprobs":null,"finish_reason":%s}],'
    b'"usage":{"prompt_tokens":9,"total_tokens":%d,"completion_tokens":%d}}\n\n'
)


class _HeldStream:
    """A vLLM stand-in: one token, then nothing until ``release`` is set, then the end."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.first_sent = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive, 1 << 26)  # read and dropped
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send(
            {
                "type": "http.response.body",
                "body": _CHUNK % (b"a", b"null", 10, 1),
                "more_body": True,
            }
        )
        self.first_sent.set()
        await self.release.wait()
        await send(
            {
                "type": "http.response.body",
                "more_body": False,
                "body": _CHUNK % (b"b", b'"stop"', 11, 2) + b"data: [DONE]\n\n",
            }
        )


def _held_by(snapshot: tracemalloc.Snapshot, pattern: str) -> int:
    kept = snapshot.filter_traces([tracemalloc.Filter(True, pattern)])
    return sum(stat.size for stat in kept.statistics("filename"))


async def _held_while_open(
    stack_factory: StackFactory, body: dict[str, Any], pattern: str, **settings: Any
) -> tuple[int, httpx.Headers]:
    """Bytes allocated in files matching ``pattern`` still held while a stream of ``body`` is
    open (after its first event), and the response's headers."""
    upstream = _HeldStream()
    stack = await stack_factory(upstream, **settings)
    tracemalloc.start(1)
    try:
        async with (
            stack.client() as client,
            client.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            await upstream.first_sent.wait()
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            gc.collect()
            held = _held_by(tracemalloc.take_snapshot(), pattern)
            upstream.release.set()
            rest = [line async for line in lines]
    finally:
        tracemalloc.stop()
    assert "data: [DONE]" in rest
    return held, r.headers


async def test_an_open_stream_does_not_keep_a_large_prompt(stack_factory: StackFactory) -> None:
    prompt = "word " * 800_000  # 4 MB
    body: dict[str, Any] = {
        "model": "chat-small",
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    held, _ = await _held_while_open(stack_factory, body, "*/sidecar/admission.py")
    assert held < 100_000, f"{held} bytes parsed from the request still held by the open stream"


async def test_an_open_stream_does_not_keep_its_rate_limit_headers(
    stack_factory: StackFactory,
) -> None:
    body = {"model": "chat-small", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    limits = {"requests_per_minute": 1000, "tokens_per_minute": 1_000_000}
    held, headers = await _held_while_open(
        stack_factory, body, "*/sidecar/limits.py", **{"teams.0.limits": limits}
    )
    assert headers["x-ratelimit-limit-requests"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"].isdigit()
    assert held < 400, f"{held} bytes of the admission's limits still held by the open stream"
