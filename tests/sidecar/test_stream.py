"""StreamMeter meters vLLM's continuous-usage stream and gives each client the stream it asked for.

The sidecar always asks vLLM for ``include_usage`` and ``continuous_usage_stats``; the client
asked for continuous usage, usage only, or nothing. What it gets back must look like what real
vLLM 0.32 sends for its own options (see tests/fixtures), whatever the upstream block boundaries.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from sidecar.metrics import ITL_BUCKETS
from sidecar.stream import StreamMeter, UsageCounts
from simulator.protocol import CompletionFormatter
from tests.simulator.shapes import classify, skeleton, sse_events

FIXTURES = Path(__file__).parents[1] / "fixtures"
DONE = b"data: [DONE]\n\n"
CONTINUOUS_CHAT = "vllm-0.32-chat-stream-continuous-usage.sse"

# (client asked for usage, client asked for continuous usage)
CONTINUOUS, USAGE_ONLY, NOTHING = (True, True), (True, False), (False, False)
EVERY_CLIENT = pytest.mark.parametrize(
    "client", [CONTINUOUS, USAGE_ONLY, NOTHING], ids=["continuous", "usage-only", "nothing"]
)


def capture(name: str) -> bytes:
    """The bytes of a real vLLM capture."""
    return (FIXTURES / name).read_bytes()


def events(raw: bytes) -> list[bytes]:
    """The SSE events of a body, each with its closing blank line."""
    return [e + b"\n\n" for e in raw.split(b"\n\n")[:-1]]


def with_continuous_usage(raw: bytes, prompt: int) -> bytes:
    """An ``include_usage`` capture as the sidecar would receive it: running usage on every chunk."""
    out, completion = [], 0
    for event in events(raw):
        if b'"choices":[{' in event:
            if b'"delta":{"role"' not in event:
                completion += 1
            usage = (
                f',"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
                f'"completion_tokens":{completion}}}'
            )
            cut = event.rfind(b"}]") + 2
            event = event[:cut] + usage.encode() + event[cut:]
        out.append(event)
    return b"".join(out)


def new_meter(client: tuple[bool, bool]) -> StreamMeter:
    """A meter for a client asking for (usage, continuous usage), started at t=0."""
    usage, continuous = client
    return StreamMeter(usage, continuous, started_at=0.0)


def run(
    raw: bytes, client: tuple[bool, bool], blocks: list[bytes] | None = None
) -> tuple[bytes, StreamMeter]:
    """Feed ``raw`` in ``blocks`` (default: one event each) at times 1, 2, ...; output and meter."""
    meter = new_meter(client)
    out = b"".join(meter.feed(b, float(i)) for i, b in enumerate(blocks or events(raw), start=1))
    return out + meter.close(), meter


def split(raw: bytes, cuts: set[int]) -> list[bytes]:
    """``raw`` cut into blocks at the given offsets."""
    bounds = [0, *sorted(cuts), len(raw)]
    return [raw[a:b] for a, b in itertools.pairwise(bounds)]


def outline(raw: bytes) -> list[tuple[str, Any]]:
    """Each distinct (kind, JSON skeleton) of a stream's events, in order of first appearance."""
    seen: list[tuple[str, Any]] = []
    for payload in sse_events(raw):
        if payload == "[DONE]":
            continue
        item = (classify(payload), skeleton(orjson.loads(payload)))
        if item not in seen:
            seen.append(item)
    return seen


def kinds(raw: bytes) -> list[str]:
    """The kind of each event of a stream."""
    return [classify(p) for p in sse_events(raw)]


# Streams as the sidecar receives them from vLLM, with the final usage each one reports.
UPSTREAM = {
    "chat": (capture(CONTINUOUS_CHAT), UsageCounts(10, 5)),
    "chat-n2": (
        with_continuous_usage(capture("vllm-0.32-chat-stream-n2-usage.sse"), 11),
        UsageCounts(11, 6),
    ),
    "completions": (
        with_continuous_usage(capture("vllm-0.32-completions-stream.sse"), 3),
        UsageCounts(3, 5),
    ),
}


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
def test_continuous_client_gets_upstream_bytes_without_done(stream):
    """A client that asked for continuous usage gets vLLM's bytes exactly, less ``[DONE]``."""
    raw = UPSTREAM[stream][0]
    assert run(raw, CONTINUOUS)[0] == raw.removesuffix(DONE)


@EVERY_CLIENT
def test_done_is_withheld_and_marks_the_stream_done(client):
    """``[DONE]`` is never passed on (the app sends it once usage is durable) but sets ``done``."""
    meter = new_meter(client)
    meter.feed(capture(CONTINUOUS_CHAT).removesuffix(DONE), 1.0)
    assert not meter.done
    assert meter.feed(DONE, 2.0) == b""
    assert meter.done


@pytest.mark.parametrize(
    ("usage_capture", "prompt"),
    [
        ("vllm-0.32-chat-stream-usage.sse", 10),
        ("vllm-0.32-chat-stream-n2-usage.sse", 11),
        ("vllm-0.32-completions-stream.sse", 3),
        ("vllm-0.32-completions-stream-usage.sse", 5),
    ],
)
def test_usage_client_gets_the_usage_capture_byte_for_byte(usage_capture, prompt):
    """Cutting per-chunk usage out of a continuous stream restores vLLM's include_usage bytes."""
    raw = capture(usage_capture)
    assert run(with_continuous_usage(raw, prompt), USAGE_ONLY)[0] == raw.removesuffix(DONE)


def test_usage_client_gets_usage_only_in_the_final_chunk():
    """With include_usage only, no chunk but the last carries usage, and that one is the usage chunk."""
    payloads = sse_events(run(capture(CONTINUOUS_CHAT), USAGE_ONLY)[0])
    assert ['"usage"' in p for p in payloads] == [False] * (len(payloads) - 1) + [True]
    assert classify(payloads[-1]) == "usage"
    assert "system_fingerprint" in payloads[-1]


def test_usage_client_stream_has_the_shape_of_real_include_usage_stream():
    """Every kind of chunk has the key order and types of vLLM's include_usage capture."""
    ours = run(capture(CONTINUOUS_CHAT), USAGE_ONLY)[0]
    assert outline(ours) == outline(capture("vllm-0.32-chat-stream-usage.sse"))


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
def test_plain_client_gets_no_usage_at_all(stream):
    """A client that asked for nothing sees no usage field and no usage chunk."""
    out = run(UPSTREAM[stream][0], NOTHING)[0]
    assert b'"usage"' not in out
    assert "usage" not in kinds(out)


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
def test_plain_client_gets_fingerprint_only_on_the_last_chunk(stream):
    """``system_fingerprint`` moves to the last JSON chunk (a finish chunk) and appears nowhere else."""
    payloads = sse_events(run(UPSTREAM[stream][0], NOTHING)[0])
    assert ["system_fingerprint" in p for p in payloads] == [False] * (len(payloads) - 1) + [True]
    assert classify(payloads[-1]) == "finish"


def test_plain_client_stream_has_the_shape_of_real_plain_stream():
    """Every kind of chunk has the key order and types of vLLM's capture without stream_options."""
    ours = run(capture(CONTINUOUS_CHAT), NOTHING)[0]
    assert outline(ours) == outline(capture("vllm-0.32-chat-stream.sse"))


def test_plain_completions_client_gets_what_vllm_sends_without_usage():
    """A completions stream without usage is byte for byte the simulator's rendering of vLLM's."""
    raw = capture("vllm-0.32-completions-stream.sse")
    chunks = [orjson.loads(p) for p in sse_events(raw)[:-1]]
    fingerprint = chunks.pop()["system_fingerprint"]
    fmt = CompletionFormatter(
        chunks[0]["id"], chunks[0]["created"], chunks[0]["model"], fingerprint
    )
    choices = [c["choices"][0] for c in chunks]
    last = len(choices) - 1
    expected = b"".join(
        fmt.token_chunk(0, c["text"], c["finish_reason"], None, last=i == last)
        for i, c in enumerate(choices)
    )
    assert run(UPSTREAM["completions"][0], NOTHING)[0] == expected


def test_plain_client_of_n2_stream_gets_both_finish_chunks():
    """With n=2 both choices' finish chunks reach the client, the second one last."""
    payloads = sse_events(run(UPSTREAM["chat-n2"][0], NOTHING)[0])
    finishes = [orjson.loads(p)["choices"][0]["index"] for p in payloads if classify(p) == "finish"]
    assert finishes == [0, 1]
    assert classify(payloads[-1]) == "finish"


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
@EVERY_CLIENT
def test_usage_counts_are_the_final_usage_of_the_stream(stream, client):
    """Whatever the client asked for, the meter keeps vLLM's final counts."""
    raw, counts = UPSTREAM[stream]
    meter = run(raw, client)[1]
    assert meter.usage == counts
    assert meter.final_usage


def test_aborted_stream_keeps_the_last_running_counts():
    """A stream cut before its usage chunk still has the counts of its last chunk."""
    meter = run(capture(CONTINUOUS_CHAT), NOTHING, events(capture(CONTINUOUS_CHAT))[:4])[1]
    assert meter.usage == UsageCounts(10, 3)
    assert not meter.final_usage
    assert not meter.done


def test_cached_prompt_tokens_are_counted():
    """``prompt_tokens_details.cached_tokens`` in the usage chunk becomes ``cached``."""
    raw = capture(CONTINUOUS_CHAT).replace(
        b'"completion_tokens":5}',
        b'"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":8}}',
    )
    assert run(raw, NOTHING)[1].usage == UsageCounts(10, 5, cached=8)


def test_first_token_time_is_the_first_event_after_the_role_chunk():
    """The role chunk (t=1) is not a token: the first token arrives with the next event (t=2)."""
    meter = run(capture(CONTINUOUS_CHAT), CONTINUOUS)[1]
    assert meter.first_token_at == 2.0
    assert meter.last_token_at == 6.0


def test_first_token_time_of_completions_is_the_first_event():
    """A completions stream has no role chunk, so its first event is its first token."""
    assert run(UPSTREAM["completions"][0], CONTINUOUS)[1].first_token_at == 1.0


def test_first_token_arriving_with_the_role_chunk_takes_that_block_time():
    """When the role chunk and the first token share a block, that block's time is the first token's."""
    evs = events(capture(CONTINUOUS_CHAT))
    meter = run(b"", CONTINUOUS, [evs[0] + evs[1], *evs[2:]])[1]
    assert meter.first_token_at == 1.0


@pytest.mark.parametrize(("stream", "tokens"), [("chat", 5), ("chat-n2", 6), ("completions", 5)])
def test_token_events_exclude_role_and_usage_chunks(stream, tokens):
    """Only chunks carrying generated text count as token events."""
    assert run(UPSTREAM[stream][0], NOTHING)[1].token_events == tokens


def test_text_that_looks_like_an_sse_field_is_one_token():
    """Generated text containing ``data: `` does not count as another event."""
    raw = capture(CONTINUOUS_CHAT).replace(b'"content":" 6119"', b'"content":"data: 6119"')
    assert run(raw, NOTHING, [raw])[1].token_events == 5


def test_held_finish_chunk_is_whole_even_if_its_text_looks_like_an_sse_field():
    """A finish chunk whose text contains ``data: `` is held back whole, not cut at that text."""
    raw = capture(CONTINUOUS_CHAT).replace(b'"content":" 6119"', b'"content":"data: 6119"')
    meter = new_meter(NOTHING)
    sent = meter.feed(b"".join(events(raw)[1:6]), 1.0)
    assert (kinds(sent), kinds(meter.close())) == (["token"] * 4, ["finish"])


def test_finish_reason_is_the_last_one_seen():
    """The meter records the finish reason vLLM gave."""
    assert run(capture(CONTINUOUS_CHAT), NOTHING)[1].finish_reason == "length"


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
@pytest.mark.parametrize("whole", [True, False], ids=["one-block", "event-per-block"])
def test_inter_token_latencies_cover_every_token_but_the_first(stream, whole):
    """The ITL entries account for every token event after the first."""
    raw = UPSTREAM[stream][0]
    meter = run(raw, CONTINUOUS, [raw] if whole else None)[1]
    assert sum(meter.itl[:-1]) == meter.token_events - 1


def test_tokens_arriving_with_the_first_have_no_gap():
    """Tokens in the first token's block follow it after zero seconds."""
    raw = capture(CONTINUOUS_CHAT)
    itl = run(raw, CONTINUOUS, [raw])[1].itl
    assert itl[0] == 4  # the first bucket
    assert sum(itl[:-1]) == 4
    assert itl[-1] == 0.0  # the sum of the gaps


def test_tokens_in_one_block_share_the_gap_since_the_last():
    """Two tokens arriving together 2 s after the previous one are recorded as two 1 s gaps."""
    evs = events(capture(CONTINUOUS_CHAT))
    meter = new_meter(CONTINUOUS)
    meter.feed(b"".join(evs[:2]), 1.0)
    meter.feed(b"".join(evs[2:4]), 3.0)
    assert meter.itl[ITL_BUCKETS.index(1.0)] == 2  # two observations in the bucket up to 1 s
    assert sum(meter.itl[:-1]) == 2
    assert meter.itl[-1] == 2.0  # their sum


def test_partial_event_is_held_until_completed():
    """An event cut at a block end is sent only once its last bytes arrive."""
    first, second = events(capture(CONTINUOUS_CHAT))[:2]
    meter = new_meter(CONTINUOUS)
    assert meter.feed(first + second[:50], 1.0) == first
    assert meter.feed(second[50:-1], 2.0) == b""
    assert meter.feed(second[-1:], 3.0) == second


def test_plain_client_finish_chunk_waits_for_the_next_block():
    """A block ending in a finish chunk is held back: the usage chunk may bring its fingerprint."""
    evs = events(capture(CONTINUOUS_CHAT))
    meter = new_meter(NOTHING)
    meter.feed(b"".join(evs[:5]), 1.0)
    assert meter.feed(evs[5], 2.0) == b""
    assert b"system_fingerprint" in meter.feed(evs[6], 3.0)


def test_close_returns_a_finish_chunk_still_held():
    """When the stream stops without a usage chunk, close() hands over the held finish chunk."""
    evs = events(capture(CONTINUOUS_CHAT))
    meter = new_meter(NOTHING)
    meter.feed(b"".join(evs[:6]), 1.0)
    assert [classify(p) for p in sse_events(meter.close())] == ["finish"]
    assert meter.close() == b""


def test_done_releases_a_finish_chunk_still_held_with_the_streams_end():
    """``[DONE]`` straight after a finish chunk releases it, since no usage chunk can follow:
    it goes out with the stream's end (``close``), as the block that ends a stream does."""
    evs = events(capture(CONTINUOUS_CHAT))
    meter = new_meter(NOTHING)
    meter.feed(b"".join(evs[:6]), 1.0)
    assert meter.feed(DONE, 2.0) == b""
    assert [classify(p) for p in sse_events(meter.close())] == ["finish"]


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
@EVERY_CLIENT
def test_the_block_that_ends_the_stream_waits_for_its_end(stream, client):
    """The last block (every choice's finish chunk, the usage chunk, ``[DONE]``) gives the
    client nothing when fed: all of it goes out at ``close``, after the request's ending is
    kept, whatever the client asked for and however many choices the stream has."""
    raw, counts = UPSTREAM[stream]
    evs = events(raw)
    assert evs[-1] == DONE
    kinds = [classify(e[6:-2].decode()) for e in evs]
    first_finish = kinds.index("finish")
    meter = new_meter(client)
    assert meter.feed(b"".join(evs[:first_finish]), 1.0)
    assert not meter.done
    assert meter.feed(b"".join(evs[first_finish:]), 2.0) == b""
    assert meter.done
    tail = meter.close()
    finishes = [p for p in sse_events(tail) if classify(p) == "finish"]
    assert len(finishes) == kinds.count("finish")
    assert b"[DONE]" not in tail
    assert meter.close() == b""
    assert meter.usage == counts


def _counts(meter: StreamMeter) -> tuple[Any, ...]:
    return (meter.usage, meter.final_usage, meter.done, meter.finish_reason, meter.token_events)


def _draw_blocks(data: st.DataObject, raw: bytes) -> list[bytes]:
    return split(raw, data.draw(st.sets(st.integers(1, len(raw) - 1), max_size=24), label="cuts"))


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
@EVERY_CLIENT
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_client_bytes_do_not_depend_on_block_boundaries(stream, client, data):
    """Splitting the upstream bytes anywhere leaves the concatenated client bytes unchanged."""
    raw = UPSTREAM[stream][0]
    assert run(raw, client, _draw_blocks(data, raw))[0] == run(raw, client, [raw])[0]


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
@EVERY_CLIENT
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_counts_do_not_depend_on_block_boundaries(stream, client, data):
    """Splitting the upstream bytes anywhere leaves usage, finish and token counts unchanged."""
    raw = UPSTREAM[stream][0]
    meter = run(raw, client, _draw_blocks(data, raw))[1]
    assert _counts(meter) == _counts(run(raw, client, [raw])[1])


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_inter_token_latencies_cover_every_token_but_the_first_however_split(stream, data):
    """Wherever the blocks are cut, ITL counts add up to one less than the token events."""
    raw = UPSTREAM[stream][0]
    meter = run(raw, CONTINUOUS, _draw_blocks(data, raw))[1]
    assert sum(meter.itl[:-1]) == meter.token_events - 1


def _choice_chunk(index: int, prompt: int, completion: int) -> bytes:
    """A vLLM chunk of one choice with continuous usage (that choice's counts)."""
    return (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":%d,'
        b'"delta":{"content":"x"},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":%d,'
        b'"total_tokens":%d,"completion_tokens":%d}}\n\n'
        % (index, prompt, prompt + completion, completion)
    )


def test_a_stream_of_two_choices_cut_short_counts_both_choices() -> None:
    """n=2: each chunk's usage counts its own choice; an unfinished stream sums the latest of each."""
    meter = StreamMeter(False, False, 0.0, choices=2)
    for i in range(1, 6):
        meter.feed(_choice_chunk(0, 7, i), i / 100)
        meter.feed(_choice_chunk(1, 7, i) + _choice_chunk(0, 7, i + 1), i / 100 + 0.005)
    assert meter.usage == UsageCounts(7, 6 + 5)


def test_the_final_usage_of_several_choices_is_vllms_total() -> None:
    meter = StreamMeter(False, False, 0.0, choices=2)
    meter.feed(_choice_chunk(0, 7, 3) + _choice_chunk(1, 7, 2), 0.01)
    final = (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":'
        b'{"prompt_tokens":7,"total_tokens":17,"completion_tokens":10}}\n\n'
    )
    meter.feed(final + b"data: [DONE]\n\n", 0.02)
    assert meter.usage == UsageCounts(7, 10)


def test_a_batch_of_prompts_cut_short_counts_each_prompt_once() -> None:
    """Two prompts, one choice each: both prompts' tokens, both choices' completions."""
    meter = StreamMeter(False, False, 0.0, choices=1)
    meter.feed(_choice_chunk(0, 5, 2) + _choice_chunk(1, 9, 3), 0.01)
    assert meter.usage == UsageCounts(14, 5)


def test_one_choice_keeps_the_latest_counts_only() -> None:
    meter = StreamMeter(False, False, 0.0)
    meter.feed(_choice_chunk(0, 7, 1) + _choice_chunk(0, 7, 2), 0.01)
    assert meter.usage == UsageCounts(7, 2)


class _LongPathOnly(StreamMeter):
    """The meter with its one-token short path (``_token``) switched off."""

    def _token(self, data: bytes, now: float) -> bytes | None:
        return None


def _state(meter: StreamMeter) -> tuple[Any, ...]:
    return (
        *_counts(meter),
        meter.first_token_at,
        meter.last_token_at,
        meter.response_id,
        list(meter.itl),
    )


@pytest.mark.parametrize("stream", sorted(UPSTREAM))
@EVERY_CLIENT
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_the_one_token_short_path_gives_what_the_long_path_gives(stream, client, data):
    """Blocks of whole events (mostly one each, as vLLM's reads come) or cut anywhere: the
    short path's bytes, counts, times and ITL are the long path's."""
    raw = UPSTREAM[stream][0]
    evs = events(raw)
    if data.draw(st.booleans(), label="cut anywhere"):
        blocks = _draw_blocks(data, raw)
    else:
        joins = data.draw(st.lists(st.booleans(), min_size=len(evs), max_size=len(evs)))
        blocks = []
        for event, join in zip(evs, joins, strict=True):
            if join and blocks:
                blocks[-1] += event
            else:
                blocks.append(event)
    times = [float(i) + 0.01 * i * i for i in range(1, len(blocks) + 1)]
    usage, continuous = client
    short, long = StreamMeter(usage, continuous, 0.0), _LongPathOnly(usage, continuous, 0.0)
    out_short = [short.feed(b, t) for b, t in zip(blocks, times, strict=True)]
    out_long = [long.feed(b, t) for b, t in zip(blocks, times, strict=True)]
    assert out_short == out_long
    assert short.close() == long.close()
    assert _state(short) == _state(long)


def test_the_short_path_takes_the_usual_token_chunks() -> None:
    """One event per block: every token chunk after the first takes the short path."""
    raw = UPSTREAM["chat"][0]
    taken: list[bytes] = []

    class Counting(StreamMeter):
        def _token(self, data: bytes, now: float) -> bytes | None:
            out = StreamMeter._token(self, data, now)
            if out is not None:
                taken.append(data)
            return out

    meter = Counting(False, False, 0.0)
    for i, block in enumerate(events(raw), start=1):
        meter.feed(block, float(i))
    # Role and first token go the long way, then the finish chunk, the usage chunk and [DONE].
    assert len(taken) == meter.token_events - 2
    assert all(b'"finish_reason":null' in b for b in taken)


def n2_upstream() -> tuple[bytes, bytes]:
    """vLLM's n=2 stream without usage (a capture), and the stream the sidecar gets for it:
    running usage on every chunk, no fingerprint on the finish chunks, the final usage chunk
    carrying it."""
    plain = capture("vllm-0.32-chat-stream-n2.sse")
    fingerprint = re.search(rb',"system_fingerprint":"[^"]*"', plain)
    assert fingerprint is not None
    body = with_continuous_usage(plain.replace(fingerprint[0], b"")[: -len(DONE)], 10)
    head = body[: body.index(b'"choices":[')]
    final = head + b'"choices":[],"usage":{"prompt_tokens":10,"total_tokens":16,'
    final += b'"completion_tokens":6}' + fingerprint[0] + b"}\n\n"
    return plain, body + final + DONE


def test_plain_client_of_n2_stream_gets_the_fingerprint_on_every_finish_chunk():
    """Without usage vLLM stamps each choice's finish chunk; the first is sent before the usage
    chunk that carries the fingerprint upstream, so it takes the one an earlier stream of the
    replica gave (``StreamMeter.fingerprint``): then the client gets vLLM's bytes, whatever
    the block boundaries. It got the fingerprint on the last finish chunk only."""
    plain, upstream = n2_upstream()
    learner = new_meter(NOTHING)
    for i, block in enumerate(events(upstream)):
        learner.feed(block, float(i))
    assert learner.fingerprint is not None
    cuts: list[set[int]] = [set(), {100, 900, 1500}, set(range(50, len(upstream), 97))]
    for cut in cuts:
        meter = StreamMeter(False, False, 0.0, choices=2, fingerprint=learner.fingerprint)
        blocks = split(upstream, cut) if cut else events(upstream)
        out = b"".join(meter.feed(b, float(i)) for i, b in enumerate(blocks, start=1))
        assert out + meter.close() + DONE == plain  # ([DONE] is the relay's, once recorded)


def test_the_first_n2_stream_of_a_replica_has_the_fingerprint_on_its_last_finish_chunk():
    """Before any stream gave it, only the finish chunk before the usage chunk gets it."""
    _, upstream = n2_upstream()
    meter = StreamMeter(False, False, 0.0, choices=2)
    out = b"".join(meter.feed(b, float(i)) for i, b in enumerate(events(upstream), start=1))
    payloads = sse_events(out + meter.close())
    assert ["system_fingerprint" in p for p in payloads] == [False] * 7 + [True]
