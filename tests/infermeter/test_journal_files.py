"""The admission journal's format: what a dead sidecar left running becomes interrupted records."""

from __future__ import annotations

import orjson
import pytest

from infermeter.journal_files import (
    SLOT_BYTES,
    Pending,
    Progress,
    interrupted_record,
    read_slots,
    recover,
    unfinished,
    usage_counts,
)
from infermeter.records import RequestStatus, UsageRecord
from infermeter.spool import Spool

T0 = 1_790_812_800.0


def admitted(request_id: str = "r1", stream: bool = True) -> UsageRecord:
    """The record a request is journaled with when it is admitted."""
    return UsageRecord(
        request_id=request_id,
        team="search",
        model="chat-small",
        served_version="v1",
        replica="small-0",
        received_at=T0,
        first_token_at=None,
        finished_at=T0,
        prompt_tokens=0,
        cached_prompt_tokens=0,
        completion_tokens=0,
        status=RequestStatus.INTERRUPTED.value,
        http_status=502,
        stream=stream,
        usage_exact=False,
    )


def line(entry: dict[str, object]) -> bytes:
    """One journal line."""
    return orjson.dumps(entry) + b"\n"


def test_unfinished_keeps_admissions_without_an_end_and_their_last_mark():
    """An admission with no finish line is pending with its last mark (a line of earlier
    versions); a finished one is gone."""
    lines = [
        line({"a": admitted("r1").to_json()}),
        line({"a": admitted("r2").to_json()}),
        line({"m": "r1", "p": 7, "c": 3, "k": 0, "t": T0 + 0.1, "at": T0 + 0.5}),
        line({"m": "r1", "p": 7, "c": 9, "k": 0, "t": T0 + 0.1, "at": T0 + 1.0}),
        line({"f": "r2"}),
        b'{"m": "r1", "p": 7, "c": 1',  # torn: the process died mid-write
    ]
    pending = unfinished(lines)
    assert list(pending) == ["r1"]
    assert pending["r1"].mark is not None
    assert pending["r1"].mark["c"] == 9


@pytest.mark.parametrize(
    ("mark", "stream", "expected"),
    [
        (None, True, (0, 0, None, 502, T0 + 2.0)),
        (
            {"p": 7, "c": 9, "k": 2, "t": T0 + 0.1, "at": T0 + 1.0},
            True,
            (7, 9, T0 + 0.1, 200, T0 + 2.0),
        ),
        ({"p": 7, "c": 0, "k": 0, "t": None, "at": T0 + 3.0}, False, (7, 0, None, 502, T0 + 3.0)),
    ],
)
def test_interrupted_record_takes_the_last_mark(mark, stream, expected):
    """Counts and first-token time come from the mark; the end is the later of mark and last write."""
    record = interrupted_record(Pending(admitted(stream=stream).to_json(), mark), T0 + 2.0)
    assert record.status == "interrupted"
    assert record.usage_exact is False
    assert record.request_id == "r1"
    got = (
        record.prompt_tokens,
        record.completion_tokens,
        record.first_token_at,
        record.http_status,
        record.finished_at,
    )
    assert got == expected


async def test_recover_keeps_the_journal_when_the_spool_refuses(tmp_path):
    """A full spool at start: no record is lost, the journal stays for the next start."""
    left = tmp_path / "spool" / "journal" / "journal-00000000000000000001.log"
    left.parent.mkdir(parents=True)
    left.write_bytes(line({"a": admitted().to_json()}))
    spool = Spool(tmp_path / "spool", max_bytes=10)
    spool.open()
    assert await recover([left], spool) == []
    await spool.close()
    assert left.exists()
    assert not list(spool.directory.glob("seg-*.jsonl"))


@pytest.mark.parametrize(
    ("progress", "mark", "stream", "expected"),
    [
        # A stream whose client had its head and three chunks, before any mark.
        (Progress(7, 3, 2, T0 + 0.1, True, "chatcmpl-a"), None, True, (7, 3, 2, 200, "chatcmpl-a")),
        # Its head not yet sent: the client got nothing.
        (Progress(7, 0, 0, None, False, "chatcmpl-a"), None, True, (7, 0, 0, 502, "chatcmpl-a")),
        # A non-streamed request: 502 whatever its tokens; the response id all the same.
        (Progress(7, 5, 0, None, False, "chatcmpl-b"), None, False, (7, 5, 0, 502, "chatcmpl-b")),
        # A slot and a mark (files of two versions): the larger of each count.
        (
            Progress(7, 4, 0, None, True, None),
            {"p": 7, "c": 9, "k": 1, "t": None, "at": T0},
            True,
            (7, 9, 1, 200, None),
        ),
        # vLLM had reported nothing yet.
        (Progress(None, None), None, True, (0, 0, 0, 502, None)),
    ],
)
def test_interrupted_record_takes_the_slots_progress(progress, mark, stream, expected):
    """Counts, the HTTP status the client saw and vLLM's response id come from the slot."""
    pending = Pending(admitted(stream=stream).to_json(), mark, progress)
    record = interrupted_record(pending, T0 + 2.0)
    got = (
        record.prompt_tokens,
        record.completion_tokens,
        record.cached_prompt_tokens,
        record.http_status,
        record.response_id,
    )
    assert got == expected
    assert (record.status, record.usage_exact) == ("interrupted", False)
    assert record.first_token_at == progress.first_token_at
    assert record.finished_at == T0 + 2.0


def test_a_file_not_in_the_slot_format_holds_no_progress():
    """A slot file of the wrong kind or size reads as empty, not as requests."""
    assert read_slots(b"") == (None, {})
    assert read_slots(b"x" * 4 * SLOT_BYTES) == (None, {})


async def test_recover_deletes_the_slot_files_with_the_logs(tmp_path):
    """A dead process's slot file goes with its log once their records are spooled."""
    directory = tmp_path / "spool" / "journal"
    directory.mkdir(parents=True)
    log = directory / "journal-00000000000000000001.log"
    log.write_bytes(line({"a": admitted().to_json()}))
    slots = directory / "journal-00000000000000000001.slots"
    slots.write_bytes(bytes(2 * SLOT_BYTES))
    spool = Spool(tmp_path / "spool")
    spool.open()
    (record,) = await recover([log, slots], spool)
    await spool.close()
    assert record.request_id == "r1"
    assert list(directory.iterdir()) == []


@pytest.mark.parametrize(
    ("area", "expected"),
    [
        # vLLM 0.32's usage, from its first key: every count whole.
        (b'"prompt_tokens":10,"total_tokens":11,"completion_tokens":1,"completio', (10, 1)),
        # The completion count cut by the area's end: the total less the prompt.
        (b'"prompt_tokens":1234567,"total_tokens":1240000,"completion_tokens":5', (1234567, 5433)),
        # The total cut too: the prompt alone.
        (b'"prompt_tokens":1234567,"total_tokens":12400', (1234567, None)),
        # A short usage, zeros after it (the simulator's last key closes the object).
        (b'"prompt_tokens":7,"total_tokens":9,"completion_tokens":2}}\n\n\0\0\0', (7, 2)),
        # Nothing written yet.
        (bytes(47), (None, None)),
    ],
)
def test_a_usage_area_reads_only_whole_numbers(area, expected):
    """A number the area's end cut is never read as a smaller one."""
    assert usage_counts(area) == expected


def test_a_slot_file_of_the_earlier_layout_is_still_read():
    """A ``IMSLOTS1`` file (256-byte slots, no ending) left by an earlier version gives its
    requests' progress, with no ending."""
    from infermeter.journal_files import SLOTS_MAGIC_V1, SlotLayout

    data = bytearray(3 * 256)
    data[: len(SLOTS_MAGIC_V1)] = SLOTS_MAGIC_V1
    at = 2 * 256
    data[at] = 1  # taken
    data[at + SlotLayout.ID_SIZE] = 2
    data[at + SlotLayout.ID : at + SlotLayout.ID + 2] = b"r9"
    area = b'"prompt_tokens":5,"total_tokens":8,'
    data[at + 160 : at + 160 + len(area)] = area
    data[at + 160 + SlotLayout.AREA_BYTES] = 1
    _, found = read_slots(bytes(data))
    assert (found["r9"].prompt, found["r9"].completion, found["r9"].ending) == (5, 3, None)
