"""The admission journal: what it writes, and the records it makes of what a dead sidecar left."""

from __future__ import annotations

import asyncio
import os

import orjson
import pytest

from infermeter.records import RequestStatus, UsageRecord
from infermeter.spool import Spool, read_segment
from sidecar.journal import AdmissionJournal, Pending, interrupted_record, recover, unfinished
from sidecar.stream import StreamMeter

T0 = 1_790_812_800.0


def admitted(request_id: str = "r1", stream: bool = True) -> UsageRecord:
    """The record a request is journaled with when it is admitted."""
    return UsageRecord(
        request_id=request_id, team="search", model="chat-small", served_version="v1", replica="small-0",
        received_at=T0, first_token_at=None, finished_at=T0, prompt_tokens=0, cached_prompt_tokens=0,
        completion_tokens=0, status=RequestStatus.INTERRUPTED.value, http_status=502, stream=stream,
        usage_exact=False,
    )  # fmt: skip


def line(entry: dict[str, object]) -> bytes:
    """One journal line."""
    return orjson.dumps(entry) + b"\n"


def chunk(completion: int) -> bytes:
    """A vLLM SSE chunk of one token with continuous usage."""
    return (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],'
        b'"usage":{"prompt_tokens":7,"total_tokens":%d,"completion_tokens":%d}}\n\n'
        % (7 + completion, completion)
    )


def test_unfinished_keeps_admissions_without_an_end_and_their_last_mark():
    """An admission with no finish line is pending with its last mark; a finished one is gone."""
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
    got = (record.prompt_tokens, record.completion_tokens, record.first_token_at,
           record.http_status, record.finished_at)  # fmt: skip
    assert got == expected


async def test_a_finished_request_leaves_no_journal(tmp_path):
    """Admitted and finished, then closed: the journal file is deleted and nothing is pending."""
    journal = AdmissionJournal(tmp_path / "journal", 0.05)
    assert journal.open() == []
    journal.admit(admitted(), 0.0)
    assert journal.running == 1
    journal.finish("r1")
    await journal.close()
    assert list((tmp_path / "journal").iterdir()) == []


async def test_marks_follow_the_meter_without_a_write_per_chunk(tmp_path):
    """Ten chunks between two marks make one mark line with the latest counts."""
    journal = AdmissionJournal(tmp_path / "journal", 0.1)
    journal.open()
    journal.admit(admitted(), 100.0)
    meter = StreamMeter(True, True, 100.0)
    journal.track("r1", meter)
    for i in range(1, 11):
        meter.feed(chunk(i), 100.0 + i / 100)
    await asyncio.sleep(0.25)
    await asyncio.sleep(0.15)  # a tick with no new chunk writes no mark
    (path,) = (tmp_path / "journal").glob("journal-*.log")
    marks = [orjson.loads(x) for x in path.read_bytes().splitlines() if b'"m"' in x]
    assert [(m["p"], m["c"]) for m in marks] == [(7, 10)]
    assert marks[0]["t"] == pytest.approx(T0 + 0.01)
    await journal.close()


async def test_recover_spools_interrupted_records_once(tmp_path):
    """Requests a killed process left running become interrupted records; a spooled one is kept as it is."""
    spool = Spool(tmp_path / "spool")
    spool.open()
    real = admitted("r2").to_json() | {"status": "ok", "completion_tokens": 5}
    await spool.append(real)
    dead = AdmissionJournal(tmp_path / "spool" / "journal", 60)
    dead.open()
    for rid in ("r1", "r2", "r3"):
        dead.admit(admitted(rid), 0.0)
    dead.finish("r3")
    os.close(dead._fd)  # the process dies: nothing is flushed, closed or deleted by it
    assert dead._task is not None
    dead._task.cancel()

    restarted = AdmissionJournal(tmp_path / "spool" / "journal", 60)
    left = restarted.open()
    assert await recover(left, spool) == 1
    await restarted.close()
    await spool.close()
    records = [
        r for seg in sorted(spool.directory.glob("seg-*.jsonl")) for r in read_segment(seg)[0]
    ]
    assert [(r["request_id"], r["status"]) for r in records] == [
        ("r2", "ok"),
        ("r1", "interrupted"),
    ]
    assert list((tmp_path / "spool" / "journal").iterdir()) == []


async def test_rotation_keeps_only_running_requests(tmp_path):
    """Past rotate_bytes a fresh file holds the running requests, and the old one is deleted."""
    journal = AdmissionJournal(tmp_path / "journal", 0.05, rotate_bytes=2_000)
    journal.open()
    for i in range(20):
        journal.admit(admitted(f"r{i}"), 0.0)
        if i != 7:
            journal.finish(f"r{i}")
    await asyncio.sleep(0.2)
    (path,) = (tmp_path / "journal").glob("journal-*.log")
    assert list(unfinished(path.read_bytes().splitlines())) == ["r7"]
    assert path.stat().st_size < 2_000
    await journal.close()


async def test_interrupted_now_uses_the_counts_of_this_moment(tmp_path):
    """At shutdown a request still running is recorded with its meter's counts as of now."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted(), 100.0)
    meter = StreamMeter(True, True, 100.0)
    journal.track("r1", meter)
    meter.feed(chunk(1) + chunk(2) + chunk(3), 100.5)
    (record,) = journal.interrupted_now()
    assert (record.status, record.completion_tokens, record.usage_exact) == ("interrupted", 3, True)
    assert record.first_token_at == pytest.approx(T0 + 0.5)
    await journal.close()


async def test_recover_keeps_the_journal_when_the_spool_refuses(tmp_path):
    """A full spool at start: no record is lost, the journal stays for the next start."""
    left = tmp_path / "spool" / "journal" / "journal-00000000000000000001.log"
    left.parent.mkdir(parents=True)
    left.write_bytes(line({"a": admitted().to_json()}))
    spool = Spool(tmp_path / "spool", max_bytes=10)
    spool.open()
    assert await recover([left], spool) == 0
    await spool.close()
    assert left.exists()
    assert not list(spool.directory.glob("seg-*.jsonl"))
