"""A local, append-only, group-committed spool of records on their way to billing.

Two ways in, one file:

- ``append``: the record is durable when it returns: written and fsync'ed. Appends that arrive
  while an fsync is in progress share the next one (group commit), so a thousand concurrent
  requests cost a few fsyncs, not a thousand.
- ``append_many``: ``append`` for a batch: their lines go to the file with one ``write(2)``,
  and the batch waits for one fsync, shared like an ``append``'s. The sidecar writes the records
  of the requests that ended in one tick this way (``sidecar.accounting``).
- ``write``: the record is written when it returns, into the kernel's page cache, where a
  process killed at any instruction after it leaves it (``kill -9``, the OOM killer); it is
  fsync'ed with the others written in the same ``sync_seconds`` (one fsync per tick, however many
  records), and then its ``durable`` callback runs. A crash of the whole machine may lose the
  records of the last tick. The sidecar writes the record of a request the admission journal
  does not keep this way (``sidecar.accounting``).

The ``write(2)`` of a record runs on the caller's thread, the event loop: a write into the page
cache takes microseconds, where handing it to a thread and back cost tens of microseconds and two
context switches per batch. The fsync, which waits on the device, runs in the spool's own thread
(``infermeter.disk_thread``), so the event loop keeps relaying tokens meanwhile.

With ``commit_delay_seconds`` and a ``siblings`` count (the appends still to come), an fsync an
``append`` waits for is held back for at most that delay while more of them are still to come,
as PostgreSQL's ``commit_delay`` does when ``commit_siblings`` transactions are open. A lone
append is never held back, and no ``append`` returns before its fsync.

Layout: ``<dir>/seg-<n>.jsonl`` segment files, one JSON record per line. The newest segment is
open for writes; older ones are closed and handed to the shipper, which deletes a segment only
once billing has acknowledged every record in it. A process that dies mid-write can leave a torn
last line: it is reported by ``read_segment`` and skipped (its request is still in the admission
journal, which is finished only once the record is fsync'ed).

Seals: with a ``sealer`` (``infermeter.writers.Sealer``), each line carries the writer's seal as its
last key, one HMAC per record computed as it is written, so a line changed or written on disk by
anyone without the writer's key is refused by billing. ``read_segment`` gives the records without
it.

Kept after the acknowledgement: with ``keep_acked_seconds``, an acknowledged segment is renamed
``acked-<n>.jsonl`` instead of deleted, and deleted once that much older; a ``reship`` file in
the directory (``request_reship``, ``infermeter spool reship``) puts them back in line to be
shipped. After billing's ledger is restored to a backup, the records it had acknowledged since
are shipped again, and those it still has are dropped as repeats by their ids. The kept
segments are not counted in ``max_bytes``.

Size: with ``max_bytes`` set, the records not yet acknowledged never take more than that; a record
that would pass it fails with ``SpoolError`` at once, like a full disk, and the caller's failure
policy applies. Space comes back as billing acknowledges segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from infermeter.disk_thread import DiskThread

__all__ = [
    "RESHIP",
    "Segment",
    "SegmentReader",
    "Spool",
    "SpoolError",
    "read_segment",
    "request_reship",
]

# The file that asks a spool's owner to ship its kept acknowledged segments again.
RESHIP = "reship"

log = logging.getLogger("infermeter.spool")


class SpoolError(Exception):
    """A record could not be written, or made durable (disk full, read-only, ...)."""


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


class Spool:
    """Writer of one spool directory: records written at once, fsync'ed together."""

    def __init__(
        self,
        directory: Path,
        roll_seconds: float = 2.0,
        roll_records: int = 50_000,
        max_bytes: int | None = None,
        commit_delay_seconds: float = 0.0,
        sealer: Callable[[bytes], bytes] | None = None,
        sync_seconds: float = 0.0,
        keep_acked_seconds: float = 0.0,
    ) -> None:
        self.directory = directory
        # How long an acknowledged segment is kept to be shipped again (0: deleted at once).
        self.keep_acked_seconds = keep_acked_seconds
        # The writer's seal on each line (``infermeter.writers.Sealer``); None writes them bare.
        self.sealer = sealer
        self.commit_delay_seconds = commit_delay_seconds
        # How long a record from ``write`` may wait for its fsync (0: as soon as possible).
        self.sync_seconds = sync_seconds
        # How many appends are still to come (see ``expect``); none known by default.
        self._siblings: Callable[[], int] | None = None
        self.max_bytes = max_bytes
        # Bytes of records not yet acknowledged: closed and open segments.
        self.size_bytes = 0
        self._current_bytes = 0
        self.roll_seconds = roll_seconds
        self.roll_records = roll_records
        self._fh: IO[bytes] | None = None
        self._current: Path | None = None
        self._current_records = 0
        self._opened_at = 0.0
        self._closed: list[Segment] = []
        # Files rolled since their last fsync: closed once fsync'ed, never while the disk thread
        # may hold them.
        self._retired: list[IO[bytes]] = []
        # Something was written since the last fsync began.
        self._dirty = False
        # What waits for the next fsync: appends, and the ``durable`` callbacks of writes.
        self._waiters: list[asyncio.Future[None]] = []
        self._callbacks: list[Callable[[], None]] = []
        # An append waits: no tick to wait for.
        self._urgent = False
        # The syncer waits for anything written (``_idle``), or for its tick (``_ticking``).
        self._idle: asyncio.Future[None] | None = None
        self._ticking: asyncio.Future[None] | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._disk = DiskThread(f"spool {directory.name}")
        self.backlog = 0
        # ``write(2)`` batches begun and fsync rounds begun since the spool was made (tests, benches).
        self.write_calls = 0
        self.sync_calls = 0

    def open(self) -> None:
        """Create the directory, adopt segments left by an earlier run, start the syncer."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._unacknowledge()
        for path in sorted(self.directory.glob("seg-*.jsonl")):
            records, _ = read_segment(path)
            size = path.stat().st_size
            self._closed.append(Segment(path, len(records), size))
            self.backlog += len(records)
            self.size_bytes += size
        self._lock = asyncio.Lock()
        self._task = asyncio.get_running_loop().create_task(self._syncer())

    def expect(self, siblings: Callable[[], int]) -> None:
        """Count on ``siblings()`` appends to come (waiting ones included) when deciding to wait."""
        self._siblings = siblings

    async def close(self) -> None:
        """Make everything written durable, stop the syncer and close the open segment."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            with contextlib.suppress(SpoolError):
                await self._sync_now()
            self._disk.stop()
        self._roll()
        for fh in self._retired:
            with contextlib.suppress(OSError):
                fh.close()
        self._retired = []

    async def append(self, record: dict[str, Any]) -> None:
        """Return once ``record`` is on disk (written and fsync'ed); SpoolError if it cannot be."""
        self._put(record)
        await self._synced()

    async def append_many(self, records: Sequence[dict[str, Any]]) -> None:
        """Return once all of ``records`` are on disk: written with one ``write(2)``, then one
        fsync (shared with whatever else waits for it). SpoolError if they cannot be; then some
        of them may be in the file already (billing keeps one record per id)."""
        await self.append_lines([self.line(r) for r in records])

    async def append_lines(self, lines: list[bytes]) -> None:
        """``append_many`` for lines already made (``line``)."""
        if not lines:
            return
        self._put_lines(lines)
        await self._synced()

    async def _synced(self) -> None:
        """Return once what is written so far is fsync'ed: the syncer is woken at once."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        self._urgent = True
        _wake(self._idle)
        _wake(self._ticking)
        await future

    def write(self, record: dict[str, Any], durable: Callable[[], None] | None = None) -> None:
        """Write ``record`` now: a process killed after this call keeps it. ``durable()`` runs
        once it is fsync'ed too, within ``sync_seconds``. SpoolError if it cannot be written."""
        self.write_many([record], durable)

    def write_many(
        self, records: Sequence[dict[str, Any]], durable: Callable[[], None] | None = None
    ) -> None:
        """``write`` for a batch, with one ``write(2)``."""
        self._put_lines([self.line(r) for r in records])
        if durable is not None:
            self._callbacks.append(durable)
        _wake(self._idle)

    async def sync(self) -> None:
        """Fsync what was written so far now, and run its ``durable`` callbacks."""
        await self._sync_now()

    def _put(self, record: dict[str, Any]) -> None:
        """Write one record's line to the open segment (one ``write(2)``, on this thread)."""
        self._put_lines([self.line(record)])

    def line(self, record: dict[str, Any]) -> bytes:
        """``record``'s line as this spool writes it: JSON, sealed when it seals, a newline."""
        line = orjson.dumps(record)
        if self.sealer is not None:
            line = self.sealer(line)
        return line + b"\n"

    def _put_lines(self, lines: list[bytes]) -> None:
        """Write ``lines`` to the open segment at once (one ``write(2)``, on this thread); a
        batch is not split between segments."""
        assert self._task is not None, "Spool.open() first"
        data = lines[0] if len(lines) == 1 else b"".join(lines)
        if self.max_bytes is not None and self.size_bytes + len(data) > self.max_bytes:
            raise SpoolError(
                f"usage spool in {self.directory} is full ({self.size_bytes} of {self.max_bytes} bytes)"
            )
        try:
            if self._fh is None:
                self._start_segment()
            assert self._fh is not None
            self.write_calls += 1
            _write_all(self._fh, data)
        except OSError as exc:
            error = SpoolError(
                f"cannot write usage spool in {self.directory}: {exc.strerror or exc}"
            )
            log.error("%s", error)
            self._abandon_current()
            raise error from None
        self._dirty = True
        self.size_bytes += len(data)
        self._current_records += len(lines)
        self._current_bytes += len(data)
        self.backlog += len(lines)
        if self._current_records >= self.roll_records:
            self._roll()

    async def _syncer(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._dirty:
                self._idle = loop.create_future()
                try:
                    await self._idle
                finally:
                    self._idle = None
                continue
            if not self._urgent and self.sync_seconds > 0:
                # Only writes wait: one fsync per tick, unless an append comes to wait meanwhile.
                # (Writes do not wake the syncer here: a wake-up per record is what is saved.)
                self._ticking = tick = loop.create_future()
                timer = loop.call_later(self.sync_seconds, _wake, tick)
                try:
                    await tick
                finally:
                    timer.cancel()
                    self._ticking = None
            if self._worth_waiting():
                await asyncio.sleep(self.commit_delay_seconds)
            with contextlib.suppress(SpoolError):  # (told to the waiters, and logged)
                await self._sync_now()

    def _worth_waiting(self) -> bool:
        """More appends are expected than wait, and a delay is allowed."""
        if self._siblings is None or self.commit_delay_seconds <= 0:
            return False
        return self._siblings() > len(self._waiters)

    async def _sync_now(self) -> None:
        """Fsync every file written since its last fsync; then tell who waited for it."""
        async with self._lock:  # the shipper rolls segments under the same lock
            waiters, self._waiters = self._waiters, []
            callbacks, self._callbacks = self._callbacks, []
            self._urgent = self._dirty = False
            # Rolled files are closed once fsync'ed; one rolled during the fsync waits for the next.
            retired = list(self._retired)
            files = retired if self._fh is None else [*retired, self._fh]
            try:
                if files:
                    self.sync_calls += 1
                    await self._disk.run(functools.partial(self._sync_files, files))
            except OSError as exc:
                error = SpoolError(
                    f"cannot sync usage spool in {self.directory}: {exc.strerror or exc}"
                )
                log.error(
                    "%s; %d record(s) may not be durable", error, len(waiters) + len(callbacks)
                )
                self._abandon_current()
                for future in waiters:
                    if not future.done():
                        future.set_exception(error)
                raise error from None
            finally:
                for fh in retired:
                    with contextlib.suppress(OSError):
                        fh.close()
                self._retired = [fh for fh in self._retired if fh not in retired]
        for future in waiters:
            if not future.done():
                future.set_result(None)
        for callback in callbacks:
            callback()

    def _sync_files(self, files: list[IO[bytes]]) -> None:
        """Fsync ``files`` (in the disk thread)."""
        for fh in files:
            os.fsync(fh.fileno())

    def _start_segment(self) -> None:
        stamp = time.time_ns()
        self._current = self.directory / f"seg-{stamp:020d}.jsonl"
        self._fh = self._current.open("ab", buffering=0)
        self._current_records = 0
        self._current_bytes = 0
        self._opened_at = time.monotonic()

    def _retire(self) -> None:
        """Hand the open file to the syncer, which fsyncs and closes it (never closed here:
        the disk thread may be fsyncing it)."""
        if self._fh is not None:
            self._retired.append(self._fh)
            self._dirty = True
        self._fh = None

    def _abandon_current(self) -> None:
        """After a failed write the open file's tail is unknown: close it and start afresh."""
        if self._current is not None and self._current_records:
            self._closed.append(Segment(self._current, self._current_records, self._current_bytes))
        self._retire()
        self._current, self._current_records = None, 0

    def _roll(self) -> None:
        if self._fh is None or self._current is None:
            return
        if self._current_records:
            self._closed.append(Segment(self._current, self._current_records, self._current_bytes))
        else:
            self._current.unlink(missing_ok=True)
        self._retire()
        self._current, self._current_records = None, 0

    async def seal(self) -> None:
        """Close the open segment now, so that every record written so far can be shipped."""
        async with self._lock:
            self._roll()

    async def closed_segments(self) -> list[Segment]:
        """Segments ready to ship, oldest first; rolls the open one when it is old enough."""
        async with self._lock:
            if self._fh is not None and time.monotonic() - self._opened_at >= self.roll_seconds:
                self._roll()
            if self.keep_acked_seconds:
                self._readopt()
            return list(self._closed)

    def acknowledge(self, segment: Segment) -> None:
        """Billing has every record of ``segment``: delete it, or keep it as acknowledged."""
        if self.keep_acked_seconds:
            kept = segment.path.with_name("acked-" + segment.path.name.removeprefix("seg-"))
            with contextlib.suppress(FileNotFoundError):
                os.replace(segment.path, kept)
                os.utime(kept)  # its age counts from the acknowledgement
            self._prune_acked()
        else:
            segment.path.unlink(missing_ok=True)
        self._closed.remove(segment)
        self.backlog -= segment.records
        self.size_bytes -= segment.size_bytes

    def _prune_acked(self) -> None:
        before = time.time() - self.keep_acked_seconds
        for path in self.directory.glob("acked-*.jsonl"):
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < before:
                    path.unlink()

    def _unacknowledge(self) -> list[Path]:
        """If asked (a ``RESHIP`` file), put every kept acknowledged segment back in line."""
        marker = self.directory / RESHIP
        if not marker.exists():
            return []
        back = []
        for path in sorted(self.directory.glob("acked-*.jsonl")):
            fresh = path.with_name("seg-" + path.name.removeprefix("acked-"))
            os.replace(path, fresh)
            back.append(fresh)
        marker.unlink(missing_ok=True)
        if back:
            log.info("spool %s: %d acknowledged segments to ship again", self.directory, len(back))
        return back

    def _readopt(self) -> None:
        """Ship again what ``_unacknowledge`` put back (a stat per round while nothing is asked)."""
        back = self._unacknowledge()
        for path in back:
            records, _ = read_segment(path)
            size = path.stat().st_size
            self._closed.append(Segment(path, len(records), size))
            self.backlog += len(records)
            self.size_bytes += size
        if back:
            self._closed.sort(key=lambda segment: segment.path.name)


def request_reship(root: Path) -> list[Path]:
    """Ask every spool under ``root`` that keeps acknowledged segments to ship them again.

    Writes a ``RESHIP`` file beside them; the spool's owner acts on it at its next shipping
    round (or when it starts). Returns the directories asked.
    """
    asked = sorted({p.parent for p in root.rglob("acked-*.jsonl")})
    for directory in asked:
        (directory / RESHIP).touch()
    return asked


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _write_all(fh: IO[bytes], data: bytes) -> None:
    """Write all of ``data`` (an unbuffered file may take part of it per call)."""
    view = memoryview(data)
    while view:
        written = fh.write(view)
        if written is None:  # (a non-blocking file; a spool's never is)
            raise BlockingIOError("the spool file would block")
        view = view[written:]
    fh.flush()
