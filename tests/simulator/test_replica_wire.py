"""The simulated replica speaks vLLM 0.32's exact wire format, checked against real captures."""

from __future__ import annotations

import re
from typing import Any

import httpx
import orjson
import pytest

from tests.simulator.shapes import classify, kinds_in_order, skeleton, sse_events

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "count to ten"}],
    "max_tokens": 12,
}


def _by_kind(payloads: list[str]) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {}
    for p in payloads:
        kinds.setdefault(classify(p), []).append(p)
    return kinds


@pytest.mark.parametrize(
    ("fixture", "options"),
    [
        ("vllm-0.32-chat-stream-usage.sse", {"include_usage": True}),
        (
            "vllm-0.32-chat-stream-continuous-usage.sse",
            {"include_usage": True, "continuous_usage_stats": True},
        ),
    ],
)
async def test_chat_stream_matches_capture_chunk_by_chunk(replica, fixture_text, fixture, options):
    """Role chunk first, one token per chunk, finish chunk, usage chunk, [DONE]: same shapes."""
    _, url = replica
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{url}/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": options}
        )
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    ours, real = sse_events(response.content), sse_events(fixture_text(fixture))
    assert (
        kinds_in_order(ours) == kinds_in_order(real) == ["role", "token", "finish", "usage", "done"]
    )
    mine, theirs = _by_kind(ours), _by_kind(real)
    for kind in ("role", "token", "finish", "usage"):
        assert skeleton(orjson.loads(mine[kind][0])) == skeleton(orjson.loads(theirs[kind][0])), (
            kind
        )
    assert len(mine["token"]) + len(mine["finish"]) == 12


async def test_chat_stream_without_usage_option_has_no_usage_chunk(replica):
    """Without stream_options the stream carries no usage at all, as in vLLM."""
    _, url = replica
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True})
    payloads = sse_events(response.content)
    assert kinds_in_order(payloads) == ["role", "token", "finish", "done"]
    assert all(b'"usage"' not in p.encode() for p in payloads)


async def test_completion_stream_matches_capture(replica, fixture_text):
    """A streamed /v1/completions has the captured chunk and usage shapes."""
    _, url = replica
    body = {
        "model": "tiny",
        "prompt": "one two three",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/completions", json=body)
    ours, real = (
        sse_events(response.content),
        sse_events(fixture_text("vllm-0.32-completions-stream.sse")),
    )
    assert kinds_in_order(ours) == kinds_in_order(real)
    for a, b in zip(ours, real, strict=True):
        if b != "[DONE]":
            assert skeleton(orjson.loads(a)) == skeleton(orjson.loads(b))


async def test_chat_nonstream_matches_capture(replica, fixture_text):
    """A non-streamed chat completion has exactly the captured keys, in order."""
    _, url = replica
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json=CHAT)
    ours = response.json()
    assert skeleton(ours) == skeleton(orjson.loads(fixture_text("vllm-0.32-chat-nonstream.json")))
    assert ours["usage"]["completion_tokens"] == 12
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", ours["id"])
    assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", ours["system_fingerprint"])


async def test_models_listing_matches_capture(replica, fixture_text):
    """GET /v1/models lists the served model with vLLM's fields."""
    _, url = replica
    async with httpx.AsyncClient() as client:
        ours = (await client.get(f"{url}/v1/models")).json()
    real = orjson.loads(fixture_text("vllm-0.32-models.json"))
    assert skeleton(ours) == skeleton(real)
    assert ours["data"][0]["id"] == "tiny"
    assert ours["data"][0]["max_model_len"] == 512


def _captured_errors(text: str) -> list[tuple[dict[str, Any], int]]:
    lines = text.strip().splitlines()
    return [(orjson.loads(lines[i]), int(lines[i + 1].split()[1])) for i in range(0, len(lines), 2)]


@pytest.mark.parametrize(
    ("index", "path", "body"),
    [
        (0, "/v1/chat/completions", orjson.dumps({**CHAT, "model": "nope"})),
        (1, "/v1/chat/completions", orjson.dumps({**CHAT, "max_tokens": 5000})),
        (
            2,
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user" "content": "x"}]}',
        ),
        (3, "/v1/chat/completions", orjson.dumps({"model": "tiny", "messages": "notalist"})),
        (4, "/v1/chat/completions", orjson.dumps({**CHAT, "max_tokens": 5000, "stream": True})),
    ],
)
async def test_error_bodies_match_capture(replica, fixture_text, index, path, body):
    """Bad requests get vLLM's status and error JSON, before any SSE when streaming."""
    _, url = replica
    expected, status = _captured_errors(fixture_text("vllm-0.32-errors.txt"))[index]
    async with httpx.AsyncClient() as client:
        response = await client.post(
            url + path, content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    ours = response.json()
    assert skeleton(ours) == skeleton(expected)
    if index in (0, 1, 3, 4):
        assert ours == expected
    else:  # the byte offset of the JSON error depends on the body sent
        assert ours["error"]["type"] == expected["error"]["type"]
        assert "'msg': 'JSON decode error'" in ours["error"]["message"]
        assert "Expecting ',' delimiter" in ours["error"]["message"]


async def test_prompt_longer_than_context_is_rejected(replica):
    """A prompt that leaves no room in max_model_len is a 400 before generation starts."""
    _, url = replica
    body = {"model": "tiny", "prompt": "word " * 600, "max_tokens": 4}
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 400
    assert "maximum context length is 512 tokens" in response.json()["error"]["message"]


async def test_n_choices_stream_each_choice_and_sum_usage(replica):
    """n=2 streams both choice indexes and counts both in usage.completion_tokens."""
    _, url = replica
    body = {
        **CHAT,
        "n": 2,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json=body)
    payloads = [orjson.loads(p) for p in sse_events(response.content)[:-1]]
    indexes = [p["choices"][0]["index"] for p in payloads if p["choices"]]
    assert sorted(set(indexes)) == [0, 1]
    assert indexes.count(0) == indexes.count(1) == 5
    assert payloads[-1]["usage"]["completion_tokens"] == 8


async def test_same_request_gives_same_text_under_the_seed(replica):
    """Output is reproducible: the same prompt gives the same completion text."""
    _, url = replica
    async with httpx.AsyncClient() as client:
        a = (await client.post(f"{url}/v1/chat/completions", json=CHAT)).json()
        b = (await client.post(f"{url}/v1/chat/completions", json=CHAT)).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["id"] != b["id"]


async def test_health_and_unknown_paths(replica):
    """/health answers 200 with an empty body; unknown paths 404 like FastAPI."""
    _, url = replica
    async with httpx.AsyncClient() as client:
        health = await client.get(f"{url}/health")
        missing = await client.get(f"{url}/v2/nothing")
    assert (health.status_code, health.content) == (200, b"")
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})


async def test_chat_stream_without_usage_matches_capture(replica, fixture_text):
    """Without usage, the finish chunk is the last JSON chunk and alone carries system_fingerprint."""
    _, url = replica
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True})
    ours, real = sse_events(response.content), sse_events(fixture_text("vllm-0.32-chat-stream.sse"))
    mine, theirs = _by_kind(ours), _by_kind(real)
    for kind in ("role", "token", "finish"):
        assert skeleton(orjson.loads(mine[kind][-1])) == skeleton(orjson.loads(theirs[kind][-1])), (
            kind
        )
    assert [("system_fingerprint" in p) for p in ours[:-1]] == [False] * (len(ours) - 2) + [True]


async def test_n2_stream_without_usage_has_the_fingerprint_on_each_finish_chunk(
    replica, fixture_text
):
    """Without usage vLLM stamps system_fingerprint on every choice's finish chunk, not only the
    stream's last (the simulator stamped the last only)."""
    _, url = replica
    body = {**CHAT, "max_tokens": 3, "n": 2, "seed": 7, "stream": True}
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json=body)

    def stamps(payloads: list[str]) -> list[tuple[str, bool]]:
        return [(classify(p), "system_fingerprint" in p) for p in payloads if p != "[DONE]"]

    ours = stamps(sse_events(response.content))
    real = stamps(sse_events(fixture_text("vllm-0.32-chat-stream-n2.sse")))
    assert (
        sorted(set(ours))
        == sorted(set(real))
        == [
            ("finish", True),
            ("role", False),
            ("token", False),
        ]
    )
    assert ours.count(("finish", True)) == real.count(("finish", True)) == 2


async def test_completion_stream_with_usage_matches_capture(replica, fixture_text):
    """With usage, the usage chunk (not the finish chunk) carries system_fingerprint."""
    _, url = replica
    body = {
        "model": "tiny",
        "prompt": "Hello world",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/completions", json=body)
    ours, real = (
        sse_events(response.content),
        sse_events(fixture_text("vllm-0.32-completions-stream-usage.sse")),
    )
    assert [skeleton(orjson.loads(p)) for p in ours[-3:-1]] == [
        skeleton(orjson.loads(p)) for p in real[-3:-1]
    ]


async def test_completion_nonstream_matches_capture(replica, fixture_text):
    """A non-streamed text completion has exactly the captured keys, in order."""
    _, url = replica
    async with httpx.AsyncClient() as client:
        ours = (
            await client.post(
                f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 8}
            )
        ).json()
    assert skeleton(ours) == skeleton(
        orjson.loads(fixture_text("vllm-0.32-completions-nonstream.json"))
    )


async def test_n2_stream_order_matches_capture(replica, fixture_text):
    """n=2: a role chunk per choice first, then tokens interleaved by index, one usage chunk."""
    _, url = replica
    body = {
        **CHAT,
        "n": 2,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json=body)

    def layout(payloads: list[str]) -> list[tuple[str, int | None]]:
        out = []
        for p in payloads:
            kind = classify(p)
            index = (
                orjson.loads(p)["choices"][0]["index"]
                if kind in ("role", "token", "finish")
                else None
            )
            out.append((kind, index))
        return out

    assert layout(sse_events(response.content)) == layout(
        sse_events(fixture_text("vllm-0.32-chat-stream-n2-usage.sse"))
    )


@pytest.mark.parametrize(
    ("index", "method", "path", "body"),
    [
        (0, "POST", "/v1/completions", {"model": "tiny", "max_tokens": 5}),
        (
            1,
            "POST",
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "0 " * 700}]},
        ),
        (2, "POST", "/v1/completions", {"model": "tiny", "prompt": "0 " * 700}),
        (3, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 5, "temperature": "hot"}),
        (4, "POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 5}),
        (5, "GET", "/v1/chat/completions", None),
    ],
)
async def test_more_error_bodies_equal_capture(replica, fixture_text, index, method, path, body):
    """Missing prompt or messages, over-long prompts, wrong types and wrong methods: vLLM's exact bodies."""
    _, url = replica
    expected, status = _captured_errors(fixture_text("vllm-0.32-errors-more.txt"))[index]
    async with httpx.AsyncClient() as client:
        response = await client.request(method, url + path, json=body)
    assert (response.status_code, response.json()) == (status, expected)


_COMPLETION = {"model": "tiny", "prompt": "Hello"}
# The requests of vllm-0.32-errors-sampling.txt, in its order.
_SAMPLING_ERRORS = [
    ("/v1/chat/completions", {**CHAT, "n": 0}),
    ("/v1/completions", {**_COMPLETION, "n": -1}),
    ("/v1/completions", {**_COMPLETION, "n": 16385}),
    ("/v1/chat/completions", {**CHAT, "n": 2, "temperature": 0}),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}),
    ("/v1/completions", {**_COMPLETION, "temperature": 2.5}),
    ("/v1/completions", {**_COMPLETION, "top_p": 1.5}),
    ("/v1/completions", {**_COMPLETION, "presence_penalty": 3}),
    ("/v1/completions", {**_COMPLETION, "frequency_penalty": -3}),
    ("/v1/completions", {**_COMPLETION, "repetition_penalty": 0}),
    ("/v1/completions", {**_COMPLETION, "top_k": -5}),
    ("/v1/completions", {**_COMPLETION, "min_p": 2}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 5, "max_completion_tokens": 0}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 5, "max_completion_tokens": 600}),
    ("/v1/completions", {**_COMPLETION, "min_tokens": -1}),
    ("/v1/completions", {**_COMPLETION, "max_tokens": 2, "min_tokens": 5}),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}),
    (
        "/v1/completions",
        {**_COMPLETION, "model": "nope", "stream_options": {"include_usage": True}},
    ),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}),
    ("/v1/completions", {"model": "tiny", "prompt": []}),
    ("/v1/completions", {**_COMPLETION, "n": 0, "temperature": -0.5}),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 600, "max_tokens": 0}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [], "max_tokens": 600}),
]


@pytest.mark.parametrize(
    ("index", "path", "body"), [(i, *case) for i, case in enumerate(_SAMPLING_ERRORS)]
)
async def test_sampling_parameter_errors_equal_capture(replica, fixture_text, index, path, body):
    """Sampling parameters vLLM refuses (bad n, greedy n > 1, out-of-range temperature, top_p,
    penalties, max_tokens, min_tokens), an empty conversation or prompt list: its exact bodies,
    in its order of checks, and never a completion."""
    _, url = replica
    expected, status = _captured_errors(fixture_text("vllm-0.32-errors-sampling.txt"))[index]
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(url + path, json=body)
    assert (response.status_code, response.json()) == (status, expected)


async def test_prompt_plus_max_tokens_over_context_is_capped_not_refused(replica):
    """vLLM serves max_tokens that only overflow with the prompt, stopping at the context end."""
    _, url = replica
    body = {"model": "tiny", "prompt": "a b c d", "max_tokens": 510, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as client:
        usage = (await client.post(f"{url}/v1/completions", json=body)).json()["usage"]
    assert usage["total_tokens"] == 512


async def test_x_request_id_becomes_the_completion_id(replica):
    """An X-Request-Id header sets the id vLLM reports, as the sidecar relies on."""
    _, url = replica
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{url}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-123"}
        )
    assert response.json()["id"] == "chatcmpl-abc-123"


def _captured_heads(text: str) -> list[tuple[int, list[str]]]:
    """Status and header names, in order, of each response head in the capture."""
    heads = []
    for block in text.split("# ")[1:]:
        lines = [line for line in block.splitlines()[1:] if line]
        names = [line.split(":", 1)[0] for line in lines[1:]]
        heads.append((int(lines[0].split()[1]), [n for n in names if n not in ("date", "server")]))
    return heads


# The requests of vllm-0.32-response-heads.txt, in its order.
_HEAD_REQUESTS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 3, "ignore_eos": True}),
    ("POST", "/v1/chat/completions", {"model": "nope", "messages": []}),
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 3, "stream": True}),
]


@pytest.mark.parametrize("index", range(len(_HEAD_REQUESTS)))
async def test_response_heads_equal_capture(replica, fixture_text, index):
    """Whole responses carry content-length as vLLM's do (not chunked), streams are chunked, and
    the headers come in vLLM's order."""
    _, url = replica
    status, names = _captured_heads(fixture_text("vllm-0.32-response-heads.txt"))[index]
    method, path, body = _HEAD_REQUESTS[index]
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.request(method, url + path, json=body)
    ours = [name for name in response.headers if name not in ("date", "server")]
    assert (response.status_code, ours) == (status, names)
    if "content-length" in ours:
        assert int(response.headers["content-length"]) == len(response.content)


def _piece(payload: dict[str, Any]) -> str:
    choice = payload["choices"][0]
    return str(choice["delta"]["content"] if "delta" in choice else choice["text"])


@pytest.mark.parametrize(
    ("fixture", "path", "body"),
    [
        ("vllm-0.32-chat-stream-stop.sse", "/v1/chat/completions", {**CHAT}),
        ("vllm-0.32-completions-stream-stop.sse", "/v1/completions", _COMPLETION),
    ],
)
async def test_stop_string_ends_the_stream_as_in_capture(
    replica, fixture_text, fixture, path, body
):
    """A stop string ends its choice at the token that completes it, with finish_reason stop and
    the string as stop_reason; the text is cut before it and, while streaming, its length less
    one is held back: the capture stopped at its fifth token on "Must"."""
    _, url = replica
    real = sse_events(fixture_text(fixture))
    asked = {**body, "max_tokens": 12, "seed": 7, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        probe = await client.post(url + path, json=asked)
        texts = [_piece(orjson.loads(p)) for p in sse_events(probe.content)[:-1]]
        texts = texts[1:] if path == "/v1/chat/completions" else texts  # the role chunk
        stop = texts[4].strip()
        assert stop
        assert stop not in "".join(texts[:4])
        stopped = {**asked, "stop": [stop], "stream_options": {"include_usage": True}}
        response = await client.post(url + path, json=stopped)
    ours = sse_events(response.content)
    assert kinds_in_order(ours) == kinds_in_order(real)
    real_kinds = _by_kind(real)
    for kind, payloads in _by_kind(ours).items():
        assert {orjson.dumps(skeleton(orjson.loads(p))) for p in payloads if p != "[DONE]"} == {
            orjson.dumps(skeleton(orjson.loads(p))) for p in real_kinds[kind] if p != "[DONE]"
        }, kind
    chunks = [orjson.loads(p) for p in ours[:-1]]
    finish = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert (finish["choices"][0]["finish_reason"], finish["choices"][0]["stop_reason"]) == (
        "stop",
        stop,
    )
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    pieces = [
        _piece(c) for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})
    ]
    whole = "".join(texts[:5])
    assert "".join(pieces) == whole[: whole.index(stop, len("".join(texts[:4])) - len(stop) + 1)]
    assert pieces[0] == texts[0][: max(0, len(texts[0]) - (len(stop) - 1))]


async def test_stop_string_ends_a_whole_completion(replica):
    """Not streamed, the choice's text ends before the stop string, with stop_reason set."""
    _, url = replica
    asked = {**CHAT, "max_tokens": 12, "seed": 7, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as client:
        full = (await client.post(f"{url}/v1/chat/completions", json=asked)).json()
        text = full["choices"][0]["message"]["content"]
        stop = text.split()[3]
        cut = (await client.post(f"{url}/v1/chat/completions", json={**asked, "stop": stop})).json()
    choice = cut["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["message"]["content"] == text[: text.index(stop)]
    assert cut["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    "options", [{}, {"continuous_usage_stats": True, "include_obfuscation": False}]
)
async def test_stream_options_without_include_usage_send_no_usage(replica, fixture_text, options):
    """Usage comes only when include_usage is true: stream_options without it (continuous stats
    or keys vLLM does not know, which it ignores) stream as if there were none."""
    _, url = replica
    real = sse_events(fixture_text("vllm-0.32-chat-stream-options-no-usage.sse"))
    body = {**CHAT, "max_tokens": 3, "ignore_eos": True, "stream": True, "stream_options": options}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200
    ours = sse_events(response.content)
    assert kinds_in_order(ours) == kinds_in_order(real)
    assert [skeleton(orjson.loads(p)) for p in ours[:-1]] == [
        skeleton(orjson.loads(p)) for p in real[:-1]
    ]
