"""The admission journal: a trace of every admitted request, so that none ends without a record.

A request's usage record is made durable when the request ends (``infermeter.spool``). A sidecar
killed while it serves (SIGKILL, the OOM killer, a crash) never gets there, yet vLLM has already
spent GPU time on every request it forwarded. The journal closes that gap:

- ``admit``: before a request is forwarded, one line holding its record as it would read if the
  request ended right then (status ``interrupted``, no tokens) goes to the journal file with one
  ``write(2)``. From that moment it survives the death of the process: the bytes are the kernel's.
- Every ``mark_seconds`` a background task writes a progress mark for each running stream whose
  counts moved (vLLM's running usage and the first-token time, read from the stream's meter),
  then fsyncs the file once for everything written since the last time (group commit). Nothing
  happens per chunk: the marks read the meters the relay keeps anyway, so a killed stream is
  recorded with its counts as of at most ``mark_seconds`` before the kill, and a crash of the
  whole machine loses at most the last interval's lines.
- ``finish``: once the request's own record is in the spool, one line says so. It is not
  written at once but with the next admission or mark (one ``write(2)`` per request, not two):
  a line lost with the process only makes recovery look for the record in the spool, where it is
  (``infermeter.journal.recover`` skips spooled ids; billing keeps one record per id).

At start, ``infermeter.journal.recover`` turns what the previous process left into records (the
file format, and the rules of those records, are told there).

When a file passes ``rotate_bytes`` the requests still running are copied to a fresh one and the
old one is deleted.

Memory: a running request costs the journal a small slotted entry with where its admission
line is in the file, not a copy of its lines. The admission lines of the running requests are
read back from the file when they are needed (at a rotation, and at shutdown for
``interrupted_now``): the file holds every one of them, since a rotation copies them, and it
was just written, so the read comes from the page cache. Keeping each line in memory instead
cost every open stream about 700 bytes (its admission line and its last mark) for the whole of
its length. Found by their offsets, the lines of 1,000 running streams come out of a full file
in about a millisecond (``python -m bench.admission_journal``); searching the file for them
took 33-45 ms, a stall of the event loop at every rotation.
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

from infermeter.journal import (
    Pending,
    admission_line,
    finish_line,
    interrupted_record,
    mark_line,
)
from infermeter.records import UsageRecord
from sidecar.stream import UsageCounts

__all__ = ["AdmissionJournal", "JournalError", "Progress"]

log = logging.getLogger("infermeter.sidecar")


class JournalError(Exception):
    """An admission could not be written to the journal (disk full, read-only, ...)."""


class Progress(Protocol):
    """What the journal reads of a running request: ``sidecar.stream.StreamMeter`` has it."""

    token_events: int
    first_token_at: float | None

    @property
    def usage(self) -> UsageCounts | None:
        """The latest counts vLLM reported."""


# How every admission line begins (``admission_line``: the record's first field is its id).
_ADMISSION = b'{"a":{"request_id":"'


@dataclass(slots=True)
class _Running:
    """One admitted request in memory: its clock origin and progress (its lines are on disk)."""

    request_id: str
    received_at: float
    started: float
    # Where its admission line begins in the open file.
    at: int
    progress: Progress | None = None
    marked_events: int = -1


class AdmissionJournal:
    """The journal of one sidecar: ``admit``, ``track``, ``finish``, and marks in the background."""

    def __init__(self, directory: Path, mark_seconds: float, rotate_bytes: int = 8 << 20) -> None:
        self.directory = directory
        self.mark_seconds = mark_seconds
        self.rotate_bytes = rotate_bytes
        self._running: dict[str, _Running] = {}
        self._fd = -1
        self._path: Path | None = None
        self._size = 0
        self._unsynced = False
        self._task: asyncio.Task[None] | None = None
        # Finish lines waiting to go out with the next write.
        self._finished: list[bytes] = []

    @property
    def running(self) -> int:
        """Requests admitted and not yet finished."""
        return len(self._running)

    def open(self) -> list[Path]:
        """Start a fresh journal file and the marks; return the files an earlier process left."""
        self.directory.mkdir(parents=True, exist_ok=True)
        left = sorted(self.directory.glob("journal-*.log"))
        self._start_file()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return left

    async def close(self) -> None:
        """Stop the marks and close the file; it is deleted when no request is left running."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                self._flush_finished()
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            if not self._running and self._path is not None:
                self._path.unlink(missing_ok=True)

    def admit(self, record: Mapping[str, Any], started: float) -> None:
        """Journal ``record`` (``UsageRecord.to_json``'s form, its end unknown yet).

        JournalError when it cannot be written.
        """
        line = admission_line(record)
        try:
            if self._finished:
                data = b"".join((*self._finished, line))
                self._finished.clear()
            else:
                data = line
            at = self._size + len(data) - len(line)
            self._write(data)
        except OSError as exc:
            raise JournalError(f"cannot write the admission journal in {self.directory}: {exc.strerror or exc}") from None  # fmt: skip
        request_id: str = record["request_id"]
        self._running[request_id] = _Running(request_id, record["received_at"], started, at)

    def track(self, request_id: str, progress: Progress) -> None:
        """Mark ``request_id``'s counts from ``progress`` from now on."""
        running = self._running.get(request_id)
        if running is not None:
            running.progress = progress

    def finish(self, request_id: str) -> None:
        """The request's own record is durable: it needs the journal no more.

        The line goes out with the next admission or mark. Without it (lost with the process, or
        not writable) recovery finds the record in the spool, or billing keeps the first of two.
        """
        if self._running.pop(request_id, None) is not None:
            self._finished.append(finish_line(request_id))

    def _flush_finished(self) -> None:
        if self._finished:
            self._write(b"".join(self._finished))
            self._finished.clear()

    def interrupted_now(self) -> list[UsageRecord]:
        """Records of the requests still running, with their counts as of now (at shutdown).

        A request whose admission line cannot be read back is left to ``recover`` at the next
        start, which reads the same file.
        """
        now = time.time()
        out = []
        try:
            lines = self._admission_lines()
        except OSError as exc:
            log.error("admission journal in %s: %s; its running requests are recorded at the next start",
                      self.directory, exc)  # fmt: skip
            return []
        for request_id, line in lines.items():
            running = self._running[request_id]
            mark = self._latest_mark(running, now)
            pending = Pending(orjson.loads(line)["a"], orjson.loads(mark) if mark else None)
            record = interrupted_record(pending, now)
            exact = running.progress is not None and running.progress.usage is not None
            out.append(dataclasses.replace(record, usage_exact=exact))
        return out

    def _admission_lines(self) -> dict[str, bytes]:
        """The admission lines of the running requests, read back from the open file.

        Each is where its offset says, and is checked to be its own admission line; one that
        is not (the file is not what this process wrote) is left out, with an error logged.
        The file is mapped, not read: only the lines looked at are copied out of the page cache.
        """
        assert self._path is not None
        found: dict[str, bytes] = {}
        if not self._running:
            return found
        with self._path.open("rb") as fh:
            empty = os.fstat(fh.fileno()).st_size == 0  # (mmap refuses an empty file)
            with (
                contextlib.nullcontext(b"")
                if empty
                else mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data
            ):
                for request_id, running in self._running.items():
                    at = running.at
                    end = data.find(b"\n", at)
                    line = data[at : end + 1]
                    if end < 0 or not line.startswith(b'%s%s"' % (_ADMISSION, request_id.encode())):
                        log.error("admission journal %s: request %s is not where it was written",
                                  self._path, request_id)  # fmt: skip
                        continue
                    found[request_id] = line
        return found

    # -- the file --------------------------------------------------------------------------------

    def _start_file(self) -> None:
        self._path = self.directory / f"journal-{time.time_ns():020d}.log"
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = 0

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            # Counted as it is written, so that the offsets of later lines stay right after a
            # write that failed half-way.
            self._size += written
            view = view[written:]
        self._unsynced = True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.mark_seconds)
            try:
                self._mark_all(time.time())
                if self._unsynced:
                    self._unsynced = False
                    await asyncio.to_thread(os.fsync, self._fd)
                if self._size > self.rotate_bytes:
                    await self._rotate()
            except OSError as exc:
                log.error("admission journal in %s: %s", self.directory, exc)

    def _mark_all(self, now: float) -> None:
        lines = [self._mark_one(r, now) for r in self._running.values()]
        data = b"".join((*self._finished, *lines))
        self._finished.clear()
        if data:
            self._write(data)

    def _mark_one(self, running: _Running, now: float) -> bytes:
        """A new mark line for ``running`` if its counts moved since the last one, else b""."""
        progress = running.progress
        if progress is None or progress.token_events == running.marked_events:
            return b""
        running.marked_events = progress.token_events
        return self._latest_mark(running, now)

    @staticmethod
    def _latest_mark(running: _Running, now: float) -> bytes:
        """The mark line of ``running``'s counts as of ``now``, b"" before vLLM reported any."""
        progress = running.progress
        usage = None if progress is None else progress.usage
        if progress is None or usage is None:
            return b""
        first = progress.first_token_at
        first = None if first is None else running.received_at + (first - running.started)
        return mark_line(
            running.request_id, usage.prompt, usage.completion, usage.cached, first, now
        )

    async def _rotate(self) -> None:
        """Copy the running requests to a fresh file, make it durable, delete the old one."""
        lines = self._admission_lines()  # (an OSError here leaves the old file in use)
        now = time.time()
        old_fd, old_path = self._fd, self._path
        # Finish lines refer to the old file's admissions; the new one holds only running ones.
        self._finished.clear()
        self._start_file()
        parts: list[bytes] = []
        offsets: list[tuple[_Running, int]] = []
        at = 0
        for request_id, line in lines.items():
            running = self._running[request_id]
            offsets.append((running, at))
            mark = self._latest_mark(running, now)
            parts += (line, mark)
            at += len(line) + len(mark)
        self._write(b"".join(parts))
        for running, at in offsets:
            running.at = at
        self._unsynced = False
        await asyncio.to_thread(os.fsync, self._fd)
        os.close(old_fd)
        if old_path is not None:
            old_path.unlink(missing_ok=True)
