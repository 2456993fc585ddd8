"""The simulator against real vLLM 0.32 (CPU build): same requests, same wire format.

Token texts and counts differ (the simulator has no tokenizer of the tiny model); everything a
client or proxy parses must not: SSE framing, chunk sequence, JSON key order and types, error
status and bodies, headers, /metrics families, and what a disconnect does to the counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.replica import ReplicaSim
from tests.servers import serving
from tests.simulator.conftest import tiny_spec
from tests.simulator.shapes import classify, skeleton, sse_events
from tests.simulator.test_replica_logprobs import shape, stream_shapes

pytestmark = pytest.mark.real_vllm

MSG = [{"role": "user", "content": "Hello world 123"}]
CHAT = {"model": "tiny", "messages": MSG, "max_tokens": 6, "ignore_eos": True}
COMPLETION = {"model": "tiny", "prompt": "Hello world 123", "max_tokens": 6, "ignore_eos": True}


@pytest.fixture
async def both(real_vllm: str) -> AsyncIterator[tuple[str, str]]:
    """(real vLLM URL, simulator URL), the simulator shaped like the real server."""
    async with serving(ReplicaSim(tiny_spec())) as sim_url:
        yield real_vllm, sim_url


async def _post(
    url: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        return await client.post(
            url + path,
            content=content,
            headers={"content-type": "application/json", **(headers or {})},
        )


def _stream_layout(raw: bytes) -> dict[int | None, list[tuple[str, Any]]]:
    """Per choice index, the kind and JSON shape of each event, runs of tokens collapsed.

    With n > 1 vLLM runs each choice as its own sequence, so how the choices interleave depends
    on timing; what each choice's own sequence of events looks like does not.
    """
    out: dict[int | None, list[tuple[str, Any]]] = {}
    for payload in sse_events(raw):
        kind = classify(payload)
        data = None if kind == "done" else orjson.loads(payload)
        index = data["choices"][0]["index"] if data and data["choices"] else None
        events = out.setdefault(index, [])
        shape = None if data is None else skeleton(data)
        if events and events[-1][0] == kind == "token" and events[-1][1] == shape:
            continue
        events.append((kind, shape))
    return out


STREAMS = [
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
    (
        "/v1/chat/completions",
        {
            **CHAT,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
    ),
    # Without usage, vLLM stamps system_fingerprint on each choice's finish chunk.
    ("/v1/chat/completions", {**CHAT, "n": 2, "stream": True}),
    ("/v1/completions", {**COMPLETION, "stream": True}),
    ("/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}),
]


@pytest.mark.parametrize(("path", "body"), STREAMS)
async def test_streams_have_the_same_framing_and_shapes(both, path, body):
    """Every streamed variant: same event sequence and JSON shapes, same headers."""
    real, sim = both
    a, b = await _post(real, path, body), await _post(sim, path, body)
    assert (a.status_code, b.status_code) == (200, 200)
    for header in ("content-type", "vary"):
        assert a.headers.get(header) == b.headers.get(header), header
    # Empty-text chunks (a token ending inside a UTF-8 character) have the token shape too,
    # so the layout comparison is independent of where they fall.
    assert _stream_layout(b.content) == _stream_layout(a.content)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", COMPLETION),
        ("/v1/chat/completions", {**CHAT, "n": 2}),
    ],
)
async def test_non_streamed_responses_have_the_same_shape(both, path, body):
    """Non-streamed chat and text completions: same keys in the same order, same usage."""
    real, sim = both
    a, b = await _post(real, path, body), await _post(sim, path, body)
    assert skeleton(b.json()) == skeleton(a.json())
    assert a.headers["content-type"] == b.headers["content-type"]
    assert b.json()["usage"]["completion_tokens"] == a.json()["usage"]["completion_tokens"]


LOGPROBS = [
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}),
    ("/v1/completions", {**COMPLETION, "logprobs": 2}),
    ("/v1/completions", {**COMPLETION, "logprobs": 2, "echo": True}),
    ("/v1/completions", {**COMPLETION, "echo": True}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("path", "body"), LOGPROBS)
async def test_logprobs_and_echo_have_the_same_shapes(both, path, body, stream):
    """Log-probabilities and echo, streamed and whole: the same shapes (the token strings that
    key the completions' maps aside) and as many entries per token and per choice."""
    real, sim = both
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    a, b = await _post(real, path, body), await _post(sim, path, body)
    assert (a.status_code, b.status_code) == (200, 200)
    if stream:
        assert stream_shapes(b.content) == stream_shapes(a.content)
        return
    assert shape(b.json()) == shape(a.json())
    for ours, theirs in zip(b.json()["choices"], a.json()["choices"], strict=True):
        if ours["logprobs"] is None:
            assert theirs["logprobs"] is None
            continue
        for key, value in ours["logprobs"].items():
            # A completion's echo lists each prompt token: the prompts' tokens differ in number.
            if not body.get("echo"):
                assert len(value) == len(theirs["logprobs"][key]), key


ERRORS = [
    ("/v1/chat/completions", {**CHAT, "model": "nope"}),
    ("/v1/completions", {**COMPLETION, "model": "nope"}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 5000}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 5000, "stream": True}),
    ("/v1/completions", {**COMPLETION, "max_tokens": 5000}),
    ("/v1/chat/completions", {"model": "tiny", "messages": "notalist"}),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 5}),
    ("/v1/completions", {"model": "tiny", "max_tokens": 5}),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": " ".join(map(str, range(700)))}],
        },
    ),
    ("/v1/completions", {"model": "tiny", "prompt": " ".join(map(str, range(700)))}),
]


@pytest.mark.parametrize(("path", "body"), ERRORS)
async def test_errors_are_identical(both, path, body):
    """Bad requests: same status, same error JSON, byte for byte."""
    real, sim = both
    a, b = await _post(real, path, body), await _post(sim, path, body)
    assert b.status_code == a.status_code
    assert b.json() == a.json()


async def test_invalid_json_error_is_identical(both):
    """Invalid JSON: same status and body, byte offset included."""
    real, sim = both
    body = b'{"model": "tiny", "messages": [{"role": "user" "content": "x"}]}'
    a, b = (
        await _post(real, "/v1/chat/completions", body),
        await _post(sim, "/v1/chat/completions", body),
    )
    assert (b.status_code, b.json()) == (a.status_code, a.json())


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/chat/completions"),
        ("GET", "/v1/nope"),
        ("POST", "/v1/embeddings"),
        ("GET", "/version"),
    ],
)
async def test_routing_answers_are_identical(both, method, path):
    """Wrong method, unknown path, embeddings on a generative model, /version."""
    real, sim = both
    async with httpx.AsyncClient() as client:
        a = await client.request(method, real + path, json={} if method == "POST" else None)
        b = await client.request(method, sim + path, json={} if method == "POST" else None)
    assert (b.status_code, b.json()) == (a.status_code, a.json())
    assert b.headers.get("allow") == a.headers.get("allow")


async def test_models_and_health_have_the_same_shape(both):
    """/v1/models lists the same fields; /health is an empty 200."""
    real, sim = both
    async with httpx.AsyncClient() as client:
        for path in ("/v1/models", "/health"):
            a, b = await client.get(real + path), await client.get(sim + path)
            assert (b.status_code, b.headers.get("content-type")) == (
                a.status_code,
                a.headers.get("content-type"),
            )
            if path == "/health":
                assert a.content == b.content == b""
            else:
                assert skeleton(b.json()) == skeleton(a.json())


async def test_x_request_id_sets_the_id_on_both(both):
    """X-Request-Id becomes chatcmpl-<id> on real vLLM and on the simulator."""
    real, sim = both
    for url in (real, sim):
        r = await _post(url, "/v1/chat/completions", CHAT, headers={"X-Request-Id": "conf-1"})
        assert r.json()["id"] == "chatcmpl-conf-1"


def _families(text: str) -> dict[str, tuple[str, frozenset[str], tuple[str, ...]]]:
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("vllm:"):
            labels = frozenset(k for s in fam.samples for k in s.labels if k != "le")
            buckets = tuple(
                dict.fromkeys(s.labels["le"] for s in fam.samples if s.name.endswith("_bucket"))
            )
            out[fam.name] = (fam.type, labels, buckets)
    return out


def _value(text: str, name: str) -> float:
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


async def test_metrics_have_the_same_families_and_content_type(both):
    """Every vllm: family: same type, labels and buckets; same exposition content type."""
    real, sim = both
    async with httpx.AsyncClient() as client:
        a, b = await client.get(f"{real}/metrics"), await client.get(f"{sim}/metrics")
    assert b.headers["content-type"] == a.headers["content-type"]
    assert _families(b.text) == _families(a.text)


async def test_counters_move_the_same_way(both):
    """One n=2 request moves prompt, generation and success counters alike on both."""
    real, sim = both
    deltas = []
    async with httpx.AsyncClient(timeout=120) as client:
        for url in (real, sim):
            before = (await client.get(f"{url}/metrics")).text
            usage = (await _post(url, "/v1/chat/completions", {**CHAT, "n": 2})).json()["usage"]
            after = (await client.get(f"{url}/metrics")).text
            deltas.append(
                (
                    (
                        _value(after, "vllm:prompt_tokens_total")
                        - _value(before, "vllm:prompt_tokens_total")
                    )
                    / usage["prompt_tokens"],
                    _value(after, "vllm:generation_tokens_total")
                    - _value(before, "vllm:generation_tokens_total"),
                    _value(after, "vllm:request_success_total")
                    - _value(before, "vllm:request_success_total"),
                )
            )
    assert deltas[1] == deltas[0] == (2.0, 12.0, 2.0)


async def test_disconnect_aborts_alike(both):
    """A client that hangs up after 5 tokens: generation stops, no success is counted.

    Real vLLM aborts a request when it sees the hang-up. Once, in a full test run on this
    2-core machine, the tiny CPU model had generated all 400 tokens and counted a success
    before that, so the pair is measured up to three times, until real vLLM's abort is seen;
    the simulator must then behave the same.
    """
    real, sim = both
    results: list[tuple[bool, float, float]] = []
    async with httpx.AsyncClient(timeout=120) as client:
        for _attempt in range(3):
            results = [await _hang_up_after_five_tokens(client, url) for url in (real, sim)]
            if results[0] == (True, 0.0, 0.0):
                break
    assert results[1] == results[0] == (True, 0.0, 0.0)


async def _hang_up_after_five_tokens(
    client: httpx.AsyncClient, url: str
) -> tuple[bool, float, float]:
    """(generation stopped early, successes counted, requests still running) after a hang-up."""
    before = (await client.get(f"{url}/metrics")).text
    body = {**CHAT, "max_tokens": 400, "stream": True}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 6:  # the role chunk and 5 tokens
                break
    await asyncio.sleep(2.0)
    after = (await client.get(f"{url}/metrics")).text
    generated = _value(after, "vllm:generation_tokens_total") - _value(
        before, "vllm:generation_tokens_total"
    )
    success = _value(after, "vllm:request_success_total") - _value(
        before, "vllm:request_success_total"
    )
    return generated < 400, success, _value(after, "vllm:num_requests_running")
