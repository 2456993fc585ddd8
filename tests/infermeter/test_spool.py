"""The spool's group commit: records share fsyncs, and none is acknowledged before its fsync."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import IO

from infermeter.spool import Spool, read_segment


class CountingSpool(Spool):
    """A spool that counts its fsyncs (one hand-off to the disk thread each)."""

    writes = 0

    def _sync_files(self, files: list[IO[bytes]]) -> None:
        self.writes += 1
        super()._sync_files(files)


async def _append_staggered(spool: Spool, count: int, gap_seconds: float) -> None:
    async def one(i: int) -> None:
        await asyncio.sleep(i * gap_seconds)
        await spool.append({"n": i})

    await asyncio.gather(*(one(i) for i in range(count)))


async def test_records_expected_soon_share_one_write(tmp_path: Path) -> None:
    """While siblings are in flight, records arriving within the commit delay share an fsync."""
    spool = CountingSpool(tmp_path, commit_delay_seconds=0.2)
    spool.expect(lambda: 4)
    spool.open()
    await _append_staggered(spool, 4, 0.01)
    await spool.seal()
    assert spool.writes == 1
    [segment] = await spool.closed_segments()
    assert read_segment(segment.path) == ([{"n": i} for i in range(4)], 0)
    await spool.close()


async def test_a_lone_record_is_not_held_back(tmp_path: Path) -> None:
    """With no sibling in flight, a record is written at once, whatever the commit delay."""
    spool = CountingSpool(tmp_path, commit_delay_seconds=5.0)
    spool.expect(lambda: 1)
    spool.open()
    started = time.monotonic()
    await spool.append({"n": 0})
    assert time.monotonic() - started < 2.0
    assert spool.writes == 1
    await spool.close()


async def test_an_acknowledged_record_is_on_disk(tmp_path: Path) -> None:
    """When ``append`` returns after a delayed commit, the record is in the segment file."""
    spool = Spool(tmp_path, commit_delay_seconds=0.05)
    spool.expect(lambda: 3)
    spool.open()
    await spool.append({"n": 1})
    [path] = tmp_path.glob("seg-*.jsonl")
    assert read_segment(path) == ([{"n": 1}], 0)
    await spool.close()


async def test_a_written_record_is_in_the_file_before_its_fsync(tmp_path: Path) -> None:
    """``write`` puts the line in the segment file at once (a killed process keeps it); its
    ``durable`` callback runs only after the fsync, one tick later."""
    spool = CountingSpool(tmp_path, sync_seconds=0.2)
    spool.open()
    durable: list[int] = []
    spool.write({"n": 1}, lambda: durable.append(1))
    [path] = tmp_path.glob("seg-*.jsonl")
    assert read_segment(path) == ([{"n": 1}], 0)
    assert (durable, spool.writes) == ([], 0)
    await asyncio.sleep(0.4)
    assert (durable, spool.writes) == ([1], 1)
    await spool.close()


async def test_records_written_within_a_tick_share_one_fsync(tmp_path: Path) -> None:
    """Every record written during one tick is made durable by the same fsync."""
    spool = CountingSpool(tmp_path, sync_seconds=0.1)
    spool.open()
    durable: list[int] = []
    for i in range(50):
        spool.write({"n": i}, functools.partial(durable.append, i))
        await asyncio.sleep(0)
    await asyncio.sleep(0.3)
    assert durable == list(range(50))
    assert spool.writes == 1
    await spool.close()


async def test_an_append_does_not_wait_for_the_tick(tmp_path: Path) -> None:
    """An append waiting for its fsync ends the tick at once, and takes the written ones along."""
    spool = CountingSpool(tmp_path, sync_seconds=30.0)
    spool.open()
    durable: list[str] = []
    spool.write({"n": 0}, lambda: durable.append("written"))
    started = time.monotonic()
    await spool.append({"n": 1})
    assert time.monotonic() - started < 5.0
    assert durable == ["written"]
    assert spool.writes == 1
    await spool.close()


async def test_sync_makes_written_records_durable_now(tmp_path: Path) -> None:
    """``sync`` fsyncs at once and runs the callbacks of what was written before it."""
    spool = CountingSpool(tmp_path, sync_seconds=30.0)
    spool.open()
    durable: list[int] = []
    spool.write({"n": 0}, lambda: durable.append(0))
    await spool.sync()
    assert durable == [0]
    await spool.close()


async def test_a_record_is_written_to_the_segment_open_at_the_time(tmp_path: Path) -> None:
    """Records written across a roll land in both segments, each fsync'ed before it is closed."""
    spool = CountingSpool(tmp_path, sync_seconds=0.05, roll_records=2)
    spool.open()
    for i in range(5):
        spool.write({"n": i})
    await asyncio.sleep(0.2)
    segments = await spool.closed_segments()
    assert [read_segment(s.path)[0] for s in segments] == [
        [{"n": 0}, {"n": 1}],
        [{"n": 2}, {"n": 3}],
    ]
    assert spool._retired == []
    await spool.close()
    lines = [r for p in sorted(tmp_path.glob("seg-*.jsonl")) for r in read_segment(p)[0]]
    assert lines == [{"n": i} for i in range(5)]
