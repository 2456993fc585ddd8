"""Progress slots: what each running request has relayed, kept where a killed sidecar leaves it.

The admission journal (``sidecar.journal``) knows that a request runs; this module keeps how far
it has got, so that a sidecar killed mid-request (``kill -9``, the OOM killer) is followed by a
record billing at least what the client received. Each running request holds one fixed-size
slot of a file mapped ``MAP_SHARED`` (``journal-<ns>.slots``; the layout is
``infermeter.journal_files``'s). The relay writes it with plain memory stores, no system call:

- per block of chunks, before its bytes go to the client's transport: the start of vLLM's
  running usage object in its last chunk (``Slot.usage``, called by
  ``sidecar.stream.StreamMeter``), copied as it is, from a place the meter has already found,
  into the area not holding the latest usage, its sequence number last (one store of both): a
  process killed mid-copy leaves the previous usage the latest, never a torn one. With several
  choices the meter's sums are written instead (``Slot.counts``);
- once: the cached tokens (the first usage vLLM reports), the first-token time, vLLM's response
  id, and that the client was sent a stream's 200 head;
- a non-streamed request read from vLLM's stream (``sidecar.assemble``) gets its prompt tokens
  and response id from its first block (``Slot.opening``); its completion tokens are written
  by the journal's tick (``Slot.counts``), since the client receives nothing before the end;
- once, when the request ends and before the client sees the end of its answer: how it ended
  (``Slot.end``: status, HTTP status, finish reason, the time, the final counts), its status's
  length last, so that a process killed mid-way leaves a request still running, never half an
  ending. From then on the slot stands for the request's record until the tick writes it
  (``sidecar.accounting``): a process killed meanwhile leaves the ending, and the next start
  makes the record the sidecar would have written (``infermeter.journal_files.ended_record``).

The pages are the kernel's page cache: a process killed at any instruction leaves its last
stores in them, and the next start reads exact counts (``infermeter.journal_files.recover``). The
journal's tick fsyncs the file with its own, so a crash of the whole machine loses at most one
tick of progress. A request's slot is taken at its admission and given back at its end; a
``Slot`` given back writes into scratch memory from then on, so a late write can never land in
the slot of the request that takes it next.

Why this and not the journal's progress marks (a line per running stream every
``journal_mark_millis``): a mark lagged the kill by up to an interval, so a stream killed before
its first mark was recorded with no tokens though its client had its chunks. A line per chunk
would be a ``write(2)`` per chunk. Here a chunk costs one slice and one ``struct.pack_into``,
nothing parsed or searched: the usage's bytes are copied from where the meter found them, and
read as numbers only at recovery (``python -m bench.admission_journal``; figures in
docs/benchmarks.md). Finding the ``completion_tokens`` digits instead, to copy fewer bytes,
cost a search per chunk: about as much again.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path
from typing import Final

from infermeter.journal_files import (
    ENDING_FORMAT,
    SLOT_BYTES,
    SLOTS_MAGIC,
    Progress,
    SlotLayout,
    slot_progress,
)
from sidecar.request_ids import response_id
from sidecar.stream import UsageCounts, parse_usage

__all__ = ["Slot", "SlotTable"]

_USAGE_KEY: Final = b'"usage":{'
_USAGE_KEY_SIZE: Final = len(_USAGE_KEY)
_AREA_AT: Final = SlotLayout.AREAS
_AREA_BYTES: Final = SlotLayout.AREA_BYTES
_put_area = struct.Struct(f"{_AREA_BYTES}sB").pack_into  # the usage, then the sequence number
_put_int = struct.Struct("@q").pack_into
_put_float = struct.Struct("@d").pack_into
# A slot's first 64 bytes as ``take`` leaves them: free, no head sent, the id's length, no
# response id, no first token, no cached tokens, the clock, the id (``SlotLayout``).
_put_head = struct.Struct(f"@BxBBBxxxdqd{SlotLayout.ID_BYTES}s").pack_into
assert struct.calcsize(f"@BxBBBxxxdqd{SlotLayout.ID_BYTES}s") == SlotLayout.RESPONSE
_put_response = struct.Struct(f"{SlotLayout.RESPONSE_BYTES}s").pack_into
_put_ending = struct.Struct(ENDING_FORMAT).pack_into
_NOTHING = UsageCounts(0, 0)


class Slot:
    """One running request's slot: what its relay writes, chunk by chunk."""

    __slots__ = ("_at", "_mm", "_written", "counted")

    def __init__(self, mm: mmap.mmap | bytearray, at: int) -> None:
        self._mm = mm
        self._at = at
        # Usages written: the next goes to area ``(_written + 1) % 2`` with that sequence number.
        self._written = 0
        # The cached tokens are kept (the first usage was seen, parsed).
        self.counted = False

    def usage(self, data: bytes, usage_at: int) -> None:
        """Keep the usage object whose ``"usage":{`` key is at ``data[usage_at]`` (per block).

        Its bytes are copied, not parsed: recovery reads them.
        """
        start = usage_at + _USAGE_KEY_SIZE
        n = self._written = self._written + 1
        _put_area(self._mm, self._at + _AREA_AT[n & 1], data[start : start + _AREA_BYTES], n & 255)

    def counts(self, usage: UsageCounts | None) -> None:
        """Keep counts already read: a stream's first usage (its cached tokens), the sums of
        several choices, or an assembled request's tokens so far."""
        if usage is None:
            return
        _put_int(self._mm, self._at + SlotLayout.CACHED, usage.cached)
        # In vLLM's own form, so that recovery reads both kinds alike.
        written = b'"prompt_tokens":%d,"total_tokens":%d,' % (
            usage.prompt,
            usage.prompt + usage.completion,
        )
        n = self._written = self._written + 1
        _put_area(self._mm, self._at + _AREA_AT[n & 1], written, n & 255)
        self.counted = True

    def first_token(self, now: float) -> None:
        """The first token arrived at ``now`` (``perf_counter``)."""
        _put_float(self._mm, self._at + SlotLayout.FIRST_TOKEN, now)

    def response_id(self, value: str | None) -> None:
        """vLLM's id for the response. One longer than the slot holds (96 bytes) is not kept:
        vLLM's own are 25-41 characters, and a longer one is vLLM's prefix on the caller's own
        ``x-request-id``, which the record keeps (``client_request_id``)."""
        raw = (value or "").encode("ascii", "replace")
        if raw and len(raw) <= SlotLayout.RESPONSE_BYTES:
            _put_response(self._mm, self._at + SlotLayout.RESPONSE, raw)
            # The length last: a process killed before it leaves no id, not half of one.
            self._mm[self._at + SlotLayout.RESPONSE_SIZE] = len(raw)

    def end(
        self,
        status: str,
        http_status: int,
        usage: UsageCounts | None,
        exact: bool,
        first_token: float | None,
        finished: float,
        finish_reason: str | None,
        response: str | None,
    ) -> None:
        """The request ended at ``finished`` (``perf_counter``) like this: everything its record
        says of its end, the final counts (none: zeros) and first-token time included.

        The status's length is stored last: until then the slot reads as a running request.
        """
        self.counts(usage or _NOTHING)
        self.first_token(first_token or 0.0)
        self.response_id(response)
        raw_status = status.encode("ascii")
        raw_finish = (finish_reason or "").encode("ascii", "replace")[: SlotLayout.FINISH_BYTES]
        at = self._at + SlotLayout.ENDING
        _put_ending(
            self._mm, at, 0, exact, http_status, len(raw_finish), finished, raw_status, raw_finish
        )
        self._mm[at] = len(raw_status)

    def began(self) -> None:
        """The client is sent a stream's 200 head (next)."""
        self._mm[self._at + SlotLayout.BEGAN] = 1

    def opening(self, block: bytes) -> bool:
        """Keep the prompt tokens and response id of the first events of vLLM's stream, read
        for a non-streamed request; True once kept (the caller stops calling), False while the
        block holds no whole usage object yet."""
        at = block.find(_USAGE_KEY)
        if at < 0 or block.find(b"}", at) < 0:
            return False
        usage = parse_usage(block[at : at + 400])
        if usage is None:
            return False
        self.response_id(response_id(block))
        self.counts(usage)
        return True

    def _detach(self, scratch: bytearray) -> int:
        """Write into ``scratch`` from now on; the offset the slot had."""
        at, self._mm, self._at = self._at, scratch, 0
        return at


# Disk space for the slot file is allocated this much at a time: 128 slots, one system call.
_ALLOCATE_BYTES: Final = 64 << 10


class SlotTable:
    """The slot file of one process: a ``MAP_SHARED`` mapping of ``SLOT_BYTES`` slots.

    It starts with ``slots`` slots (the file is sparse: only slots used take memory and disk)
    and doubles when all are taken. Slots are reused lowest first, so the pages touched stay
    as few as the requests running at once need.

    A slot's disk space is allocated (``posix_fallocate``) before the slot is handed out, the
    first time the slots reach it: a store into a hole of a shared mapping that the file system
    has no room for is a SIGBUS, which kills the process (every stream it relays), where a full
    disk must be an OSError that refuses the one request (``AdmissionJournal.admit``).
    """

    def __init__(self, path: Path, slots: int = 1024) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        # Bytes from the start of the file that are allocated on disk (``_allocate``).
        self._allocated = 0
        try:
            os.ftruncate(self._fd, slots * SLOT_BYTES)
            self._allocate(SLOT_BYTES)  # (the magic's slot)
            self._mm = mmap.mmap(self._fd, slots * SLOT_BYTES)
        except OSError:
            os.close(self._fd)
            raise
        self._mm[: len(SLOTS_MAGIC)] = SLOTS_MAGIC
        self._free = list(range(slots - 1, 0, -1))
        self._scratch = bytearray(SLOT_BYTES)

    @property
    def fd(self) -> int:
        """The file's descriptor, to fsync (which also writes back the mapping's pages)."""
        return self._fd

    def take(self, request_id: str, clock: float) -> Slot | None:
        """A slot for ``request_id`` (None for an id longer than a slot holds).

        ``clock``: the request's received time less its ``perf_counter`` then. OSError when
        the file cannot grow.
        """
        raw = request_id.encode("ascii", "replace")
        if len(raw) > SlotLayout.ID_BYTES:
            return None
        if not self._free:
            self._grow()
        at = self._free[-1] * SLOT_BYTES
        if at + SLOT_BYTES > self._allocated:
            self._allocate(at + SLOT_BYTES)  # (OSError: the slot stays free)
        self._free.pop()
        mm = self._mm
        # (State 0, as a free slot is: not a request's until the last store.)
        _put_head(mm, at, 0, 0, len(raw), 0, 0.0, 0, clock, raw)
        for area in _AREA_AT:  # equal sequence numbers: no usage yet, whatever the areas hold
            mm[at + area + _AREA_BYTES] = 0
        mm[at + SlotLayout.ENDING] = 0  # not ended
        mm[at + SlotLayout.STATE] = 1
        return Slot(mm, at)

    def release(self, slot: Slot) -> None:
        """The request ended: its slot is free, and ``slot`` writes nowhere from now on."""
        at = slot._detach(self._scratch)
        if at:
            self._mm[at + SlotLayout.STATE] = 0
            self._free.append(at // SLOT_BYTES)

    def progress(self, slot: Slot) -> Progress | None:
        """What ``slot`` holds now (None once released)."""
        if slot._mm is not self._mm:
            return None
        found = slot_progress(self._mm, slot._at)
        return None if found is None else found[1]

    def tick(self, now: float) -> None:
        """Stamp the header with ``now`` (epoch seconds): the process was alive then."""
        _put_float(self._mm, SlotLayout.ALIVE_AT, now)

    def close(self, delete: bool) -> None:
        """Unmap and close the file; delete it when ``delete``."""
        with contextlib.suppress(BufferError):
            self._mm.close()
        os.close(self._fd)
        if delete:
            self.path.unlink(missing_ok=True)

    def _allocate(self, end: int) -> None:
        """Allocate the file's disk space up to ``end``, a chunk of slots at a time; OSError
        (ENOSPC) when the file system has no room for it."""
        end = min(-(-end // _ALLOCATE_BYTES) * _ALLOCATE_BYTES, os.fstat(self._fd).st_size)
        os.posix_fallocate(self._fd, self._allocated, end - self._allocated)
        self._allocated = end

    def _grow(self) -> None:
        size = len(self._mm)
        self._mm.resize(size * 2)
        self._free = list(range(size * 2 // SLOT_BYTES - 1, size // SLOT_BYTES - 1, -1))
