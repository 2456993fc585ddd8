"""Non-streamed answers built from vLLM's stream: which requests qualify, and the body they get."""

from __future__ import annotations

import json
import re
from pathlib import Path

import orjson
import pytest

from infermeter.records import RequestStatus
from sidecar.assemble import Assembler, answer, assemblable, streamed_body
from sidecar.request_ids import client_request_id, response_id
from sidecar.stream import UsageCounts

FIXTURES = Path(__file__).parents[1] / "fixtures"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        ("/v1/chat/completions", {"model": "m", "messages": MSG}, True),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": MSG,
                "stream": False,
                "n": 2,
                "temperature": 0,
                "stop": ["x"],
                "seed": 3,
            },
            True,
        ),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "logprobs": False}, True),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "tools": None}, True),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "logprobs": True}, True),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": MSG, "logprobs": True, "top_logprobs": 5},
            True,
        ),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "echo": True}, False),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "prompt_logprobs": 1}, False),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": MSG, "tools": [{"type": "function"}]},
            False,
        ),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "stream_options": {}}, False),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "return_token_ids": True}, False),
        ("/v1/chat/completions", {"model": "m", "messages": MSG, "something_new": 1}, False),
        ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 3}, True),
        ("/v1/completions", {"model": "m", "prompt": "a", "echo": True}, True),
        ("/v1/completions", {"model": "m", "prompt": "a", "logprobs": 0}, True),
        ("/v1/completions", {"model": "m", "prompt": "a", "echo": True, "logprobs": None}, True),
        # The whole answer holds the echoed prompt's log-probabilities by id, which no chunk has.
        ("/v1/completions", {"model": "m", "prompt": "a", "echo": True, "logprobs": 0}, False),
        ("/v1/completions", {"model": "m", "prompt": "a", "prompt_logprobs": 1}, False),
        ("/v1/embeddings", {"model": "m", "input": "a"}, False),
    ],
)
def test_only_requests_whose_answer_the_stream_holds_are_assembled(endpoint, body, expected):
    """Plain sampling parameters qualify; anything that changes the answer's shape does not."""
    assert assemblable(endpoint, body) is expected


def test_the_upstream_request_is_streamed_with_usage_on_every_chunk():
    """The request vLLM gets is the client's, streamed, with include and continuous usage."""
    body = {"model": "m", "messages": MSG, "stream": False}
    assert streamed_body(body) == {
        "model": "m",
        "messages": MSG,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def _assembled(name: str, endpoint: str, block_size: int) -> Assembler:
    raw = (FIXTURES / name).read_bytes()
    assembler = Assembler(endpoint)
    for at in range(0, len(raw), block_size):
        assembler.feed(raw[at : at + block_size])
    return assembler


@pytest.mark.parametrize("block_size", [7, 100, 1_000_000])
def test_a_captured_chat_stream_becomes_vllms_non_streamed_body(block_size):
    """vLLM's chat stream, in blocks of any size, gives its non-streamed body's exact layout."""
    assembler = _assembled(
        "vllm-0.32-chat-stream-continuous-usage.sse", "/v1/chat/completions", block_size
    )
    real = (FIXTURES / "vllm-0.32-chat-nonstream.json").read_bytes()
    built = orjson.loads(assembler.body())
    expected = orjson.loads(real)
    assert assembler.done
    assert _layout(built) == _layout(expected)
    deltas = [
        orjson.loads(line[6:])["choices"][0]["delta"].get("content", "")
        for line in (FIXTURES / "vllm-0.32-chat-stream-continuous-usage.sse")
        .read_text()
        .split("\n")
        if line.startswith("data: {") and '"choices":[{' in line
    ]
    assert built["choices"][0]["message"]["content"] == "".join(deltas)
    assert built["usage"] == {
        "prompt_tokens": 10,
        "total_tokens": 15,
        "completion_tokens": 5,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert built["id"] == assembler.response_id == "chatcmpl-938c5aa6fcfb9c62"
    assert assembler.usage == UsageCounts(10, 5)


def test_a_captured_text_stream_becomes_vllms_non_streamed_body():
    """The same for /v1/completions: fields, order and types of vLLM's own body."""
    assembler = _assembled("vllm-0.32-completions-stream-usage.sse", "/v1/completions", 64)
    expected = orjson.loads((FIXTURES / "vllm-0.32-completions-nonstream.json").read_bytes())
    assert _layout(orjson.loads(assembler.body())) == _layout(expected)


@pytest.mark.parametrize("block_size", [7, 100, 1_000_000])
def test_a_captured_logprobs_stream_becomes_vllms_non_streamed_body_byte_for_byte(block_size):
    """Chat with logprobs and top_logprobs (the same seeded request, streamed and not): the
    tokens' log-probabilities joined from the chunks are vLLM's whole answer's, written as it
    writes them, but for the id and the creation second. Such requests were relayed whole, so a
    client hanging up on one left no trace of the tokens spent."""
    assembler = _assembled("vllm-0.32-chat-stream-logprobs.sse", "/v1/chat/completions", block_size)
    real = (FIXTURES / "vllm-0.32-chat-nonstream-logprobs.json").read_bytes()
    volatile = re.compile(rb'"id":"[^"]*"|"created":\d+')
    assert volatile.sub(b"", assembler.body()) == volatile.sub(b"", real)


def test_logprobs_floats_are_written_as_python_writes_them():
    """A log-probability near 0 reaches the stream as serde writes it (-1.2e-7) and the whole
    answer as json.dumps does (-1.2e-07)."""
    raw = (FIXTURES / "vllm-0.32-chat-stream-logprobs.sse").read_bytes()
    raw = raw.replace(b"-7.574202537536621", b"-1.1920928955078125e-7", 1)
    assert b"e-7" in raw
    assembler = Assembler("/v1/chat/completions")
    assembler.feed(raw)
    assert b'"logprob":-1.1920928955078125e-07' in assembler.body()


def test_a_stream_cut_short_has_the_counts_of_its_last_chunk():
    """A stream read only part-way reports the tokens of the last chunk read, and is not done."""
    raw = (FIXTURES / "vllm-0.32-chat-stream-continuous-usage.sse").read_bytes()
    events = raw.split(b"\n\n")
    assembler = Assembler("/v1/chat/completions")
    assembler.feed(b"\n\n".join(events[:3]) + b"\n\n" + events[3][:20])
    assert not assembler.done
    assert assembler.usage == UsageCounts(10, 2)


def test_an_error_event_becomes_vllms_error_answer():
    """A stream that ends in vLLM's error event answers with its code and the compact error body."""
    assembler = Assembler("/v1/chat/completions")
    error = {"message": "boom", "type": "BadRequestError", "param": None, "code": 400}
    assembler.feed(b"data: " + orjson.dumps({"error": error}) + b"\n\ndata: [DONE]\n\n")
    assert assembler.error_body() == (400, orjson.dumps({"error": error}))


def test_keep_alive_comments_are_ignored():
    """vLLM's SSE keep-alive comments between events change nothing."""
    assembler = Assembler("/v1/completions")
    assembler.feed(b": keep-alive\n\ndata: [DONE]\n\n")
    assert assembler.done
    assert assembler.usage is None


def _layout(value: object) -> object:
    """Keys in order and value types, recursively: what must match beyond the generated values."""
    if isinstance(value, dict):
        return [(k, _layout(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_layout(v) for v in value]
    return type(value).__name__


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("trace-42", "trace-42"),
        ("a1b2:c3/d4+e5=f6@g7.h8_i9", "a1b2:c3/d4+e5=f6@g7.h8_i9"),
        ("x" * 128, "x" * 128),
        ("x" * 129, None),
        ("", None),
        ("has space", None),
        ('quote"', None),
        ("café", None),
        (None, None),
    ],
)
def test_a_client_request_id_is_kept_only_in_its_plain_form(value, expected):
    """1-128 characters of a plain charset are kept; anything else is ignored."""
    assert client_request_id(value) == expected


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"id":"chatcmpl-abc","object":"chat.completion"}', "chatcmpl-abc"),
        (b'{"id":"embd-9f","object":"list","data":[]}', "embd-9f"),
        (b'data: {"id":"cmpl-1","object":"text_completion"}\n\n', "cmpl-1"),
        (b'{"error":{"message":"no","type":"x","param":null,"code":400}}', None),
    ],
)
def test_the_response_id_is_the_first_objects_id(content, expected):
    """vLLM's id is read from the head of a body or stream; an error has none."""
    assert response_id(content) == expected


def _chunk(index: int, content: str, prompt: int, completion: int) -> bytes:
    """A chat chunk of choice ``index`` with vLLM's continuous usage for that choice."""
    return (
        b"data: "
        + orjson.dumps(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": index,
                        "delta": {"content": content},
                        "logprobs": None,
                        "finish_reason": None,
                        "token_ids": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt,
                    "total_tokens": prompt + completion,
                    "completion_tokens": completion,
                    "completion_tokens_details": None,
                },
            }
        )
        + b"\n\n"
    )


def test_a_cut_short_stream_of_several_choices_sums_their_counts():
    """With n=2 each chunk counts its own choice: the tokens spent are both choices' latest."""
    assembler = Assembler("/v1/chat/completions", n=2)
    for i in range(1, 4):
        assembler.feed(_chunk(0, "a", 7, i) + _chunk(1, "b", 7, i))
    assembler.feed(_chunk(0, "a", 7, 4))
    assert assembler.usage == UsageCounts(7, 4)
    assert assembler.usage_so_far() == UsageCounts(7, 7)


def test_a_cut_short_batch_of_prompts_sums_each_prompts_tokens():
    """Several prompts in one text request: each prompt's tokens are counted once."""
    assembler = Assembler("/v1/completions", n=1)
    assembler.feed(_chunk(0, "a", 5, 2) + _chunk(1, "b", 9, 3))
    assert assembler.usage_so_far() == UsageCounts(14, 5)


def test_the_answer_to_a_refusal_is_vllms_own():
    """vLLM's JSON refusal before any event is passed on, status and bytes."""
    refusal = b'{"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}}'
    out = answer(400, refusal, Assembler("/v1/chat/completions"))
    assert (out.status, out.http_status, out.body, out.usage) == (
        RequestStatus.BAD_REQUEST,
        400,
        refusal,
        None,
    )


def test_the_answer_to_a_stream_cut_short_is_a_502_with_the_usage_so_far():
    """A stream that ended without [DONE] is an upstream error; its tokens are recorded."""
    assembler = Assembler("/v1/chat/completions")
    assembler.feed(_chunk(0, "a", 7, 1) + _chunk(0, "b", 7, 2))
    out = answer(200, None, assembler)
    assert (out.status, out.http_status, out.usage) == (
        RequestStatus.UPSTREAM_ERROR,
        502,
        UsageCounts(7, 2),
    )
    assert orjson.loads(out.body)["error"]["code"] == "upstream_unreachable"


def test_the_answer_to_a_finished_stream_is_the_assembled_body():
    """A stream read to [DONE] answers 200 with the body and the final usage."""
    assembler = _assembled("vllm-0.32-chat-stream-continuous-usage.sse", "/v1/chat/completions", 64)
    out = answer(200, None, assembler)
    assert (out.status, out.http_status, out.usage) == (RequestStatus.OK, 200, UsageCounts(10, 5))
    assert out.body == assembler.body()


def test_an_upstream_that_does_not_stream_is_answered_as_it_is():
    """A whole JSON body where a stream was asked for is passed on, with its usage."""
    body = b'{"id":"x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}'
    out = answer(200, body, Assembler("/v1/chat/completions"))
    assert (out.status, out.http_status, out.body, out.usage) == (
        RequestStatus.OK,
        200,
        body,
        UsageCounts(1, 2),
    )


# Texts a token may carry, each escaped by vLLM's JSON: quotes, backslashes (alone, doubled,
# before a quote), what follows a token's text in its chunk, newlines, non-ASCII, nothing.
_TRICKY = [
    ' "quoted"',
    "\\",
    "\\\\",
    '\\"',
    '"},"logprobs":null,"finish_reason":null}]',
    "line\nbreak\t",
    "é中🙂",
    "",
    " plain",
    "\u2028",
    "}]",
    ',"usage":{"prompt_tokens":1}',
]


def _chat_stream(texts: list[str], choices: int = 1) -> bytes:
    """A chat stream as vLLM 0.32 writes it with usage on every chunk (the simulator's formatter,
    checked against real vLLM by tests/conformance): role chunks, tokens in turn, finishes, the
    usage chunk and [DONE]."""
    from simulator.protocol import ChatFormatter

    fmt = ChatFormatter("chatcmpl-abc", 1796029083, "tiny", "vllm-0.32.0-x")
    out = [fmt.role_chunk(i, (10, 0)) for i in range(choices)]
    for n, text in enumerate(texts):
        last = n == len(texts) - 1
        for i in range(choices):
            out.append(fmt.token_chunk(i, text, "length" if last else None, (10, n + 1)))
    out.append(fmt.usage_chunk(10 * choices, len(texts) * choices))
    out.append(fmt.done())
    return b"".join(out)


class _CountingAssembler(Assembler):
    """An assembler that counts the events it decodes whole."""

    decoded = 0

    def _take(self, chunk, chat):
        self.decoded += 1
        super()._take(chunk, chat)


@pytest.mark.parametrize(
    ("block_size", "ticks"), [(1, False), (5, True), (64, True), (1_000_000, False)]
)
def test_token_chunks_are_read_without_decoding_each(block_size, ticks):
    """A stream's token chunks give their exact text without a JSON parse each: only the role,
    the finish and the usage chunks are decoded, whatever the escapes, however it is cut, and
    whether or not the journal's ticks read its counts on the way."""
    raw = _chat_stream(_TRICKY * 3)
    assembler = _CountingAssembler("/v1/chat/completions")
    for i in range(0, len(raw), block_size):
        assembler.feed(raw[i : i + block_size])
        if ticks:
            assembler.usage_so_far()
    body = orjson.loads(assembler.body())
    assert body["choices"][0]["message"]["content"] == "".join(_TRICKY * 3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert assembler.usage == UsageCounts(10, len(_TRICKY) * 3)
    assert assembler.decoded == 3


def test_an_unexpected_chunk_mid_stream_keeps_its_place():
    """A chunk of another shape between token chunks (here a reasoning delta and one with a
    field vLLM does not write) is decoded whole, and the text keeps the stream's order."""
    raw = _chat_stream(["a", "b", "c", "d"]).split(b"\n\n")
    reasoning = raw[2].replace(b'{"content":"b"}', b'{"reasoning":"why"}')
    extra = raw[3].replace(b'"logprobs":null', b'"logprobs":null,"new":1')
    assembler = Assembler("/v1/chat/completions")
    assembler.feed(b"\n\n".join([raw[0], raw[1], reasoning, extra, *raw[4:]]))
    message = orjson.loads(assembler.body())["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == ("acd", "why")


def test_several_choices_read_without_decoding_keep_their_own_text_and_counts():
    """With n = 2, each choice gets its own tokens' text; cut short, both choices' counts add up."""
    raw = _chat_stream(["x", '"y"', "z"], choices=2)
    whole = Assembler("/v1/chat/completions", n=2)
    whole.feed(raw)
    choices = orjson.loads(whole.body())["choices"]
    assert [c["message"]["content"] for c in choices] == ['x"y"z', 'x"y"z']
    cut = Assembler("/v1/chat/completions", n=2)
    cut.feed(b"\n\n".join(raw.split(b"\n\n")[:6]) + b"\n\n")  # roles, then 2 tokens of each
    assert cut.usage_so_far() == UsageCounts(10, 4)


def _as_vllm_writes(body: bytes) -> bytes:
    """``body`` as vLLM's JSONResponse (Starlette's ``json.dumps``) writes the same value."""
    value = json.loads(body)
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


@pytest.mark.parametrize("choices", [1, 3])
@pytest.mark.parametrize(
    "texts",
    [
        [" 1", " 2"],
        ["é", "\n", "\x01\t", "\u2028", "🙂", '"\\', "\x7f"],
    ],
)
def test_an_answer_is_written_byte_for_byte_as_vllm_writes_it(texts, choices):
    """Written by orjson when it holds no float: the same bytes as ``json.dumps`` (escapes,
    non-ASCII and all), for one choice or several."""
    assembler = Assembler("/v1/chat/completions")
    assembler.feed(_chat_stream(texts, choices))
    body = assembler.body()
    answers = json.loads(body)["choices"]
    assert [a["message"]["content"] for a in answers] == ["".join(texts)] * choices
    assert body == _as_vllm_writes(body)


def test_an_answer_carrying_vllms_floats_writes_them_as_python_does():
    """orjson writes a float's shortest form otherwise (1e-7): an answer whose metrics or token
    details hold a float is written by ``json.dumps``, as vLLM writes it."""
    stream = _chat_stream([" 1"])
    usage_end = stream.rindex(b"}\n\ndata: [DONE]")
    assembler = Assembler("/v1/chat/completions")
    assembler.feed(stream[:usage_end] + b',"metrics":{"queued":1e-07}' + stream[usage_end:])
    body = assembler.body()
    assert b'"metrics":{"queued":1e-07}' in body
    assert body == _as_vllm_writes(body)
