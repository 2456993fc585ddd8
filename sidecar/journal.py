"""The admission journal: a trace of every admitted request, so that none ends without a record.

A request's usage record is made durable when the request ends (``infermeter.spool``). A sidecar
killed while it serves (SIGKILL, the OOM killer, a crash) never gets there, yet vLLM has already
spent GPU time on every request it forwarded, and a stream's client may hold many of its chunks.
The journal closes that gap:

- ``admit``: before a request is forwarded, one line holding its record as it would read if the
  request ended right then (status ``interrupted``, no tokens) goes to the journal file with one
  ``write(2)``. From that moment it survives the death of the process: the bytes are the kernel's.
  The request also takes a progress slot (``sidecar.progress``): a fixed place in a file mapped
  ``MAP_SHARED`` where its relay keeps, with memory stores before each chunk goes to the client,
  vLLM's counts in that chunk, the first-token time, vLLM's response id and whether the client
  had its head. The kernel keeps a killed process's stores, so recovery reads exact counts.
- Every ``mark_seconds`` a tick writes what cannot be written as it happens: the tokens so far of
  each non-streamed request read from vLLM's stream (``track``; its client receives nothing
  before the end, and the assembler parses its blocks only when asked), the time of the tick in
  the slot file's header, and the end lines waiting. Then one fsync of each file, in a thread,
  covers everything since the last tick (group commit), so a crash of the whole machine loses at
  most the last interval. Nothing is written or checked per chunk here.
- ``end``: the request ended; its relay writes how into its slot (``Slot.end``) before the
  client sees the end of its answer. Its record waits for the next tick of the accounting
  (``sidecar.accounting``), which writes the records of every request that ended in it at once;
  until then the slot stands for the record, and a process killed meanwhile leaves it to the next
  start, which makes that record from it.
- ``finish``: once the request's own record is durable in the spool, one line says so and its
  slot is given back. The line is not written at once but with the next admission or tick (one
  ``write(2)`` per request, not two): a line lost with the process only makes recovery look for
  the record in the spool, where it is (``infermeter.journal_files.recover`` skips spooled ids;
  billing keeps one record per id).

At start, ``infermeter.journal_files.recover`` turns what the previous process left into records (the
files' formats, and the rules of those records, are told there).

When a file passes ``rotate_bytes`` the requests still running are copied to a fresh one and the
old one is deleted. The slot file is not rotated: its slots are reused.

Memory: a running request costs the journal a small slotted entry with where its admission
line is in the file and its slot, not a copy of its lines. The admission lines of the running
requests are read back from the file when they are needed (at a rotation, and at shutdown for
``interrupted_now``): the file holds every one of them, since a rotation copies them, and it
was just written, so the read comes from the page cache. Keeping each line in memory instead
cost every open stream about 700 bytes for the whole of its length. Found by their offsets, the
lines of 1,000 running streams come out of a full file in about a millisecond
(``python -m bench.admission_journal``); searching the file for them took 33-45 ms, a stall of
the event loop at every rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import mmap
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from infermeter.journal_files import (
    Pending,
    admission_line,
    files_in,
    finish_line,
    record_of_pending,
)
from infermeter.records import UsageRecord
from sidecar.progress import Slot, SlotTable
from sidecar.stream import UsageCounts

__all__ = ["AdmissionJournal", "Counting", "JournalError"]

log = logging.getLogger("infermeter.sidecar")


class JournalError(Exception):
    """An admission could not be written to the journal (disk full, read-only, ...)."""


class Counting(Protocol):
    """A request whose tokens the tick writes to its slot: ``sidecar.assemble.Assembler``."""

    def usage_so_far(self) -> UsageCounts | None:
        """The tokens vLLM has reported so far."""


# How every admission line begins (``admission_line``: the record's first field is its id).
_ADMISSION = b'{"a":{"request_id":"'


@dataclass(slots=True)
class _Running:
    """One admitted request in memory (its lines are on disk, its progress in its slot)."""

    request_id: str
    # Where its admission line begins in the open file.
    at: int
    slot: Slot | None = None
    counting: Counting | None = None


class AdmissionJournal:
    """The journal of one sidecar: ``admit``, ``slot``, ``track``, ``finish``, and the ticks."""

    def __init__(self, directory: Path, mark_seconds: float, rotate_bytes: int = 8 << 20) -> None:
        self.directory = directory
        self.mark_seconds = mark_seconds
        self.rotate_bytes = rotate_bytes
        self._running: dict[str, _Running] = {}
        # Ended, their records not yet durable: their lines and slots are kept until ``finish``.
        self._ended: dict[str, _Running] = {}
        self._fd = -1
        self._path: Path | None = None
        self._size = 0
        self._unsynced = False
        self._slots: SlotTable | None = None
        # Slots were given back since the last fsync of their file.
        self._released = False
        self._task: asyncio.Task[None] | None = None
        # Finish lines waiting to go out with the next write.
        self._finished: list[bytes] = []

    @property
    def running(self) -> int:
        """Requests admitted and not yet ended."""
        return len(self._running)

    def open(self) -> list[Path]:
        """Start a fresh journal and slot file and the ticks; return the files an earlier
        process left (``infermeter.journal_files.journal_files``: its logs, then its slot files)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        left = files_in(self.directory)
        self._start_file()
        self._slots = SlotTable(self.directory / f"journal-{time.time_ns():020d}.slots")
        self._task = asyncio.get_running_loop().create_task(self._run())
        return left

    async def close(self) -> None:
        """Stop the ticks and close the files; they are deleted when no request is left running."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                self._tick(time.time())
                os.fsync(self._fd)
                if self._slots is not None:
                    os.fsync(self._slots.fd)
            os.close(self._fd)
            self._fd = -1
            if not self._running and not self._ended and self._path is not None:
                self._path.unlink(missing_ok=True)
        if self._slots is not None:
            self._slots.close(delete=not self._running and not self._ended)
            self._slots = None

    def admit(self, record: Mapping[str, Any], started: float) -> None:
        """Journal ``record`` (``UsageRecord.to_json``'s form, its end unknown yet), and give it
        a slot; ``started`` is the ``perf_counter`` of its ``received_at``.

        JournalError when it cannot be written.
        """
        line = admission_line(record)
        request_id: str = record["request_id"]
        assert self._slots is not None, "admit before open"
        slot = None
        try:
            # The slot first: one without an admission line is nobody's at recovery.
            slot = self._slots.take(request_id, record["received_at"] - started)
            if self._finished:
                data = b"".join((*self._finished, line))
                self._finished.clear()
            else:
                data = line
            at = self._size + len(data) - len(line)
            self._write(data)
        except OSError as exc:
            if slot is not None:
                self._slots.release(slot)
            raise JournalError(
                f"cannot write the admission journal in {self.directory}: {exc.strerror or exc}"
            ) from None
        self._running[request_id] = _Running(request_id, at, slot)

    def slot(self, request_id: str) -> Slot | None:
        """The slot ``request_id``'s relay writes its progress to (None when not journaled)."""
        running = self._running.get(request_id)
        return None if running is None else running.slot

    def is_running(self, request_id: str) -> bool:
        """True while ``request_id`` is admitted and its ending not yet kept (``end``)."""
        return request_id in self._running

    def track(self, request_id: str, counting: Counting) -> None:
        """Write ``counting``'s tokens so far to ``request_id``'s slot at every tick."""
        running = self._running.get(request_id)
        if running is not None:
            running.counting = counting

    def end(self, request_id: str) -> Slot | None:
        """``request_id`` ended: no longer running, and no longer tracked. Returns its slot, for
        its ending (``Slot.end``), which it keeps until ``finish``; None when it has none."""
        running = self._running.pop(request_id, None)
        if running is None:
            return None
        running.counting = None
        self._ended[request_id] = running
        return running.slot

    def finish(self, request_id: str) -> None:
        """The request's own record is durable: it needs the journal no more.

        The line goes out with the next admission or tick. Without it (lost with the process,
        or not writable) recovery finds the record in the spool, or billing keeps the first of two.
        """
        running = self._running.pop(request_id, None) or self._ended.pop(request_id, None)
        if running is not None:
            self._finished.append(finish_line(request_id))
            if running.slot is not None and self._slots is not None:
                self._slots.release(running.slot)
                self._released = True

    def _flush_finished(self) -> None:
        if self._finished:
            self._write(b"".join(self._finished))
            self._finished.clear()

    def interrupted_now(self) -> list[UsageRecord]:
        """Records of the requests still running, with their counts as of now (at shutdown), and
        of those ended whose records were not written (``record_of_pending``).

        A request whose admission line cannot be read back is left to ``recover`` at the next
        start, which reads the same files.
        """
        now = time.time()
        out = []
        try:
            lines = self._admission_lines()
        except OSError as exc:
            log.error(
                "admission journal in %s: %s; its running requests are recorded at the next start",
                self.directory,
                exc,
            )
            return []
        for request_id, line in lines.items():
            running = self._running.get(request_id) or self._ended[request_id]
            progress = None
            if running.slot is not None and self._slots is not None:
                if running.counting is not None:
                    running.slot.counts(running.counting.usage_so_far())
                progress = self._slots.progress(running.slot)
            record = record_of_pending(Pending(orjson.loads(line)["a"], progress=progress), now)
            if progress is None or progress.ending is None:
                record = dataclasses.replace(
                    record, usage_exact=progress is not None and progress.counted
                )
            out.append(record)
        return out

    def _admission_lines(self) -> dict[str, bytes]:
        """The admission lines of the running requests, read back from the open file.

        Each is where its offset says, and is checked to be its own admission line; one that
        is not (the file is not what this process wrote) is left out, with an error logged.
        The file is mapped, not read: only the lines looked at are copied out of the page cache.
        """
        assert self._path is not None
        found: dict[str, bytes] = {}
        if not self._running and not self._ended:
            return found
        with self._path.open("rb") as fh:
            empty = os.fstat(fh.fileno()).st_size == 0  # (mmap refuses an empty file)
            with (
                contextlib.nullcontext(b"")
                if empty
                else mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data
            ):
                for request_id, running in (*self._running.items(), *self._ended.items()):
                    at = running.at
                    end = data.find(b"\n", at)
                    line = data[at : end + 1]
                    if end < 0 or not line.startswith(b'%s%s"' % (_ADMISSION, request_id.encode())):
                        log.error(
                            "admission journal %s: request %s is not where it was written",
                            self._path,
                            request_id,
                        )
                        continue
                    found[request_id] = line
        return found

    # -- the files -------------------------------------------------------------------------------

    def _start_file(self) -> None:
        self._path = self.directory / f"journal-{time.time_ns():020d}.log"
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = 0

    def _write(self, data: bytes) -> None:
        """Append ``data`` whole, or leave the file as it was (OSError).

        A write that fails half-way (a full disk takes what fits in the file's last page) is
        cut off again: a torn line left in the file would join the next admission's line, and
        recovery, which skips a line it cannot read, would lose that request.
        """
        view = memoryview(data)
        began = self._size
        try:
            while view:
                written = os.write(self._fd, view)
                self._size += written
                view = view[written:]
        except OSError:
            if self._size != began:
                os.ftruncate(self._fd, began)  # (frees space: it does not fail for want of it)
                self._size = began
            raise
        self._unsynced = True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.mark_seconds)
            try:
                moved = self._tick(time.time())
                if self._unsynced:
                    self._unsynced = False
                    await asyncio.to_thread(os.fsync, self._fd)
                if moved and self._slots is not None:
                    # (fsync of the file writes back the pages the mapping dirtied.)
                    await asyncio.to_thread(os.fsync, self._slots.fd)
                if self._size > self.rotate_bytes:
                    await self._rotate()
            except OSError as exc:
                log.error("admission journal in %s: %s", self.directory, exc)

    def _tick(self, now: float) -> bool:
        """Write what waits for the tick; True when the slot file may have moved since the last."""
        self._flush_finished()
        released, self._released = self._released, False
        if not self._running or self._slots is None:
            return released
        for running in self._running.values():
            if running.counting is not None and running.slot is not None:
                running.slot.counts(running.counting.usage_so_far())
        self._slots.tick(now)
        return True

    async def _rotate(self) -> None:
        """Copy the running requests to a fresh file, make it durable, delete the old one."""
        lines = self._admission_lines()  # (an OSError here leaves the old file in use)
        old_fd, old_path = self._fd, self._path
        # Finish lines refer to the old file's admissions; the new one holds only running ones.
        self._finished.clear()
        self._start_file()
        offsets: list[tuple[_Running, int]] = []
        at = 0
        for request_id, line in lines.items():
            offsets.append((self._running.get(request_id) or self._ended[request_id], at))
            at += len(line)
        self._write(b"".join(lines.values()))
        for running, at in offsets:
            running.at = at
        self._unsynced = False
        await asyncio.to_thread(os.fsync, self._fd)
        os.close(old_fd)
        if old_path is not None:
            old_path.unlink(missing_ok=True)
