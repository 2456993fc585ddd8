"""The records of the requests that ended in one tick go to the spool together."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from infermeter.spool import read_segment
from tests.sidecar.conftest import Stack, StackFactory

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def on_disk(stack: Stack) -> list[dict[str, Any]]:
    """The records in the spool's files, as they are (nothing flushed first)."""
    return [r for seg in sorted(stack.spool.glob("seg-*.jsonl")) for r in read_segment(seg)[0]]


async def test_a_ticks_records_take_one_write_and_one_fsync(
    stack_factory: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve requests, streamed and not, end within one tick: none is written on its path, and
    the tick writes all twelve with one write(2) and one fsync."""
    stack = await stack_factory(**{"sidecar.journal_mark_millis": 60_000})
    async with stack.client() as c:
        answers = await asyncio.gather(
            *(
                c.post("/v1/chat/completions", json={**CHAT, "stream": i % 2 == 0})
                for i in range(12)
            )
        )
    assert [a.status_code for a in answers] == [200] * 12
    accounting, spool = stack.sidecar.accounting, stack.sidecar.spool
    assert on_disk(stack) == []
    assert accounting.waiting == 12
    fsyncs: list[int] = []
    fsync = os.fsync

    def counting(fd: int) -> None:
        fsyncs.append(fd)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", counting)
    writes, syncs = spool.write_calls, spool.sync_calls
    await accounting.flush()
    assert (spool.write_calls - writes, spool.sync_calls - syncs, len(fsyncs)) == (1, 1, 1)
    records = on_disk(stack)
    assert [r["status"] for r in records] == ["ok"] * 12
    assert {r["completion_tokens"] for r in records} == {4}
    assert accounting.waiting == 0
    assert stack.sidecar.journal._ended == {}


async def test_records_are_written_by_the_tick_without_being_asked(
    stack_factory: StackFactory,
) -> None:
    """With a tick of 50 ms, a request's record is in the spool soon after its end."""
    stack = await stack_factory(**{"sidecar.journal_mark_millis": 50})
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    for _ in range(100):
        if on_disk(stack):
            break
        await asyncio.sleep(0.02)
    (record,) = on_disk(stack)
    assert (record["status"], record["completion_tokens"]) == ("ok", 4)


async def test_a_large_tick_lets_the_event_loop_run_while_its_lines_are_made(
    tmp_path: Path,
) -> None:
    """600 records at one tick: the event loop runs other work between slices of them, and the
    spool still gets them in one write and one fsync."""
    from infermeter.records import RequestStatus
    from infermeter.spool import Spool
    from sidecar.accounting import Accounting, Call
    from sidecar.journal import AdmissionJournal
    from sidecar.metrics import SidecarMetrics
    from sidecar.stream import UsageCounts

    spool = Spool(tmp_path / "spool")
    spool.open()
    journal = AdmissionJournal(tmp_path / "spool" / "journal", 3600)
    journal.open()
    accounting = Accounting(spool, journal, SidecarMetrics(), "small-0", None, "refuse", 3600)
    for i in range(600):
        call = Call(f"r{i:04d}", "/v1/chat/completions", 1.7e9, 0.0, team="search")
        journal.admit(accounting.admission(call), call.started)
        accounting.record(call, RequestStatus.OK, 200, UsageCounts(7, 3), None, "stop")
    ran: list[bool] = []
    written: list[bool] = []
    append_lines = spool.append_lines

    async def noting(lines: list[bytes]) -> None:
        written.append(bool(ran))
        await append_lines(lines)

    spool.append_lines = noting  # type: ignore[method-assign]
    asyncio.get_running_loop().call_soon(ran.append, True)
    writes, syncs = spool.write_calls, spool.sync_calls
    await accounting.flush()
    assert written == [True]
    assert (spool.write_calls - writes, spool.sync_calls - syncs) == (1, 1)
    assert len(on_disk_of(tmp_path / "spool")) == 600
    await journal.close()
    await spool.close()


def on_disk_of(directory: Path) -> list[dict[str, Any]]:
    """The records in a spool directory's files."""
    return [r for seg in sorted(directory.glob("seg-*.jsonl")) for r in read_segment(seg)[0]]
