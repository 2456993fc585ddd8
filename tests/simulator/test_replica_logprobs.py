"""Log-probabilities and echo as vLLM 0.32 sends them (tests/fixtures holds its answers).

Shapes are compared with the captures (key order, nesting, value types), with the token strings
that key the completions' ``top_logprobs`` and ``prompt_logprobs`` maps taken as keys of any
name; the rest is what holds between the parts of an answer: one entry per token, the sampled
token first among its alternatives, the bytes of its text, offsets that add up, the echoed
prompt and its ids in the first chunk, and the same seeded request streamed or not.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from tests.simulator.shapes import classify, skeleton, sse_events

MESSAGES = [{"role": "user", "content": "Hello world 123"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "seed": 7, "ignore_eos": True}
CHAT_LOGPROBS = {**CHAT, "logprobs": True, "top_logprobs": 2}
PROMPT = 'Say "hi" \\ data: [DONE]\n'
TEXT_ECHO = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "seed": 7, "ignore_eos": True}
TEXT_LOGPROBS = {**TEXT_ECHO, "logprobs": 2, "echo": True}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}


def shape(value: Any, key: str = "") -> Any:
    """``skeleton``, but a map keyed by token strings or ids is taken by its first value."""
    if isinstance(value, dict) and key in ("top_logprobs", "prompt_logprobs"):
        return [("<token>", shape(next(iter(value.values()))))] if value else []
    if isinstance(value, dict):
        return [(k, shape(v, k)) for k, v in value.items()]
    if isinstance(value, list):
        first = next((v for v in value if v is not None), None)
        return [shape(first, key)] if value else []
    return skeleton(value)


def stream_shapes(raw: bytes | str) -> dict[str, Any]:
    """Each kind of a stream's events and the shape of its first event of that kind."""
    out: dict[str, Any] = {}
    for payload in sse_events(raw):
        if payload != "[DONE]":
            out.setdefault(classify(payload), shape(orjson.loads(payload)))
    return out


def chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of a stream that carry a choice."""
    events = [orjson.loads(p) for p in sse_events(raw) if p != "[DONE]"]
    return [e for e in events if e["choices"]]


async def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}{path}", json=body)
    assert response.status_code == 200, response.text
    return response


async def test_chat_logprobs_stream_has_the_shape_of_vllms(replica, fixture_text):
    """Each token chunk carries its token, logprob, bytes and top_logprobs; the role chunk
    none; the top_logprobs list the sampled token first, as many as asked for."""
    _, url = replica
    response = await _post(url, "/v1/chat/completions", {**CHAT_LOGPROBS, **USAGE})
    real = fixture_text("vllm-0.32-chat-stream-logprobs.sse")
    assert stream_shapes(response.content) == stream_shapes(real)
    for chunk in chunks(response.content):
        choice = chunk["choices"][0]
        if "role" in choice["delta"]:
            assert choice["logprobs"] is None
            continue
        (entry,) = choice["logprobs"]["content"]
        assert bytes(entry["bytes"]) == entry["token"].encode()
        assert len(entry["top_logprobs"]) == 2
        assert {k: entry["top_logprobs"][0][k] for k in ("token", "logprob")} == {
            "token": entry["token"],
            "logprob": entry["logprob"],
        }


async def test_chat_logprobs_whole_answer_has_the_shape_of_vllms(replica, fixture_text):
    """One entry per completion token, and the stream's values for the same seeded request."""
    _, url = replica
    whole = (await _post(url, "/v1/chat/completions", CHAT_LOGPROBS)).json()
    real = orjson.loads(fixture_text("vllm-0.32-chat-nonstream-logprobs.json"))
    assert shape(whole) == shape(real)
    (choice,) = whole["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    streamed = await _post(url, "/v1/chat/completions", {**CHAT_LOGPROBS, "stream": True})
    entries = [
        e
        for c in chunks(streamed.content)
        for e in (c["choices"][0]["logprobs"] or {}).get("content", [])
    ]
    assert entries == content


async def test_chat_logprobs_without_top_logprobs_list_none(replica):
    """``logprobs: true`` alone: every entry's top_logprobs is an empty list, as vLLM's."""
    _, url = replica
    whole = (await _post(url, "/v1/chat/completions", {**CHAT, "logprobs": True})).json()
    assert all(e["top_logprobs"] == [] for e in whole["choices"][0]["logprobs"]["content"])


async def test_asking_for_logprobs_changes_no_text(replica):
    """The same seeded request with and without log-probabilities draws the same tokens."""
    _, url = replica
    plain = (await _post(url, "/v1/chat/completions", CHAT)).json()
    asked = (await _post(url, "/v1/chat/completions", CHAT_LOGPROBS)).json()
    assert plain["choices"][0]["message"] == asked["choices"][0]["message"]
    assert plain["usage"] == asked["usage"]


async def test_echo_logprobs_stream_has_the_shape_of_vllms(replica, fixture_text):
    """The first chunk carries the prompt, its token ids and its tokens' log-probabilities (the
    first one null) before the first generated token; text_offset runs on across chunks."""
    _, url = replica
    response = await _post(url, "/v1/completions", {**TEXT_LOGPROBS, **USAGE})
    real = fixture_text("vllm-0.32-completions-stream-logprobs-echo.sse")
    assert stream_shapes(response.content) == stream_shapes(real)
    first, *rest = [c["choices"][0] for c in chunks(response.content)]
    assert first["text"].startswith(PROMPT)
    logprobs = first["logprobs"]
    assert len(first["prompt_token_ids"]) == len(logprobs["tokens"]) - 1
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"]) == first["text"]
    offsets = [o for c in [first, *rest] for o in c["logprobs"]["text_offset"]]
    tokens = [t for c in [first, *rest] for t in c["logprobs"]["tokens"]]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for choice in rest:
        assert choice["prompt_token_ids"] is None
        (top,) = choice["logprobs"]["top_logprobs"]
        assert len(top) == 3
        assert next(iter(top.items())) == (
            choice["logprobs"]["tokens"][0],
            choice["logprobs"]["token_logprobs"][0],
        )


async def test_echo_logprobs_whole_answer_has_the_shape_of_vllms(replica, fixture_text):
    """The text is the prompt then the completion, the logprobs the prompt's tokens then the
    completion's, and prompt_logprobs the prompt's by token id, as the stream gives them."""
    _, url = replica
    whole = (await _post(url, "/v1/completions", TEXT_LOGPROBS)).json()
    real = orjson.loads(fixture_text("vllm-0.32-completions-nonstream-logprobs-echo.json"))
    assert shape(whole) == shape(real)
    (choice,) = whole["choices"]
    assert choice["text"].startswith(PROMPT)
    prompt = whole["usage"]["prompt_tokens"]
    assert len(choice["logprobs"]["tokens"]) == prompt + whole["usage"]["completion_tokens"]
    assert len(choice["prompt_logprobs"]) == prompt
    assert choice["prompt_logprobs"][0] is None
    streamed = await _post(url, "/v1/completions", {**TEXT_LOGPROBS, "stream": True})
    parts = [c["choices"][0] for c in chunks(streamed.content)]
    assert "".join(p["text"] for p in parts) == choice["text"]
    assert [t for p in parts for t in p["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]


async def test_echo_without_logprobs_prepends_the_prompt(replica):
    """``echo`` alone: the prompt leads the text, and the stream's first chunk has its ids."""
    _, url = replica
    whole = (await _post(url, "/v1/completions", {**TEXT_ECHO, "echo": True})).json()
    plain = (await _post(url, "/v1/completions", TEXT_ECHO)).json()
    assert whole["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    assert whole["choices"][0]["logprobs"] is None
    streamed = await _post(url, "/v1/completions", {**TEXT_ECHO, "echo": True, "stream": True})
    first = chunks(streamed.content)[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert first["logprobs"] is None
    assert all(isinstance(i, int) for i in first["prompt_token_ids"])
