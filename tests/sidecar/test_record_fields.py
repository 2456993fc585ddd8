"""The usage record built field by field (admission, then ending) is exactly a UsageRecord."""

from __future__ import annotations

import dataclasses

from infermeter.journal_files import admission_line
from infermeter.records import RequestStatus, UsageRecord
from sidecar.accounting import Call, admitted_fields, ending_fields
from sidecar.prefix import Prefix
from sidecar.stream import StreamMeter, UsageCounts


def served_call() -> Call:
    call = Call(
        "req-1",
        "/v1/chat/completions",
        1_700_000_000.0,
        50.0,
        team="search",
        model="chat-small",
        served_version="chat-small-v2",
        stream=True,
        client_request_id="client-7",
        prefix=Prefix("ab12", 0.5),
    )
    call.response_id = "chatcmpl-9"
    return call


def test_the_two_halves_hold_every_field_of_the_record_once() -> None:
    call = served_call()
    admitted = admitted_fields(call, "small-0", "pod-a")
    ending = ending_fields(call, RequestStatus.OK, 200, None, None, None, 51.0)
    assert admitted.keys().isdisjoint(ending.keys())
    assert admitted.keys() | ending.keys() == {f.name for f in dataclasses.fields(UsageRecord)}


def test_the_record_line_is_the_json_form_of_the_record() -> None:
    call = served_call()
    meter = StreamMeter(False, False, 50.0)
    meter.first_token_at = 50.25
    usage = UsageCounts(12, 30, 4)
    line = admitted_fields(call, "small-0", "pod-a") | ending_fields(
        call, RequestStatus.OK, 200, usage, meter, "stop", 52.0
    )
    record = UsageRecord.from_json(line)  # every field, none unknown (else TypeError)
    assert record.to_json() == line
    assert record.first_token_at == 1_700_000_000.25
    assert record.finished_at == 1_700_000_002.0
    tokens = (record.prompt_tokens, record.completion_tokens, record.cached_prompt_tokens)
    assert tokens == (12, 30, 4)
    assert (record.prefix_digest, record.prefix_share) == ("ab12", 0.5)
    assert record.usage_exact


def test_a_record_without_usage_is_exact_only_when_nothing_was_generated() -> None:
    call = served_call()
    aborted = ending_fields(call, RequestStatus.CLIENT_ABORTED, 200, None, None, None, 51.0)
    refused = ending_fields(call, RequestStatus.RATE_LIMITED, 429, None, None, None, 51.0)
    assert aborted["usage_exact"] is False
    assert refused["usage_exact"] is True


def test_the_request_id_comes_first_as_the_journal_finds_admissions_by_it() -> None:
    """The journal reads a running request's admission back by how its line begins."""
    call = served_call()
    sidecar_form = admitted_fields(call, "small-0", None) | ending_fields(
        call, RequestStatus.INTERRUPTED, 502, None, None, None, 51.0
    )
    dataclass_form = UsageRecord.from_json(sidecar_form).to_json()
    for record in (sidecar_form, dataclass_form):
        assert admission_line(record).startswith(b'{"a":{"request_id":"req-1"')
