"""The relay gives the same behind any ASGI server: with the client's raw writer (the sidecar's own
server) or with ``send`` and ``receive`` only (plain uvicorn, ``sidecar.send_writer``)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from infermeter.serving import free_port
from infermeter.spool import read_segment
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import running, serving
from tests.sidecar.conftest import KEYS, Stack, make_config
from tests.sidecar.test_fetch import _certificate
from tests.sidecar.test_proxy_whole import _engine
from tests.sidecar.test_stream import n2_upstream

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


@contextlib.asynccontextmanager
async def _clients(stack: Stack) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """A client of the stack's sidecar on its own server, and one of the same sidecar on plain
    uvicorn, which gives no raw writer."""
    config = uvicorn.Config(
        stack.sidecar, "127.0.0.1", free_port(), lifespan="off", log_level="warning"
    )
    async with (
        running(uvicorn.Server(config)) as url,
        stack.client() as own,
        httpx.AsyncClient(base_url=url, headers=own.headers, timeout=60) as plain,
    ):
        yield own, plain


@pytest.mark.parametrize(
    "options",
    [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}],
)
async def test_a_stream_is_the_same_byte_for_byte_behind_either_server(
    stack_factory, fixture_text, options
):
    """A real vLLM capture reaches the client identically with and without the raw writer."""
    capture = fixture_text("vllm-0.32-chat-stream-continuous-usage.sse").encode()
    body = {**CHAT, "stream": True, **({"stream_options": options} if options else {})}
    stack = await stack_factory(upstream_app=_capture_upstream(capture))
    seen = []
    async with _clients(stack) as clients:
        for c in clients:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
            seen.append(r.content)
            assert (await stack.records())[-1]["status"] == "ok"
    assert seen[0] == seen[1]
    assert seen[1].endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("assembled", [True, False])
async def test_whole_answers_and_refusals_are_the_same_behind_either_server(
    stack_factory, assembled
):
    """A non-streamed completion (assembled from vLLM's stream, or relayed whole) and a 404 for
    an unknown model answer alike with and without the raw writer."""
    stack = await stack_factory(**{"sidecar.non_streamed_via_stream": assembled})
    results = []
    async with _clients(stack) as clients:
        for c in clients:
            whole = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
            missing = await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
            results.append((whole.status_code, missing.status_code, sorted(whole.json())))
            assert (await stack.records())[-2]["completion_tokens"] == 4
    assert results[0] == results[1] == (200, 404, results[0][2])


async def test_a_stream_whose_client_leaves_behind_plain_uvicorn_is_aborted_and_billed(
    stack_factory,
):
    """Without the raw writer, ASGI's disconnect ends the stream: vLLM's request is aborted (the
    upstream connection closed) and the record is client_aborted with what vLLM had sent."""
    stack = await stack_factory()
    config = uvicorn.Config(
        stack.sidecar, "127.0.0.1", free_port(), lifespan="off", log_level="warning"
    )
    async with running(uvicorn.Server(config)) as url:
        reader, writer = await _ask(
            url, {**CHAT, "stream": True, "max_tokens": 3000, "ignore_eos": True}
        )
        got = b""
        while got.count(b"data: ") < 3:
            got += await asyncio.wait_for(reader.read(65536), 10)
        writer.close()
        for _ in range(100):
            if await stack.records():
                break
            await asyncio.sleep(0.05)
    (record,) = await stack.records()
    assert record["status"] == "client_aborted"
    assert record["completion_tokens"] > 0
    await asyncio.sleep(0.3)
    assert (await _engine(stack.upstream))["vllm:num_requests_running"] == 0


async def test_a_client_of_plain_uvicorn_that_stops_reading_pauses_the_upstream(stack_factory):
    """Without the raw writer, ASGI's send waiting on a full socket buffer holds the upstream
    back too (``sidecar.send_writer``), instead of the sidecar buffering the whole answer."""
    sent, flood = _flood()
    stack = await stack_factory(upstream_app=flood)
    config = uvicorn.Config(
        stack.sidecar, "127.0.0.1", free_port(), lifespan="off", log_level="warning"
    )
    async with running(uvicorn.Server(config)) as url:
        await _read_nothing(url, sent)


async def test_an_unreachable_upstream_is_502(stack_factory):
    """No vLLM listening: a stream is refused with 502 before any SSE, and recorded."""
    stack = await stack_factory()
    stack.sidecar.upstream = f"http://127.0.0.1:{free_port()}"
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unreachable"
    assert (await stack.records())[-1]["status"] == "upstream_error"


@pytest.mark.parametrize("assembled", [True, False])
async def test_an_https_upstream_serves_streams_and_whole_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, assembled: bool
) -> None:
    """A replica behind TLS takes the same pool: a stream and a whole answer (assembled from
    vLLM's stream, or relayed whole) come through and are metered."""
    cert, key = _certificate(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # read when the pool makes its SSL context
    port = free_port()
    config = make_config(
        f"https://127.0.0.1:{port}", **{"sidecar.non_streamed_via_stream": assembled}
    )
    replica = uvicorn.Config(
        ReplicaSim(replica_spec(config, "small-0")),
        "127.0.0.1",
        port,
        ssl_certfile=str(cert),
        ssl_keyfile=str(key),
        log_level="warning",
    )
    sidecar = Sidecar(config, "small-0", spool_dir=tmp_path / "spool")
    async with (
        running(uvicorn.Server(replica)),
        serving(sidecar, limits=sidecar.server_limits) as url,
        httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEYS['search']}"}) as c,
    ):
        streamed = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        whole = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        await sidecar.accounting.flush()
    assert streamed.status_code == whole.status_code == 200
    assert streamed.content.endswith(b"data: [DONE]\n\n")
    assert whole.json()["usage"]["completion_tokens"] == 4
    records = [
        r
        for seg in sorted(sidecar.spool.directory.glob("seg-*.jsonl"))
        for r in read_segment(seg)[0]
    ]
    assert [(r["status"], r["completion_tokens"]) for r in records] == [("ok", 16), ("ok", 4)]


def _flood() -> tuple[list[int], Any]:
    """An upstream that streams 64 MB as fast as it is taken, and how many bytes it has sent."""
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 900 + b'"}}]}\n\n'
    sent = [0]

    async def flood(scope, receive, send):
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
        while sent[0] < _FLOOD_BYTES:
            await send({"type": "http.response.body", "body": block, "more_body": True})
            sent[0] += len(block)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return sent, flood


_FLOOD_BYTES = 64 << 20


async def _ask(url: str, body: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send ``body`` to ``url`` on a connection of its own and read the response's head."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = orjson.dumps(body)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + KEYS["search"].encode() + b"\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
    )
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    return reader, writer


async def _read_nothing(url: str, sent: list[int]) -> None:
    """Ask ``url`` for a stream, read its head and nothing more: the upstream must stall."""
    _, writer = await _ask(url, {**CHAT, "stream": True})
    try:
        deadline = time.monotonic() + 1.5
        previous = -1
        while time.monotonic() < deadline and sent[0] != previous:
            previous = sent[0]
            await asyncio.sleep(0.5)
    finally:
        writer.close()
    assert sent[0] < _FLOOD_BYTES // 2, (
        f"the upstream wrote {sent[0]} bytes to a client that read none"
    )


async def test_a_client_that_stops_reading_pauses_the_upstream(stack_factory):
    """A client that reads nothing holds the upstream back instead of the sidecar buffering it all."""
    sent, flood = _flood()
    stack = await stack_factory(upstream_app=flood)
    await _read_nothing(stack.url, sent)


def test_the_old_relay_switch_still_loads_and_says_it_has_no_effect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``sidecar.protocol_relay: false`` (which once chose aiohttp) keeps a config loading, and
    the sidecar says at start that it changes nothing; true, the default, says nothing."""
    for value in (True, False):
        config = make_config("http://127.0.0.1:1", **{"sidecar.protocol_relay": value})
        caplog.clear()
        Sidecar(config, "small-0", spool_dir=tmp_path / str(value))
        warned = [r.getMessage() for r in caplog.records if "protocol_relay" in r.getMessage()]
        said = "sidecar.protocol_relay: false has no effect: one relay serves every request"
        assert warned == ([] if value else [said])


async def test_vllms_own_error_event_mid_stream_is_an_upstream_error(stack_factory, fixture_text):
    """vLLM failed a stream after its head (its own error event, then ``[DONE]``; here a
    completion with n=2, echo and logprobs, which vLLM 0.32 fails at times with ``KeyError: 0``):
    behind either server the client gets vLLM's stream as it would without usage, its error event
    and ``[DONE]`` included, and the record says ``upstream_error`` with the counts of the last
    chunk, as the same failure of a non-streamed request does. It said ``ok``."""
    capture = fixture_text("vllm-0.32-completions-stream-n2-echo-error.sse").encode()
    stack = await stack_factory(upstream_app=_capture_upstream(capture))
    body = {
        "model": "chat-small",
        "prompt": 'Say "hi"',
        "max_tokens": 6,
        "n": 2,
        "logprobs": 2,
        "echo": True,
        "stream": True,
    }
    without_usage = re.sub(rb',"usage":\{[^{}]*\}', b"", capture)
    async with _clients(stack) as clients:
        for c in clients:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200
            assert r.content == without_usage
            record = (await stack.records())[-1]
            assert record["status"] == "upstream_error"
            assert (record["prompt_tokens"], record["completion_tokens"]) == (21, 2)


async def test_a_plain_n2_stream_has_vllms_fingerprint_on_both_finish_chunks(stack_factory):
    """A stream of two choices for a client that did not ask for usage: from the replica's second
    stream on, behind either server, the client gets vLLM's own bytes, the fingerprint on both
    finish chunks (the sidecar knows it from the replica's earlier final usage chunk)."""
    plain, upstream = n2_upstream()
    stack = await stack_factory(upstream_app=_capture_upstream(upstream))
    body = {**CHAT, "max_tokens": 3, "n": 2, "stream": True}
    async with _clients(stack) as clients:
        assert (await clients[0].post("/v1/chat/completions", json=body)).status_code == 200
        for c in clients:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.content == plain
