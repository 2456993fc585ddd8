"""The sidecar's admission journal: what it writes, and what a killed sidecar's journal becomes."""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import orjson
import pytest

from infermeter.journal import recover, unfinished
from infermeter.spool import Spool, read_segment
from sidecar.journal import AdmissionJournal
from sidecar.stream import StreamMeter
from tests.infermeter.test_journal import T0, admitted


def chunk(completion: int) -> bytes:
    """A vLLM SSE chunk of one token with continuous usage."""
    return (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],'
        b'"usage":{"prompt_tokens":7,"total_tokens":%d,"completion_tokens":%d}}\n\n'
        % (7 + completion, completion)
    )


async def test_a_finished_request_leaves_no_journal(tmp_path):
    """Admitted and finished, then closed: the journal file is deleted and nothing is pending."""
    journal = AdmissionJournal(tmp_path / "journal", 0.05)
    assert journal.open() == []
    journal.admit(admitted().to_json(), 0.0)
    assert journal.running == 1
    journal.finish("r1")
    await journal.close()
    assert list((tmp_path / "journal").iterdir()) == []


async def test_marks_follow_the_meter_without_a_write_per_chunk(tmp_path):
    """Ten chunks between two marks make one mark line with the latest counts."""
    journal = AdmissionJournal(tmp_path / "journal", 0.1)
    journal.open()
    journal.admit(admitted().to_json(), 100.0)
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
        dead.admit(admitted(rid).to_json(), 0.0)
    # r3 ends as the sidecar ends a request: its record spooled, then finished in the journal
    # (a line that waits for the next write, so the death below loses it).
    await spool.append(admitted("r3").to_json() | {"status": "ok", "completion_tokens": 7})
    dead.finish("r3")
    os.close(dead._fd)  # the process dies: nothing is flushed, closed or deleted by it
    assert dead._task is not None
    dead._task.cancel()

    restarted = AdmissionJournal(tmp_path / "spool" / "journal", 60)
    left = restarted.open()
    assert [r.request_id for r in await recover(left, spool)] == ["r1"]
    await restarted.close()
    await spool.close()
    records = [
        r for seg in sorted(spool.directory.glob("seg-*.jsonl")) for r in read_segment(seg)[0]
    ]
    assert [(r["request_id"], r["status"]) for r in records] == [
        ("r2", "ok"),
        ("r3", "ok"),
        ("r1", "interrupted"),
    ]
    assert list((tmp_path / "spool" / "journal").iterdir()) == []


async def test_a_finish_line_goes_out_with_the_next_admission_in_one_write(tmp_path):
    """Ending a request costs no write of its own; the next admission carries its line."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted("r1").to_json(), 0.0)
    assert journal._path is not None
    size = journal._path.stat().st_size
    journal.finish("r1")
    assert journal._path.stat().st_size == size  # nothing written yet
    writes: list[bytes] = []
    real_write = journal._write

    def counted(data: bytes) -> None:
        writes.append(data)
        real_write(data)

    journal._write = counted  # type: ignore[method-assign]
    journal.admit(admitted("r2").to_json(), 0.0)
    assert len(writes) == 1
    assert writes[0].count(b"\n") == 2  # r1's end, then r2's admission
    assert list(unfinished(journal._path.read_bytes().splitlines(keepends=True))) == ["r2"]
    journal.finish("r2")
    await journal.close()  # the last end is written at close: no request left, file deleted
    assert list((tmp_path / "journal").iterdir()) == []


async def test_rotation_keeps_only_running_requests(tmp_path):
    """Past rotate_bytes a fresh file holds the running requests, and the old one is deleted."""
    journal = AdmissionJournal(tmp_path / "journal", 0.05, rotate_bytes=2_000)
    journal.open()
    for i in range(20):
        journal.admit(admitted(f"r{i}").to_json(), 0.0)
        if i != 7:
            journal.finish(f"r{i}")
    await asyncio.sleep(0.2)
    (path,) = (tmp_path / "journal").glob("journal-*.log")
    assert list(unfinished(path.read_bytes().splitlines())) == ["r7"]
    assert path.stat().st_size < 2_000
    await journal.close()


async def test_rotation_copies_a_running_stream_with_its_counts_and_can_rotate_again(tmp_path):
    """The running requests' admissions, read back from the old file, go to the new one with
    their latest counts; a second rotation copies them again, and recovery reads the result."""
    journal = AdmissionJournal(tmp_path / "journal", 0.05, rotate_bytes=2_000)
    journal.open()
    journal.admit(admitted("long").to_json(), 100.0)
    meter = StreamMeter(True, True, 100.0)
    journal.track("long", meter)
    meter.feed(chunk(1) + chunk(2), 100.5)
    for round_ in range(2):
        for i in range(8):
            journal.admit(admitted(f"r{round_}-{i}").to_json(), 0.0)
            journal.finish(f"r{round_}-{i}")
        await asyncio.sleep(0.2)
        meter.feed(chunk(3 + round_), 101.0)
    (path,) = (tmp_path / "journal").glob("journal-*.log")
    assert path.stat().st_size < 2_000
    pending = unfinished(path.read_bytes().splitlines())
    assert list(pending) == ["long"]
    assert pending["long"].record == admitted("long").to_json()
    assert pending["long"].mark is not None
    assert pending["long"].mark["c"] >= 3
    (record,) = journal.interrupted_now()
    assert (record.request_id, record.completion_tokens) == ("long", 4)
    await journal.close()


async def test_a_running_request_holds_no_copy_of_its_journal_lines(tmp_path):
    """What the journal keeps per running request does not grow with its admission line."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    big = admitted().to_json() | {"client_request_id": "x" * 8_000}
    journal.admit(big | {"request_id": "warm"}, 0.0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(100):
        journal.admit(big | {"request_id": f"r{i}"}, 0.0)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held < 100 * 1_000, f"{held / 100:.0f} bytes per running request"
    (record,) = [r for r in journal.interrupted_now() if r.request_id == "r42"]
    assert record.client_request_id == "x" * 8_000  # read back from the file whole
    await journal.close()


async def test_interrupted_now_uses_the_counts_of_this_moment(tmp_path):
    """At shutdown a request still running is recorded with its meter's counts as of now."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted().to_json(), 100.0)
    meter = StreamMeter(True, True, 100.0)
    journal.track("r1", meter)
    meter.feed(chunk(1) + chunk(2) + chunk(3), 100.5)
    (record,) = journal.interrupted_now()
    assert (record.status, record.completion_tokens, record.usage_exact) == ("interrupted", 3, True)
    assert record.first_token_at == pytest.approx(T0 + 0.5)
    await journal.close()


async def test_a_line_not_where_it_was_written_is_left_out_not_misread(tmp_path, caplog):
    """Running requests are read back by offset and checked: a file changed under the journal
    gives no wrong record, only an error (recovery at the next start reads the file whole)."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted("r1").to_json(), 0.0)
    journal.admit(admitted("r2").to_json(), 0.0)
    assert [r.request_id for r in journal.interrupted_now()] == ["r1", "r2"]
    assert journal._path is not None
    with journal._path.open("r+b") as fh:
        fh.write(b"x")  # r1's line no longer begins as an admission
    assert [r.request_id for r in journal.interrupted_now()] == ["r2"]
    assert "request r1 is not where it was written" in caplog.text
    journal._path.write_bytes(b"")
    assert journal.interrupted_now() == []
    await journal.close()
