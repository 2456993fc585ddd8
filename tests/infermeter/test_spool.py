"""The spool's group commit: records share writes, and none is acknowledged before its fsync."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from infermeter.spool import Spool, read_segment


class CountingSpool(Spool):
    """A spool that counts its writes (each is one write and one fsync)."""

    writes = 0

    def _write(self, data: bytes) -> None:
        self.writes += 1
        super()._write(data)


async def _append_staggered(spool: Spool, count: int, gap_seconds: float) -> None:
    async def one(i: int) -> None:
        await asyncio.sleep(i * gap_seconds)
        await spool.append({"n": i})

    await asyncio.gather(*(one(i) for i in range(count)))


async def test_records_expected_soon_share_one_write(tmp_path: Path) -> None:
    """While siblings are in flight, records arriving within the commit delay share a write."""
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
