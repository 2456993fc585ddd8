"""Non-streamed requests through the sidecar, against the simulator: exact bytes, exact usage, ids."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sidecar.conftest import Stack
from tests.sidecar.test_proxy_accounting import _breaks_mid_stream, _engine_dies, _engine_stalls

# The relay runs on uvloop in the sidecar process and on either loop in tests (conftest).
pytestmark = pytest.mark.both_loops

CHAT = {
    "model": "chat-small",
    "messages": [{"role": "user", "content": "count please"}],
    "max_tokens": 12,
}
TEXT = {"model": "chat-small", "prompt": "a b c", "max_tokens": 9}
_VOLATILE = re.compile(rb'"id":"[^"]*"|"created":\d+')


async def _engine(url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"{url}/metrics")).text
    names = (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
    )
    return {
        n: sum(
            s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == n
        )
        for n in names
    }


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions", {**CHAT, "n": 2, "stream": False}),
        ("/v1/completions", TEXT),
        ("/v1/completions", {**TEXT, "prompt": ["a b", "c d e"]}),
        # Cut at a stop string: finish_reason stop, the string as stop_reason, the text before it.
        ("/v1/chat/completions", {**CHAT, "n": 2, "stop": ["1", "7"], "ignore_eos": True}),
        ("/v1/completions", {**TEXT, "stop": "3", "ignore_eos": True}),
    ],
)
async def test_the_body_is_the_one_vllm_sends_for_the_non_streamed_request(stack, path, body):
    """The client gets the replica's own non-streamed bytes, but for the id and creation time."""
    async with stack.client() as c:
        via = await c.post(path, json=body)
    async with httpx.AsyncClient(base_url=stack.upstream, timeout=60) as c:
        direct = await c.post(
            path, json={**body, "model": stack.sidecar.view.route("chat-small").served_version}
        )
    assert via.status_code == direct.status_code == 200
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert _VOLATILE.sub(b"", via.content) == _VOLATILE.sub(b"", direct.content)
    if "stop" in body:  # the case is only worth its name when the stop string was met
        assert all(c["stop_reason"] for c in direct.json()["choices"])
    (record,) = await stack.records()
    assert record["response_id"] == via.json()["id"]
    assert record["completion_tokens"] == via.json()["usage"]["completion_tokens"]


# Token strings ride in these answers: a prompt holding quotes, a backslash, "usage":{ and an SSE
# field comes back in the echo and in the prompt's log-probabilities.
TRICKY = 'a "b" \\ "usage":{"prompt_tokens":1} data: [DONE]\n\n'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3, "seed": 5}),
        ("/v1/chat/completions", {**CHAT, "n": 2, "logprobs": True, "seed": 5}),
        ("/v1/completions", {**TEXT, "prompt": TRICKY, "logprobs": 2, "seed": 5}),
        ("/v1/completions", {**TEXT, "prompt": TRICKY, "logprobs": 2, "echo": True, "seed": 5}),
        ("/v1/completions", {**TEXT, "prompt": ["a b", TRICKY], "logprobs": 1, "echo": True}),
    ],
)
async def test_logprobs_and_echo_reach_the_client_as_the_replica_sends_them(
    stack, path, body, stream
):
    """Log-probabilities and echo are relayed as they are (the assembler takes neither), streamed
    or not: the replica's own bytes but for the id and creation time, and its usage recorded."""
    body = {**body, "stream": stream}
    served = stack.sidecar.view.route("chat-small").served_version
    async with stack.client() as c:
        # A stream of several choices takes the fingerprint of the replica's previous stream
        # for the finish chunks it sends before its own usage chunk.
        warm = {**CHAT, "max_tokens": 1, "stream": True}
        assert (await c.post("/v1/chat/completions", json=warm)).status_code == 200
        via = await c.post(path, json=body)
    async with httpx.AsyncClient(base_url=stack.upstream, timeout=60) as c:
        direct = await c.post(path, json={**body, "model": served})
        counted = await c.post(
            path,
            json={**body, "model": served}
            | ({"stream_options": {"include_usage": True}} if stream else {}),
        )
    assert via.status_code == direct.status_code == 200
    assert b'"logprobs":{' in direct.content
    assert _VOLATILE.sub(b"", via.content) == _VOLATILE.sub(b"", direct.content)
    if stream:
        usage = orjson.loads(counted.content.split(b"\n\n")[-3][6:])["usage"]
    else:
        usage = counted.json()["usage"]
    record = (await stack.records())[-1]
    assert record["status"] == "ok"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


async def test_a_refused_non_streamed_request_gets_vllms_own_error(stack):
    """A body vLLM refuses is answered with its error, as for the non-streamed request."""
    body = {**CHAT, "max_tokens": 100_000}
    async with stack.client() as c:
        via = await c.post("/v1/chat/completions", json=body)
    async with httpx.AsyncClient(base_url=stack.upstream, timeout=60) as c:
        served = stack.sidecar.view.route("chat-small").served_version
        direct = await c.post("/v1/chat/completions", json={**body, "model": served})
    assert via.status_code == direct.status_code == 400
    assert via.content == direct.content
    (record,) = await stack.records()
    assert (record["status"], record["response_id"]) == ("bad_request", None)


@pytest.mark.parametrize(
    ("path", "asked"),
    [
        ("/v1/chat/completions", {}),
        # Relayed whole, a hang-up on these was recorded with no tokens at all.
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}),
        ("/v1/completions", {"prompt": "a b c", "logprobs": 1}),
        ("/v1/completions", {"prompt": "a b c", "echo": True}),
    ],
    ids=["plain", "chat-logprobs", "completions-logprobs", "echo"],
)
async def test_abandoned_non_streamed_requests_carry_the_tokens_spent(stack, path, asked):
    """Clients leaving mid-generation: upstream aborted at once, records hold vLLM's counts."""
    before = await _engine(stack.upstream)
    aborts = 5
    body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, **asked}
    if "prompt" in asked:
        del body["messages"]
    async with stack.client(timeout=0.4) as c:
        for _ in range(aborts):
            with pytest.raises(httpx.ReadTimeout):
                await c.post(path, json=body)
    await asyncio.sleep(0.3)
    after = await _engine(stack.upstream)
    assert after["vllm:num_requests_running"] == 0
    records = await stack.records()
    assert [(r["status"], r["http_status"], r["usage_exact"]) for r in records] == [
        ("client_aborted", 499, True)
    ] * aborts
    prefix = "chatcmpl-" if path == "/v1/chat/completions" else "cmpl-"
    assert all(r["response_id"].startswith(prefix) for r in records)
    assert (
        sum(r["prompt_tokens"] for r in records)
        == after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    )
    recorded = sum(r["completion_tokens"] for r in records)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    print(f"\ntokens generated after the last chunk read: {generated - recorded} over {aborts}")
    assert recorded > 0
    assert 0 <= generated - recorded <= 3 * aborts


@pytest.mark.parametrize("stream", [False, True])
async def test_the_callers_request_id_is_echoed_and_kept(stack, stream):
    """A valid x-request-id comes back in the response header and is on the record."""
    async with stack.client() as c:
        r = await c.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": stream},
            headers={"x-request-id": "trace-7f3a"},
        )
    assert r.status_code == 200
    assert r.headers.get_list("x-request-id") == ["trace-7f3a"]
    (record,) = await stack.records()
    assert record["client_request_id"] == "trace-7f3a"
    assert record["request_id"] == r.headers["x-infermeter-request-id"]
    assert record["response_id"].startswith("chatcmpl-")


@pytest.mark.parametrize("value", ["x" * 129, "two words", "<script>"])
async def test_an_invalid_request_id_is_ignored(stack, value):
    """An x-request-id out of bounds is neither an error, nor echoed, nor kept."""
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": value})
    assert r.status_code == 200
    assert "x-request-id" not in r.headers
    (record,) = await stack.records()
    assert record["client_request_id"] is None


async def test_a_refusal_echoes_the_request_id_too(stack):
    """An answer the sidecar gives itself (unknown model) still carries the caller's id."""
    async with stack.client() as c:
        r = await c.post(
            "/v1/chat/completions",
            json={**CHAT, "model": "nope"},
            headers={"x-request-id": "abc-1"},
        )
    assert r.status_code == 404
    assert r.headers["x-request-id"] == "abc-1"
    assert (await stack.records())[-1]["client_request_id"] == "abc-1"


@pytest.mark.parametrize(
    ("then", "settings", "status"),
    [(_engine_dies, {}, 502), (_engine_stalls, {"sidecar.read_timeout_seconds": 0.3}, 504)],
    ids=["dies", "stalls"],
)
async def test_upstream_breaking_mid_answer_is_an_error_with_the_usage_so_far(
    stack_factory, fixture_text, then, settings, status
):
    """vLLM dies or stalls part-way through a non-streamed answer: an error soon, usage recorded."""
    stack = await stack_factory(upstream_app=_breaks_mid_stream(fixture_text, then), **settings)
    async with stack.client() as c:
        started = time.perf_counter()
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert time.perf_counter() - started < 5
    assert r.status_code == status
    assert r.json()["error"]["type"] == "upstream_error"
    record = (await stack.records())[-1]
    assert (record["status"], record["response_id"]) == (
        "upstream_error",
        "chatcmpl-938c5aa6fcfb9c62",
    )
    assert (record["prompt_tokens"], record["completion_tokens"]) == (10, 3)


async def _records_after(stack: Stack, count: int, seconds: float = 5.0) -> list[dict[str, Any]]:
    """The spool's records once ``count`` are there (a finished answer is recorded at its end)."""
    deadline = time.monotonic() + seconds
    records: list[dict[str, Any]] = await stack.records()
    while len(records) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        records = await stack.records()
    return records


@pytest.mark.parametrize("n", [1, 2])
async def test_with_the_switch_off_a_hang_up_is_finished_and_billed_in_full(stack_factory, n):
    """``non_streamed_via_stream: false`` relays the request as sent, so nothing of it comes
    before its end: a client that leaves does not abort it (``whole_hang_up: finish``, the
    default), and its record holds the usage of vLLM's whole answer, every choice's tokens and
    each prompt once per choice, as vLLM's counters confirm. Aborted, it was recorded with no
    tokens."""
    stack = await stack_factory(**{"sidecar.non_streamed_via_stream": False})
    before = await _engine(stack.upstream)
    body = {**CHAT, "max_tokens": 400, "ignore_eos": True, "n": n}
    async with stack.client(timeout=0.2) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", json=body)
    (record,) = await _records_after(stack, 1)
    after = await _engine(stack.upstream)
    assert (record["status"], record["http_status"], record["usage_exact"]) == (
        "client_aborted",
        499,
        True,
    )
    assert (record["completion_tokens"], record["finish_reason"]) == (400 * n, "length")
    assert record["response_id"].startswith("chatcmpl-")
    assert after["vllm:num_requests_running"] == 0
    assert (record["prompt_tokens"] * n, record["completion_tokens"]) == (
        after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"],
        after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"],
    )


async def test_a_hang_up_on_a_request_relayed_whole_may_abort_it_instead(stack_factory):
    """``whole_hang_up: abort``: the connection closes as the client leaves, vLLM stops, and
    the record has no tokens (vLLM sends none before a whole answer's end)."""
    stack = await stack_factory(
        **{"sidecar.non_streamed_via_stream": False, "sidecar.whole_hang_up": "abort"}
    )
    async with stack.client(timeout=0.4) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 3000, "ignore_eos": True}
            )
    await asyncio.sleep(0.3)
    assert (await _engine(stack.upstream))["vllm:num_requests_running"] == 0
    (record,) = await stack.records()
    assert (record["status"], record["usage_exact"], record["completion_tokens"]) == (
        "client_aborted",
        False,
        0,
    )


async def _hang_up_behind_uvicorn(
    stack: Stack, max_tokens: int, timeout: float
) -> tuple[dict[str, Any], float]:
    """Behind a server that gives no raw writer (plain uvicorn: the ASGI disconnect is awaited
    instead), a non-streamed request whose client gives up after ``timeout``: its record, and
    the tokens vLLM generated meanwhile."""
    import uvicorn

    from infermeter.serving import free_port
    from tests.servers import running

    before = await _engine(stack.upstream)
    body = {**CHAT, "max_tokens": max_tokens, "ignore_eos": True}
    config = uvicorn.Config(
        stack.sidecar, "127.0.0.1", free_port(), lifespan="off", log_level="warning"
    )
    async with running(uvicorn.Server(config)) as url:
        key = {"authorization": "Bearer im-demo-search"}
        async with httpx.AsyncClient(base_url=url, headers=key, timeout=timeout) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/chat/completions", json=body)
        (record,) = await _records_after(stack, 1)
        await asyncio.sleep(0.3)
    after = await _engine(stack.upstream)
    assert after["vllm:num_requests_running"] == 0
    return record, after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]


async def test_a_hang_up_on_a_request_relayed_whole_is_finished_behind_plain_uvicorn(
    stack_factory,
):
    """Behind plain uvicorn too, the request relayed whole runs to its end after its client
    left and is billed in full."""
    stack = await stack_factory(**{"sidecar.non_streamed_via_stream": False})
    record, generated = await _hang_up_behind_uvicorn(stack, 400, 0.2)
    assert (record["status"], record["usage_exact"], record["completion_tokens"]) == (
        "client_aborted",
        True,
        400,
    )
    assert generated == 400


async def test_a_hang_up_without_the_raw_writer_is_billed_what_vllm_sent(stack):
    """Behind plain uvicorn, a non-streamed request read from vLLM's stream whose client leaves
    is still billed what vLLM had sent: read from the kernel before the close, where the
    batched reading leaves it."""
    record, generated = await _hang_up_behind_uvicorn(stack, 3000, 0.6)
    assert (record["status"], record["usage_exact"]) == ("client_aborted", True)
    assert generated > 20
    assert 0 <= generated - record["completion_tokens"] <= 3
