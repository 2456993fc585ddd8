"""Admission decides a request's plan or refusal from its head and body alone, with no server."""

from __future__ import annotations

import orjson
import pytest

from infermeter.auth import AuthError
from infermeter.records import RequestStatus
from sidecar.admission import (
    MAX_JSON_CONTAINERS,
    MAX_JSON_VALUES,
    Plan,
    Refusal,
    identify,
    parse_body,
    plan,
    upstream_headers,
)
from sidecar.limits import estimate_prompt_tokens
from sidecar.state import build_view
from tests.sidecar.conftest import KEYS, make_config

VIEW = build_view(make_config("http://127.0.0.1:9"), "small-0")


def _plan(body: object, endpoint: str = "/v1/chat/completions", **kw: bool) -> Plan | Refusal:
    return plan(
        VIEW,
        endpoint,
        orjson.dumps(body),
        default_reserve_tokens=256,
        metering_down=kw.get("metering_down", False),
    )


def test_a_team_is_known_by_its_key():
    """The bearer key names the team it was issued to."""
    headers = [(b"authorization", f"Bearer {KEYS['search']}".encode())]
    assert identify(VIEW, "POST", "/v1/completions", headers) == "search"


def test_an_unknown_key_is_refused():
    """A key no team holds proves nothing."""
    with pytest.raises(AuthError):
        identify(VIEW, "POST", "/v1/completions", [(b"authorization", b"Bearer im-nobody")])


@pytest.mark.parametrize(
    ("raw", "code"),
    [(b"{", "invalid_json"), (b"[1]", "invalid_json"), (b'{"stream_options": 3}', "invalid_type")],
)
def test_bodies_that_are_not_requests_are_400(raw, code):
    """Malformed JSON, a non-object and a non-object stream_options are each a 400."""
    refused = parse_body(raw)
    assert isinstance(refused, Refusal)
    assert (refused.status, refused.code) == (400, code)


def test_an_unknown_model_is_404_naming_it():
    """A model no route serves is refused, and the refusal keeps the name for the record."""
    refused = _plan({"model": "made-up", "messages": []})
    assert isinstance(refused, Refusal)
    assert (refused.status, refused.model) == (404, "made-up")


def test_a_stream_asks_vllm_for_usage_and_remembers_what_the_client_asked():
    """The upstream body always carries continuous usage; the plan keeps the client's choice."""
    planned = _plan(
        {
            "model": "chat-small",
            "stream": True,
            "max_tokens": 10,
            "stream_options": {"include_usage": True},
        }
    )
    assert isinstance(planned, Plan)
    assert planned.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert (planned.client_usage, planned.client_continuous) == (True, False)
    assert planned.body["model"] == planned.served_version


def test_the_reserve_counts_every_choice():
    """``n`` choices of ``max_tokens`` each reserve n times the output."""
    one = _plan({"model": "chat-small", "max_tokens": 100})
    three = _plan({"model": "chat-small", "max_tokens": 100, "n": 3})
    assert isinstance(one, Plan)
    assert isinstance(three, Plan)
    assert three.reserve_tokens - one.reserve_tokens >= 200


def test_embeddings_never_stream():
    """``stream`` on the embeddings endpoint is not a stream."""
    planned = _plan({"model": "chat-small", "stream": True}, "/v1/embeddings")
    assert isinstance(planned, Plan)
    assert not planned.stream


def test_a_failing_spool_refuses_with_503():
    """With metering down, a request the sidecar cannot meter is refused."""
    refused = _plan({"model": "chat-small"}, metering_down=True)
    assert isinstance(refused, Refusal)
    assert (refused.status, refused.record_status) == (503, RequestStatus.REJECTED)


def test_credentials_and_own_headers_never_go_upstream():
    """The caller's key and x-infermeter-* headers stay; the upstream key replaces the key."""
    headers = [
        (b"authorization", b"Bearer im-demo-search"),
        (b"x-infermeter-client-usage", b"1"),
        (b"x-custom", b"kept"),
    ]
    assert upstream_headers(VIEW, headers, "up") == {
        "x-custom": "kept",
        "authorization": "Bearer up",
    }


def test_a_header_sent_twice_goes_upstream_as_the_value_the_sidecar_checked():
    """vLLM gets the first ``x-request-id``, the one checked, and none when that one is bad:
    a second one, unchecked, used to replace it (and name vLLM's response id)."""
    good = [(b"x-request-id", b"my-id-1"), (b"x-request-id", b"<script>" + b"A" * 3000)]
    bad = [(b"x-request-id", b"<script>"), (b"x-request-id", b"chosen-by-caller")]
    assert upstream_headers(VIEW, good, None) == {"x-request-id": "my-id-1"}
    assert upstream_headers(VIEW, bad, None) == {}


@pytest.mark.parametrize(
    ("endpoint", "extra", "choices"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 0),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 3),
        ("/v1/completions", {"prompt": "a b"}, 0),
        ("/v1/completions", {"prompt": ["a b", "c d"]}, 1),
        ("/v1/completions", {"prompt": [[1, 2], [3, 4]], "n": 2}, 2),
        ("/v1/completions", {"prompt": [1, 2, 3]}, 0),
    ],
)
def test_the_plan_says_when_a_stream_carries_several_choices(
    endpoint: str, extra: dict[str, object], choices: int
) -> None:
    planned = _plan({"model": "chat-small", "stream": True, **extra}, endpoint)
    assert isinstance(planned, Plan)
    assert planned.choices == choices


@pytest.mark.parametrize(
    ("given", "read"),
    [("2", 2), (2.0, 2), (" 2 ", 2), (True, 1), (2, 2), ("two", "two"), (2.5, 2.5)],
)
def test_integer_fields_are_read_as_vllm_reads_them(given: object, read: object) -> None:
    """``n`` and ``max_tokens`` that vLLM's validation takes as integers are metered, reserved
    and forwarded as those integers; what vLLM refuses is forwarded as sent, for it to refuse."""
    chat = {"model": "chat-small", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    body = {**chat, "n": given, "max_tokens": given}
    taken = _plan(body)
    assert isinstance(taken, Plan)
    assert (taken.body["n"], taken.body["max_tokens"]) == (read, read)
    if isinstance(read, int) and read > 1:
        assert taken.choices == read
        # The prompt's estimate from the body's size, and ``max_tokens`` for each of ``n``.
        assert taken.reserve_tokens == estimate_prompt_tokens(len(orjson.dumps(body))) + read * read


@pytest.mark.parametrize(
    ("raw", "refused"),
    [
        (b'{"model":"chat-small","messages":[' + b"[]," * MAX_JSON_CONTAINERS + b"[]]}", True),
        (b'{"model":"chat-small","prompt":[' + b"1," * MAX_JSON_VALUES + b"1]}", True),
        # Inside the bounds, however large: a long text, a long prompt of token ids, many messages.
        (b'{"model":"chat-small","prompt":"' + b"f(a, b) " * 900_000 + b'"}', False),
        (b'{"model":"chat-small","prompt":[' + b"1," * (MAX_JSON_VALUES - 10) + b"1]}", False),
        (
            b'{"model":"chat-small","messages":['
            + b'{"role":"user","content":"x"},' * (MAX_JSON_CONTAINERS - 10)
            + b"{}]}",
            False,
        ),
    ],
)
def test_a_body_holding_more_than_the_bounds_is_refused_before_it_is_parsed(raw, refused):
    """More containers or values than the sidecar parses on its loop is a 413 in OpenAI's form;
    a large body within the bounds is parsed."""
    out = parse_body(raw)
    if refused:
        assert isinstance(out, Refusal)
        assert (out.status, out.code) == (413, "request_too_large")
    else:
        assert isinstance(out, dict)


@pytest.mark.parametrize(
    ("endpoint", "extra", "sequences"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 1),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 4}, 4),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 3}, 6),
        ("/v1/completions", {"prompt": [[1, 2], [3], [4]]}, 3),
        ("/v1/completions", {"prompt": [1, 2, 3]}, 1),
        ("/v1/embeddings", {"input": ["a", "b"]}, 1),
    ],
)
def test_the_plan_counts_the_sequences_vllm_runs(endpoint, extra, sequences):
    """Prompts times choices: the request's weight in the fair share."""
    planned = _plan({"model": "chat-small", **extra}, endpoint)
    assert isinstance(planned, Plan)
    assert planned.sequences == sequences
