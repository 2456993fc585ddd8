"""The sidecar's admission journal: what it writes, and what a killed sidecar's journal becomes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from infermeter.journal_files import (
    SLOT_BYTES,
    Progress,
    SlotLayout,
    files_in,
    read_slots,
    recover,
    unfinished,
)
from infermeter.spool import Spool, read_segment
from sidecar.assemble import Assembler
from sidecar.journal import AdmissionJournal, JournalError
from sidecar.progress import SlotTable
from sidecar.stream import StreamMeter, UsageCounts
from tests.disks import small_disk
from tests.infermeter.test_journal_files import T0, admitted


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


def slots_on_disk(directory: Path) -> dict[str, Progress]:
    """What the slot file holds, read from the file as a new process would (not the mapping)."""
    (path,) = directory.glob("journal-*.slots")
    return read_slots(path.read_bytes())[1]


async def test_a_stream_keeps_its_counts_in_its_slot_with_no_write_per_chunk(tmp_path):
    """Each chunk fed leaves vLLM's counts in the slot file; the journal file does not grow."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted().to_json(), 100.0)
    assert journal._path is not None
    size = journal._path.stat().st_size
    meter = StreamMeter(True, True, 100.0, slot=journal.slot("r1"))
    for i in range(1, 11):
        meter.feed(chunk(i), 100.0 + i / 100)
        assert slots_on_disk(tmp_path / "journal")["r1"].completion == i
    progress = slots_on_disk(tmp_path / "journal")["r1"]
    assert (progress.prompt, progress.completion, progress.response_id) == (7, 10, "c")
    assert progress.first_token_at == pytest.approx(T0 + 0.01)
    assert journal._path.stat().st_size == size
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
        dead.admit(admitted(rid).to_json(), 100.0)
    r1 = StreamMeter(False, False, 100.0, slot=dead.slot("r1"))
    r1.feed(chunk(0).replace(b'"id":"c"', b'"id":"chatcmpl-r1"') + chunk(1) + chunk(2), 100.5)
    # r3 ends as the sidecar ends a request: its record spooled, then finished in the journal
    # (a line that waits for the next write, so the death below loses it).
    await spool.append(admitted("r3").to_json() | {"status": "ok", "completion_tokens": 7})
    dead.finish("r3")
    # The process dies: nothing is flushed, closed or deleted by it.
    os.close(dead._fd)
    assert dead._task is not None
    assert dead._slots is not None
    dead._task.cancel()
    dead._slots.close(delete=False)

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
    got = records[-1]
    assert (got["prompt_tokens"], got["completion_tokens"], got["response_id"]) == (
        7,
        2,
        "chatcmpl-r1",
    )
    assert (got["http_status"], got["usage_exact"]) == (502, False)  # its head was never sent
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


async def test_rotation_copies_a_running_stream_and_can_rotate_again(tmp_path):
    """The running requests' admissions, read back from the old file, go to the new one; a
    second rotation copies them again, and the stream's slot still has its counts."""
    journal = AdmissionJournal(tmp_path / "journal", 0.05, rotate_bytes=2_000)
    journal.open()
    journal.admit(admitted("long").to_json(), 100.0)
    meter = StreamMeter(True, True, 100.0, slot=journal.slot("long"))
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
    assert slots_on_disk(tmp_path / "journal")["long"].completion == 4
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
    meter = StreamMeter(True, True, 100.0, slot=journal.slot("r1"))
    meter.slot.began()  # type: ignore[union-attr]
    meter.feed(chunk(1) + chunk(2) + chunk(3), 100.5)
    (record,) = journal.interrupted_now()
    assert (record.status, record.completion_tokens, record.usage_exact) == ("interrupted", 3, True)
    assert (record.http_status, record.response_id) == (200, "c")
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


def vllm_chunk(index: int, prompt: int, completion: int, rid: bytes = b"chatcmpl-9f2") -> bytes:
    """A chunk as real vLLM 0.32 writes it with continuous usage (``completion_tokens_details``
    after the count), for choice ``index``."""
    return (
        b'data: {"id":"%s","object":"chat.completion.chunk","created":1,"model":"m","choices":'
        b'[{"index":%d,"delta":{"content":"x"},"logprobs":null,"finish_reason":null,'
        b'"token_ids":null}],"usage":{"prompt_tokens":%d,"total_tokens":%d,'
        b'"completion_tokens":%d,"completion_tokens_details":null}}\n\n'
        % (rid, index, prompt, prompt + completion, completion)
    )


async def test_a_count_torn_by_a_kill_leaves_the_previous_one(tmp_path):
    """Counts go to two areas in turn, each with its sequence number last: a process killed
    mid-copy leaves garbage where the next count was going, and recovery reads the last whole one."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted().to_json(), 100.0)
    meter = StreamMeter(False, False, 100.0, slot=journal.slot("r1"))
    meter.feed(vllm_chunk(0, 7, 0) + vllm_chunk(0, 7, 1), 100.1)
    meter.feed(vllm_chunk(0, 7, 2), 100.2)
    (path,) = (tmp_path / "journal").glob("journal-*.slots")
    data = bytearray(path.read_bytes())
    assert slots_on_disk(tmp_path / "journal")["r1"].completion == 2
    for area in SlotLayout.AREAS:  # the next copy begun in the other area, its number not yet
        at = SLOT_BYTES + area
        if b'"total_tokens":9,' not in data[at : at + SlotLayout.AREA_BYTES]:
            data[at : at + 30] = b'"prompt_tokens":7,"total_token'
    assert read_slots(bytes(data))[1]["r1"].completion == 2
    await journal.close()


async def test_a_slot_given_back_takes_no_late_write(tmp_path):
    """The next request gets the slot a finished one gave back; a write through the old
    request's handle changes nothing of it."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted("r1").to_json(), 100.0)
    old = journal.slot("r1")
    assert old is not None
    journal.finish("r1")
    journal.admit(admitted("r2").to_json(), 100.0)
    late = vllm_chunk(0, 7, 99)
    old.usage(late, late.find(b'"usage":{'))
    old.counts(UsageCounts(7, 99))
    assert slots_on_disk(tmp_path / "journal") == {"r2": Progress(None, None)}
    await journal.close()


def test_the_slot_file_grows_when_every_slot_is_taken(tmp_path):
    """Past its first size the file doubles; every slot, old and new, keeps its own request."""
    table = SlotTable(tmp_path / "journal-1.slots", slots=4)
    slots = [table.take(f"r{i}", 0.0) for i in range(10)]
    for i, slot in enumerate(slots):
        assert slot is not None
        slot.counts(UsageCounts(i, 10 * i))
    got = read_slots((tmp_path / "journal-1.slots").read_bytes())[1]
    assert {rid: (p.prompt, p.completion) for rid, p in got.items()} == {
        f"r{i}": (i, 10 * i) for i in range(10)
    }
    table.close(delete=True)
    assert not (tmp_path / "journal-1.slots").exists()


async def test_two_choices_keep_the_sum_of_both(tmp_path):
    """n=2: each chunk counts its own choice; the slot holds both choices' latest, the prompt once."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted().to_json(), 100.0)
    meter = StreamMeter(False, False, 100.0, choices=2, slot=journal.slot("r1"))
    for i in range(1, 4):
        meter.feed(vllm_chunk(0, 7, i), 100 + i / 10)
        meter.feed(vllm_chunk(1, 7, i), 100 + i / 10)
    meter.feed(vllm_chunk(0, 7, 4), 101.0)
    progress = slots_on_disk(tmp_path / "journal")["r1"]
    assert (progress.prompt, progress.completion, progress.response_id) == (
        7,
        4 + 3,
        "chatcmpl-9f2",
    )
    await journal.close()


async def test_an_assembled_request_keeps_its_prompt_at_once_and_its_tokens_at_each_tick(tmp_path):
    """A non-streamed request read as a stream: the prompt and response id of its first block
    are in its slot at once; its completion tokens follow at the next tick."""
    journal = AdmissionJournal(tmp_path / "journal", 0.05)
    journal.open()
    journal.admit(admitted(stream=False).to_json(), 100.0)
    assembler = Assembler("/v1/chat/completions", n=2)
    journal.track("r1", assembler)
    slot = journal.slot("r1")
    assert slot is not None
    first = vllm_chunk(0, 7, 0, b"chatcmpl-whole")
    assert not slot.opening(first[:150])  # no whole usage object yet
    assert slot.opening(first)
    for i in range(1, 6):
        assembler.feed(vllm_chunk(0, 7, i) + vllm_chunk(1, 7, i))
    progress = slots_on_disk(tmp_path / "journal")["r1"]
    assert (progress.prompt, progress.completion, progress.response_id) == (7, 0, "chatcmpl-whole")
    await asyncio.sleep(0.15)
    assert slots_on_disk(tmp_path / "journal")["r1"].completion == 10
    (record,) = journal.interrupted_now()
    assert (record.prompt_tokens, record.completion_tokens) == (7, 10)
    assert (record.http_status, record.response_id) == (502, "chatcmpl-whole")
    await journal.close()


async def test_ids_a_slot_cannot_hold_are_left_out_not_cut(tmp_path):
    """A request id over 32 bytes gets no slot (the sidecar's own are 32); a response id over
    96 bytes (vLLM's prefix on a long ``x-request-id``) is not kept rather than kept in part."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted("x" * 33).to_json(), 0.0)
    assert journal.slot("x" * 33) is None
    journal.admit(admitted("r1").to_json(), 0.0)
    slot = journal.slot("r1")
    assert slot is not None
    slot.response_id("chatcmpl-" + "y" * 88)
    assert slots_on_disk(tmp_path / "journal")["r1"].response_id is None
    slot.response_id("chatcmpl-" + "y" * 87)
    assert slots_on_disk(tmp_path / "journal")["r1"].response_id == "chatcmpl-" + "y" * 87
    assert sorted(r.request_id for r in journal.interrupted_now()) == ["r1", "x" * 33]
    await journal.close()


async def test_a_journal_left_by_a_dead_process_is_every_file_it_wrote(tmp_path):
    """The files an earlier process left, as ``open`` returns them: its logs, then its slot file."""
    dead = AdmissionJournal(tmp_path / "journal", 60)
    dead.open()
    await dead.close()
    assert files_in(tmp_path / "journal") == []
    dead = AdmissionJournal(tmp_path / "journal", 60)
    dead.open()
    dead.admit(admitted().to_json(), 0.0)
    await dead.close()  # a request still running: its files stay
    restarted = AdmissionJournal(tmp_path / "journal", 60)
    left = restarted.open()
    assert [p.suffix for p in left] == [".log", ".slots"]
    await restarted.close()


async def test_an_admission_that_cannot_be_written_takes_no_slot(tmp_path):
    """A journal that cannot be written refuses the admission (JournalError) and gives its slot
    back: no slot names a request the journal has no line of."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    fd, journal._fd = journal._fd, os.open(os.devnull, os.O_RDONLY)  # writes now fail (EBADF)
    with pytest.raises(JournalError, match="cannot write the admission journal"):
        journal.admit(admitted().to_json(), 0.0)
    assert journal.running == 0
    assert slots_on_disk(tmp_path / "journal") == {}
    os.close(journal._fd)
    journal._fd = fd
    await journal.close()


def die(journal: AdmissionJournal) -> None:
    """The process dies: nothing is flushed, closed or deleted by it."""
    os.close(journal._fd)
    assert journal._task is not None
    assert journal._slots is not None
    journal._task.cancel()
    journal._slots.close(delete=False)


async def test_an_ended_request_is_recovered_as_it_ended_not_as_interrupted(tmp_path):
    """A request whose ending is in its slot, its record not yet written, becomes after a kill
    the complete record of how it ended: its status, HTTP status, final counts, finish reason,
    end time, first token and response id; not an interrupted one."""
    spool = Spool(tmp_path / "spool")
    spool.open()
    dead = AdmissionJournal(tmp_path / "spool" / "journal", 60)
    dead.open()
    dead.admit(admitted("r1").to_json(), 100.0)
    meter = StreamMeter(True, True, 100.0, slot=dead.slot("r1"))
    meter.feed(chunk(1) + chunk(2), 100.25)
    slot = dead.end("r1")
    assert slot is not None
    assert dead.running == 0
    slot.end("ok", 200, UsageCounts(7, 3, 4), True, 100.25, 101.5, "length", "chatcmpl-r1")
    die(dead)

    restarted = AdmissionJournal(tmp_path / "spool" / "journal", 60)
    (record,) = await recover(restarted.open(), spool)
    await restarted.close()
    await spool.close()
    assert (record.status, record.http_status, record.usage_exact) == ("ok", 200, True)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_prompt_tokens) == (
        7,
        3,
        4,
    )
    assert (record.finish_reason, record.response_id) == ("length", "chatcmpl-r1")
    assert record.first_token_at == pytest.approx(T0 + 0.25)
    assert record.finished_at == pytest.approx(T0 + 1.5)
    assert (record.team, record.model, record.stream) == ("search", "chat-small", True)


async def test_an_ending_without_usage_is_recovered_with_no_tokens(tmp_path):
    """A request that ended with no usage (a client that left before any) keeps its status and
    is billed nothing, inexact, although its slot had counted chunks before."""
    dead = AdmissionJournal(tmp_path / "journal", 60)
    dead.open()
    dead.admit(admitted("r1").to_json(), 100.0)
    StreamMeter(True, True, 100.0, slot=dead.slot("r1")).feed(chunk(1), 100.1)
    slot = dead.end("r1")
    assert slot is not None
    slot.end("client_aborted", 499, None, False, None, 100.5, None, None)
    progress = slots_on_disk(tmp_path / "journal")["r1"]
    assert progress.ending is not None
    assert (progress.prompt, progress.completion, progress.first_token_at) == (0, 0, None)
    assert (progress.ending.status, progress.ending.http_status) == ("client_aborted", 499)
    assert (progress.ending.usage_exact, progress.ending.finish_reason) == (False, None)
    await dead.close()


async def test_an_ended_request_already_in_the_spool_is_not_recorded_twice(tmp_path):
    """Killed after its record was written, before the journal was told: the record in the
    spool is the only one."""
    spool = Spool(tmp_path / "spool")
    spool.open()
    dead = AdmissionJournal(tmp_path / "spool" / "journal", 60)
    dead.open()
    dead.admit(admitted("r1").to_json(), 100.0)
    slot = dead.end("r1")
    assert slot is not None
    slot.end("ok", 200, UsageCounts(7, 3), True, None, 101.0, "stop", None)
    await spool.append_many([admitted("r1").to_json() | {"status": "ok", "completion_tokens": 3}])
    die(dead)

    restarted = AdmissionJournal(tmp_path / "spool" / "journal", 60)
    assert await recover(restarted.open(), spool) == []
    await restarted.close()
    await spool.close()
    records = [r for seg in spool.directory.glob("seg-*.jsonl") for r in read_segment(seg)[0]]
    assert [(r["request_id"], r["status"]) for r in records] == [("r1", "ok")]


async def test_a_slot_taken_again_holds_no_ending_of_its_last_request(tmp_path):
    """A slot freed after its request ended and taken by the next request reads as running."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted("r1").to_json(), 100.0)
    slot = journal.end("r1")
    assert slot is not None
    slot.end("ok", 200, UsageCounts(7, 3), True, None, 101.0, "stop", None)
    journal.finish("r1")
    journal.admit(admitted("r2").to_json(), 100.0)
    assert slots_on_disk(tmp_path / "journal")["r2"].ending is None
    await journal.close()


async def test_shutdown_records_an_ended_request_as_it_ended(tmp_path):
    """``interrupted_now`` gives an ended request whose record was not written its real ending."""
    journal = AdmissionJournal(tmp_path / "journal", 60)
    journal.open()
    journal.admit(admitted("r1").to_json(), 100.0)
    journal.admit(admitted("r2").to_json(), 100.0)
    slot = journal.end("r1")
    assert slot is not None
    slot.end("ok", 200, UsageCounts(7, 3), True, None, 101.0, "stop", None)
    got = {r.request_id: r for r in journal.interrupted_now()}
    assert (got["r1"].status, got["r1"].completion_tokens, got["r1"].usage_exact) == ("ok", 3, True)
    assert got["r2"].status == "interrupted"
    await journal.close()


# Admits a request into a journal in argv[1], fills the disk, then admits 40 more one after
# another and says how each went; run in a process of its own, since a SIGBUS would kill the test's.
_ADMIT_ON_A_FULL_DISK = """
import asyncio, contextlib, sys
from pathlib import Path
from sidecar.journal import AdmissionJournal, JournalError
from tests.infermeter.test_journal_files import admitted

async def main():
    disk = Path(sys.argv[1])
    journal = AdmissionJournal(disk / "journal", 60)
    journal.open()
    journal.admit(admitted("before").to_json(), 0.0)  # (the log's page has room for more)
    with (disk / "filler").open("wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(bytes(4096))
    for i in range(40):
        try:
            journal.admit(admitted(f"r{i}").to_json(), 0.0)
            print("admitted", flush=True)
        except JournalError:
            print("refused", flush=True)

asyncio.run(main())
"""


def test_a_full_disk_refuses_admissions_and_does_not_kill_the_sidecar(tmp_path):
    """On a really full disk (a small tmpfs) a new slot is refused with JournalError, as the
    journal's line is: storing into a slot the file system had no page for was a SIGBUS that
    killed the sidecar, and every stream it relayed with it."""
    with small_disk(tmp_path / "disk", "1M") as disk:
        done = subprocess.run(
            [sys.executable, "-c", _ADMIT_ON_A_FULL_DISK, str(disk)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).parents[2],
        )
    assert done.returncode == 0, done.stderr or f"killed by signal {-done.returncode}"
    said = done.stdout.split()
    assert len(said) == 40
    assert "refused" in said


async def test_an_admission_cut_short_by_a_full_disk_leaves_no_torn_line(tmp_path):
    """A line the full disk took in part is cut off again, so the next admission, once there is
    room, is a line of its own that recovery reads (it joined the torn one and was lost)."""
    with small_disk(tmp_path / "disk", "1M") as disk:
        journal = AdmissionJournal(disk / "journal", 60)
        journal.open()
        journal.admit(admitted("before").to_json(), 0.0)
        with (disk / "filler").open("wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:
                fh.write(bytes(4096))
        refused = 0
        for i in range(10):  # the log's last page fills, and a line is taken in part
            try:
                journal.admit(admitted(f"r{i}").to_json(), 0.0)
            except JournalError:
                refused += 1
        (disk / "filler").unlink()
        journal.admit(admitted("after").to_json(), 0.0)
        (log,) = (disk / "journal").glob("journal-*.log")
        pending = unfinished(log.read_bytes().splitlines(keepends=True))
        die(journal)
    assert refused
    assert "after" in pending
    assert len(pending) == 1 + 10 - refused + 1
