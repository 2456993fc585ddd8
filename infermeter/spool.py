"""A local, append-only, group-committed spool of records on their way to billing.

A record is durable when ``append`` returns: it is written and fsync'ed. Appends that arrive
while a write is in progress share the next write and fsync (group commit), so a thousand
concurrent requests cost a few fsyncs, not a thousand. The write and fsync run in the spool's own
thread (``infermeter.disk_thread``) so the event loop keeps relaying tokens meanwhile.

Each write costs a hand-off to that thread and back, which on a busy two-core machine costs more
CPU than the write itself, so a write should carry as many records as it can. With
``commit_delay_seconds`` and a ``siblings`` count (the requests in flight that will each append a
record), the writer holds a write back for at most that delay while more of them are still to
come, as PostgreSQL's ``commit_delay`` does when ``commit_siblings`` transactions are open. A
lone request is never held back, and no record is ever acknowledged before its fsync.

Layout: ``<dir>/seg-<n>.jsonl`` segment files, one JSON record per line. The newest segment is
open for appends; older ones are closed and handed to the shipper, which deletes a segment only
once billing has acknowledged every record in it. A process that dies mid-write can leave a torn
last line: it is reported by ``read_segment`` and skipped (its request never saw its end, since
durability comes before the response does).

Seals: with a ``sealer`` (``infermeter.writers.Sealer``), each line carries the writer's seal as its
last key, one HMAC per record computed in ``append``, so a line changed or written on disk by
anyone without the writer's key is refused by billing. ``read_segment`` gives the records without
it.

Size: with ``max_bytes`` set, the records not yet acknowledged (on disk or queued) never take more
than that; an append that would pass it fails with ``SpoolError`` at once, like a full disk, and
the caller's failure policy applies. Space comes back as billing acknowledges segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from infermeter.disk_thread import DiskThread

__all__ = ["Segment", "SegmentReader", "Spool", "SpoolError", "read_segment"]

log = logging.getLogger("infermeter.spool")


class SpoolError(Exception):
    """A record could not be made durable (disk full, read-only, ...)."""


@dataclass(frozen=True)
class Segment:
    """A closed segment file and how many records it holds."""

    path: Path
    records: int
    size_bytes: int = 0


def read_segment(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Records of a segment (without their seals) and the number of unreadable (torn) lines."""
    records, torn = [], 0
    with path.open("rb") as fh:
        for line in fh:
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                torn += 1
                continue
            if isinstance(record, dict):
                record.pop("seal", None)
            records.append(record)
    return records, torn


class SegmentReader:
    """A segment's complete lines in batches of at most ``records`` lines or about ``max_bytes``.

    Iterate it once; afterwards ``torn`` is 1 if the last line was torn (and skipped). Lines are
    read as they are needed, so shipping a large segment holds one batch in memory, not the file.
    """

    def __init__(self, path: Path, records: int, max_bytes: int) -> None:
        self.path = path
        self.records = records
        self.max_bytes = max_bytes
        self.torn = 0

    def __iter__(self) -> Iterator[list[bytes]]:
        batch: list[bytes] = []
        size = 0
        with self.path.open("rb") as fh:
            for line in fh:
                if not line.endswith(b"\n"):
                    self.torn = 1  # only the last line can lack its newline
                    break
                batch.append(line)
                size += len(line)
                if len(batch) >= self.records or size >= self.max_bytes:
                    yield batch
                    batch, size = [], 0
        if batch:
            yield batch


def _nothing() -> None:
    pass


class Spool:
    """Group-committing writer of one spool directory."""

    def __init__(
        self,
        directory: Path,
        roll_seconds: float = 2.0,
        roll_records: int = 50_000,
        max_bytes: int | None = None,
        commit_delay_seconds: float = 0.0,
        sealer: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self.directory = directory
        # The writer's seal on each line (``infermeter.writers.Sealer``); None writes them bare.
        self.sealer = sealer
        self.commit_delay_seconds = commit_delay_seconds
        # How many records are still to come (see ``expect``); none known by default.
        self._siblings: Callable[[], int] | None = None
        self.max_bytes = max_bytes
        # Bytes of records not yet acknowledged: closed and open segments plus queued appends.
        self.size_bytes = 0
        self._current_bytes = 0
        self.roll_seconds = roll_seconds
        self.roll_records = roll_records
        self._queue: asyncio.Queue[tuple[bytes, asyncio.Future[None]]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._fh: IO[bytes] | None = None
        self._current: Path | None = None
        self._current_records = 0
        self._opened_at = 0.0
        self._closed: list[Segment] = []
        self._lock = asyncio.Lock()
        self._disk = DiskThread(f"spool {directory.name}")
        self.backlog = 0

    def open(self) -> None:
        """Create the directory, adopt segments left by an earlier run, start the writer."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.glob("seg-*.jsonl")):
            records, _ = read_segment(path)
            size = path.stat().st_size
            self._closed.append(Segment(path, len(records), size))
            self.backlog += len(records)
            self.size_bytes += size
        self._queue = asyncio.Queue()
        self._lock = asyncio.Lock()
        self._task = asyncio.get_running_loop().create_task(self._writer())

    def expect(self, siblings: Callable[[], int]) -> None:
        """Count on ``siblings()`` appends to come (queued ones included) when deciding to wait."""
        self._siblings = siblings

    async def close(self) -> None:
        """Stop the writer after the queued appends and close the open segment."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            # A write the cancelled writer was waiting for ends before its file is closed.
            await self._disk.run(_nothing)
            self._disk.stop()
        self._roll()

    async def append(self, record: dict[str, Any]) -> None:
        """Return once ``record`` is on disk; SpoolError if it cannot be."""
        assert self._queue is not None, "Spool.open() first"
        line = orjson.dumps(record)
        if self.sealer is not None:
            line = self.sealer(line)
        line += b"\n"
        if self.max_bytes is not None and self.size_bytes + len(line) > self.max_bytes:
            raise SpoolError(
                f"usage spool in {self.directory} is full ({self.size_bytes} of {self.max_bytes} bytes)"
            )
        self.size_bytes += len(line)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((line, future))
        await future

    async def _writer(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            if self._worth_waiting():
                await asyncio.sleep(self.commit_delay_seconds)
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            data = b"".join(line for line, _ in batch)
            try:
                async with self._lock:  # the shipper rolls segments under the same lock
                    await self._disk.run(functools.partial(self._write, data))
            except OSError as exc:
                error = SpoolError(
                    f"cannot write usage spool in {self.directory}: {exc.strerror or exc}"
                )
                log.error("%s", error)
                self.size_bytes -= len(data)
                self._abandon_current()
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            self._current_records += len(batch)
            self._current_bytes += len(data)
            self.backlog += len(batch)
            for _, future in batch:
                if not future.done():
                    future.set_result(None)
            if self._current_records >= self.roll_records:
                self._roll()

    def _worth_waiting(self) -> bool:
        """More records are expected than are queued, and a delay is allowed."""
        assert self._queue is not None
        if self._siblings is None or self.commit_delay_seconds <= 0:
            return False
        # The record already taken off the queue is one of the siblings.
        return self._siblings() > self._queue.qsize() + 1

    def _write(self, data: bytes) -> None:
        if self._fh is None:
            self._start_segment()
        assert self._fh is not None
        self._fh.write(data)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def _start_segment(self) -> None:
        stamp = time.time_ns()
        self._current = self.directory / f"seg-{stamp:020d}.jsonl"
        self._fh = self._current.open("ab")
        self._current_records = 0
        self._current_bytes = 0
        self._opened_at = time.monotonic()

    def _abandon_current(self) -> None:
        """After a failed write the open file's tail is unknown: close it and start afresh."""
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
        if self._current is not None and self._current_records:
            self._closed.append(Segment(self._current, self._current_records, self._current_bytes))
        self._fh, self._current, self._current_records = None, None, 0

    def _roll(self) -> None:
        if self._fh is None or self._current is None:
            return
        self._fh.close()
        if self._current_records:
            self._closed.append(Segment(self._current, self._current_records, self._current_bytes))
        else:
            self._current.unlink(missing_ok=True)
        self._fh, self._current, self._current_records = None, None, 0

    async def seal(self) -> None:
        """Close the open segment now, so that every record written so far can be shipped."""
        async with self._lock:
            self._roll()

    async def closed_segments(self) -> list[Segment]:
        """Segments ready to ship, oldest first; rolls the open one when it is old enough."""
        async with self._lock:
            if self._fh is not None and time.monotonic() - self._opened_at >= self.roll_seconds:
                self._roll()
            return list(self._closed)

    def acknowledge(self, segment: Segment) -> None:
        """Billing has every record of ``segment``: delete it."""
        segment.path.unlink(missing_ok=True)
        self._closed.remove(segment)
        self.backlog -= segment.records
        self.size_bytes -= segment.size_bytes
