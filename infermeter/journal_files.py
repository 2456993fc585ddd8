"""The admission journal's files, and the records made of what a dead sidecar left in them.

The sidecar writes the journal (``sidecar.journal``, where the why is told; the progress slots
are written by ``sidecar.progress``); this module reads it, so that whoever finds a journal a
dead process left (the sidecar at its next start, or the node's collector adopting an orphaned
spool) turns it into the same records.

Two kinds of file in ``<spool dir>/journal/``, both named ``journal-<ns>``:

``journal-<ns>.log``, read in name order; one JSON object a line:

- ``{"a": <usage record>}``: a request admitted, its record as it would read if it ended there;
- ``{"f": id}``: the request's own record is durable in the spool;
- ``{"m": id, "p", "c", "k", "t", "at"}``: a progress mark (prompt, completion and cached tokens,
  first-token time, time of the mark), written by earlier versions only and still read.

A torn last line (the process died mid-write) is skipped.

``journal-<ns>.slots``, one per process: what each running request has relayed so far, and how
it ended once it has, in fixed-size slots of ``SLOT_BYTES`` (native byte order and sizes: the file
never leaves its node). Slot 0 is the header; a request holds one of the others from its admission
until its own record is durable in the spool:

=======  =====  ===============================================================================
offset   type   field
=======  =====  ===============================================================================
0        u8     1 while the slot belongs to a request, 0 when free
2        u8     1 once the client was sent a 200 head (a stream)
3        u8     length of the request id
4        u8     length of vLLM's response id (0: none yet)
8        f64    first-token time, on the writer's ``perf_counter`` (0: none yet)
16       i64    cached prompt tokens
24       f64    the request's clock: epoch seconds at ``perf_counter`` 0 (its received time
                less its ``perf_counter`` then), which makes the first-token time an epoch time
32       32 B   the request id (ASCII)
64       96 B   vLLM's response id (ASCII)
160      48 B   usage area 0: 47 bytes of a vLLM usage object from its first key on, as vLLM
                wrote them (zeros after a short one), then the area's sequence number (u8)
208      48 B   usage area 1, alike
256      u8     length of the ending's status (0: the request has not ended)
257      u8     1 when the ending's counts are exact (``usage_exact``)
258      u16    the ending's HTTP status
260      u8     length of the ending's finish reason (0: none)
264      f64    the end, on the writer's ``perf_counter``
272      16 B   the ending's status (``RequestStatus``, ASCII)
288      224 B  the ending's finish reason (ASCII, cut to 224 bytes)
=======  =====  ===============================================================================

The header: ``SLOTS_MAGIC`` at 0, then at 8 an f64, the epoch time of the writer's last
tick (it was alive then).

Files whose magic is ``SLOTS_MAGIC_V1`` (written before endings were kept) have 256-byte slots
and no ending; they are still read.

A usage area holds the start of vLLM's ``"usage":{...}`` object, copied, never parsed by the
writer: with vLLM's key order (``prompt_tokens``, ``total_tokens``, ``completion_tokens``) it
holds the prompt and total tokens whole up to 14 digits between them, and the completion tokens
are read, or else are the total less the prompt. A number cut by the area's end, not followed by
``,`` or ``}``, is not read. Usage goes to the two areas in turn, each written with a sequence
number one above the other's (modulo 256), the number last; the latest usage is in the area
whose number is one above the other's. A process killed mid-write leaves that area's old number,
so the other, whole, usage is the one read, never a torn one.

A request whose slot holds an ending had ended, its client had its whole answer, and its record
was waiting for the tick that writes the records of the requests that ended in it
(``sidecar.accounting``): it becomes that record again (``ended_record``: the ending, the final
counts and the response id of the slot, the rest from its admission line), the record the
sidecar would have written. Every other request admitted without an end becomes its
``interrupted`` record: the counts of its slot
(or of its last mark, in an earlier version's file), ending when the journal was last written or
ticked (the process was alive then). A request whose real record is still in the spool keeps
that record instead; billing keeps the first record of a request id, and the real one is always
spooled, and so shipped, before an interrupted one could be, so the real record wins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import mmap
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from infermeter.records import RequestStatus, UsageRecord
from infermeter.spool import Spool, SpoolError, read_segment

__all__ = [
    "JOURNAL_DIR",
    "SLOTS_MAGIC",
    "SLOT_BYTES",
    "Ending",
    "Pending",
    "Progress",
    "SlotLayout",
    "admission_line",
    "ended_record",
    "files_in",
    "finish_line",
    "interrupted_record",
    "journal_files",
    "read_slots",
    "record_of_pending",
    "recover",
    "slot_progress",
    "unfinished",
    "usage_counts",
]

log = logging.getLogger("infermeter.journal_files")

# The journal's folder inside a spool directory.
JOURNAL_DIR = "journal"
_USAGE_FIELDS = frozenset(f.name for f in dataclasses.fields(UsageRecord))
_STATUSES = frozenset(s.value for s in RequestStatus)

SLOT_BYTES: Final = 512
SLOTS_MAGIC: Final = b"IMSLOTS2"
# The files of earlier versions: 256-byte slots without an ending.
SLOTS_MAGIC_V1: Final = b"IMSLOTS1"
_SLOT_BYTES_V1: Final = 256


class SlotLayout:
    """Offsets and sizes within a slot (the table of the module docstring)."""

    STATE: Final = 0
    BEGAN: Final = 2
    ID_SIZE: Final = 3
    RESPONSE_SIZE: Final = 4
    FIRST_TOKEN: Final = 8
    CACHED: Final = 16
    CLOCK: Final = 24
    ID: Final = 32
    ID_BYTES: Final = 32
    RESPONSE: Final = 64
    RESPONSE_BYTES: Final = 96
    AREAS: Final = (160, 208)
    # The usage's part of an area; its last byte is its sequence number.
    AREA_BYTES: Final = 47
    # The header's tick time.
    ALIVE_AT: Final = 8
    # The ending: its status's length (0 while running) first, then the rest (``_ENDING``).
    ENDING: Final = 256
    STATUS_BYTES: Final = 16
    FINISH_BYTES: Final = 224


_TIMES = struct.Struct("@dqd")  # first-token time, cached, clock
# The ending: its status's length, exact, HTTP status, finish reason's length, end, status, reason.
ENDING_FORMAT: Final = f"@BBHBxxxd{SlotLayout.STATUS_BYTES}s{SlotLayout.FINISH_BYTES}s"
_ENDING = struct.Struct(ENDING_FORMAT)
assert SlotLayout.ENDING + _ENDING.size == SLOT_BYTES
_ALIVE = struct.Struct("@d")
_PROMPT = re.compile(rb'"prompt_tokens":(\d+)[,}]')
_TOTAL = re.compile(rb'"total_tokens":(\d+)[,}]')
_COMPLETION = re.compile(rb'"completion_tokens":(\d+)[,}]')


@dataclass(frozen=True, slots=True)
class Ending:
    """How a request ended, as its slot keeps it until its record is durable."""

    status: str
    http_status: int
    usage_exact: bool
    # Epoch seconds.
    finished_at: float
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Progress:
    """What a running request's slot held: the counts relayed so far and vLLM's response id."""

    prompt: int | None
    completion: int | None
    cached: int = 0
    first_token_at: float | None = None
    # The client was sent a 200 head (the stream had begun).
    began: bool = False
    response_id: str | None = None
    # How it ended, once it had (the client had its whole answer).
    ending: Ending | None = None

    @property
    def counted(self) -> bool:
        """True once vLLM had reported counts."""
        return self.prompt is not None or self.completion is not None


def read_slots(data: bytes) -> tuple[float | None, dict[str, Progress]]:
    """The header's tick time and the progress of each slot in use, by request id, of a
    ``.slots`` file's bytes. A slot that does not read as one (a file not written by this
    format) is left out."""
    if data.startswith(SLOTS_MAGIC):
        size, endings = SLOT_BYTES, True
    elif data.startswith(SLOTS_MAGIC_V1):
        size, endings = _SLOT_BYTES_V1, False
    else:
        return None, {}
    if len(data) < size:
        return None, {}
    (alive,) = _ALIVE.unpack_from(data, SlotLayout.ALIVE_AT)
    found: dict[str, Progress] = {}
    for at in range(size, len(data) - size + 1, size):
        progress = slot_progress(data, at, endings)
        if progress is not None:
            found[progress[0]] = progress[1]
    return (alive or None), found


def slot_progress(
    data: bytes | mmap.mmap, at: int, endings: bool = True
) -> tuple[str, Progress] | None:
    """The request id and progress of the slot at ``data[at]``; None when it is free or does not
    read as a slot. ``endings``: the slot has an ending's fields (``SLOTS_MAGIC``'s layout)."""
    lay = SlotLayout
    state, _, began, id_size, response_size = data[at : at + 5]
    if state != 1 or not 0 < id_size <= lay.ID_BYTES or response_size > lay.RESPONSE_BYTES:
        return None
    first, cached, clock = _TIMES.unpack_from(data, at + lay.FIRST_TOKEN)
    first_seq = data[at + lay.AREAS[0] + lay.AREA_BYTES]
    second_seq = data[at + lay.AREAS[1] + lay.AREA_BYTES]
    prompt = completion = None
    if (first_seq - second_seq) % 256 == 1 or (second_seq - first_seq) % 256 == 1:
        start = at + lay.AREAS[(second_seq - first_seq) % 256 == 1]
        prompt, completion = usage_counts(data[start : start + lay.AREA_BYTES])
    try:
        request_id = data[at + lay.ID : at + lay.ID + id_size].decode("ascii")
        response = data[at + lay.RESPONSE : at + lay.RESPONSE + response_size].decode("ascii")
        ending = _ending(data, at, clock) if endings else None
    except UnicodeDecodeError:
        return None
    return request_id, Progress(
        prompt=prompt,
        completion=completion,
        cached=max(cached, 0),
        first_token_at=clock + first if first else None,
        began=began == 1,
        response_id=response or None,
        ending=ending,
    )


def _ending(data: bytes | mmap.mmap, at: int, clock: float) -> Ending | None:
    """The slot's ending, when its status's length (written last) says it has one.

    UnicodeDecodeError when the bytes are not ASCII (not a slot of this format).
    """
    status_size, exact, http_status, finish_size, finished, status, finish = _ENDING.unpack_from(
        data, at + SlotLayout.ENDING
    )
    if not 0 < status_size <= SlotLayout.STATUS_BYTES:
        return None
    name = status[:status_size].decode("ascii")
    if finish_size > SlotLayout.FINISH_BYTES or name not in _STATUSES:
        return None
    return Ending(
        status=name,
        http_status=http_status,
        usage_exact=exact == 1,
        finished_at=clock + finished,
        finish_reason=finish[:finish_size].decode("ascii") if finish_size else None,
    )


def usage_counts(area: bytes) -> tuple[int | None, int | None]:
    """The prompt and completion tokens in the start of a usage object (None: not in it whole)."""
    prompt, total, completion = (_int(rx.search(area)) for rx in (_PROMPT, _TOTAL, _COMPLETION))
    if completion is None and prompt is not None and total is not None:
        completion = max(total - prompt, 0)
    return prompt, completion


def _int(found: re.Match[bytes] | None) -> int | None:
    return None if found is None else int(found[1])


def journal_files(spool_directory: Path) -> list[Path]:
    """The journal's files in a spool directory: its logs, oldest first, then its slot files."""
    return files_in(spool_directory / JOURNAL_DIR)


def files_in(directory: Path) -> list[Path]:
    """The journal's files in its own ``directory``: its logs, oldest first, then its slot files."""
    return sorted(directory.glob("journal-*.log")) + sorted(directory.glob("journal-*.slots"))


def admission_line(record: Mapping[str, Any]) -> bytes:
    """The line of an admitted request, from its record's JSON form (``UsageRecord.to_json``)."""
    return orjson.dumps({"a": record}) + b"\n"


def finish_line(request_id: str) -> bytes:
    """The line of a request whose own record is durable."""
    return orjson.dumps({"f": request_id}) + b"\n"


@dataclass(frozen=True)
class Pending:
    """An admitted request that the journal saw no end of: its record, its last mark (files of
    earlier versions) and its slot's progress."""

    record: dict[str, Any]
    mark: dict[str, Any] | None = None
    progress: Progress | None = None


def unfinished(lines: Iterable[bytes]) -> dict[str, Pending]:
    """The requests admitted and not finished in ``lines`` (files read in order); torn lines skipped."""
    pending: dict[str, Pending] = {}
    for line in lines:
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # the last line of a process killed mid-write
        if not isinstance(entry, dict):
            continue
        if "a" in entry:
            pending[entry["a"]["request_id"]] = Pending(entry["a"])
        elif "m" in entry and entry["m"] in pending:
            pending[entry["m"]] = dataclasses.replace(pending[entry["m"]], mark=entry)
        elif "f" in entry:
            pending.pop(entry["f"], None)
    return pending


def interrupted_record(pending: Pending, last_alive: float) -> UsageRecord:
    """The record of a request that was running when its sidecar died, at ``last_alive`` or later.

    Its counts are its slot's (what it had relayed: for a stream, vLLM's counts on the last
    chunk written to the client or about to be), or its last mark's, the larger of each; so
    ``usage_exact`` is false (vLLM may have spent more before it saw the connection close). Its
    HTTP status is 200 when the client had been sent a stream's head, else 502 (it got nothing).
    It keeps vLLM's response id when the slot has it.
    """
    base = UsageRecord.from_json({k: v for k, v in pending.record.items() if k in _USAGE_FIELDS})
    mark = pending.mark or {}
    got = pending.progress or Progress(None, None)
    prompt = max(mark.get("p", 0), got.prompt or 0)
    completion = max(mark.get("c", 0), got.completion or 0)
    cached = max(mark.get("k", 0), got.cached)
    first = got.first_token_at if got.first_token_at is not None else mark.get("t")
    began = got.began or (not pending.progress and (bool(completion) or first is not None))
    return dataclasses.replace(
        base,
        status=RequestStatus.INTERRUPTED.value,
        http_status=200 if began and base.stream else 502,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_prompt_tokens=cached,
        first_token_at=first,
        finished_at=max(base.received_at, last_alive, mark.get("at", 0.0), first or 0.0),
        finish_reason=None,
        usage_exact=False,
        response_id=got.response_id or base.response_id,
    )


def ended_record(pending: Pending, ending: Ending) -> UsageRecord:
    """The record of a request that had ended (its client had its whole answer) and whose record
    was waiting for its tick: the one the sidecar would have written.

    Its ending and response id are its slot's, its counts the slot's last (the final ones, written
    with the ending), and the rest its admission's.
    """
    base = UsageRecord.from_json({k: v for k, v in pending.record.items() if k in _USAGE_FIELDS})
    got = pending.progress or Progress(None, None)
    return dataclasses.replace(
        base,
        status=ending.status,
        http_status=ending.http_status,
        prompt_tokens=got.prompt or 0,
        completion_tokens=got.completion or 0,
        cached_prompt_tokens=got.cached,
        first_token_at=got.first_token_at,
        finished_at=ending.finished_at,
        finish_reason=ending.finish_reason,
        usage_exact=ending.usage_exact,
        response_id=got.response_id or base.response_id,
    )


def record_of_pending(pending: Pending, last_alive: float) -> UsageRecord:
    """The record of a request a dead process left in its journal: the record it was waiting
    to write when the request had ended, else its interrupted record."""
    ending = None if pending.progress is None else pending.progress.ending
    if ending is not None:
        return ended_record(pending, ending)
    return interrupted_record(pending, last_alive)


async def recover(paths: list[Path], spool: Spool) -> list[UsageRecord]:
    """Spool the records of journal files left by a dead process (``record_of_pending``), then
    delete the files.

    ``paths``: its ``.log`` and ``.slots`` files (``journal_files``). Returns the records made
    (for the caller's metrics). Idempotent: killed half-way, it makes the same records (same
    ids) again next time, and billing keeps one of each. When the spool refuses them (full,
    unwritable) the files are kept for the next start, and the sidecar starts all the same.
    """
    if not paths:
        return []
    logs = [p for p in paths if p.suffix == ".log"]
    pending = await asyncio.to_thread(_read_unfinished, logs)
    if pending:
        alive, progress = await asyncio.to_thread(
            _read_progress, [p for p in paths if p.suffix == ".slots"]
        )
        last_alive = max([alive, *(p.stat().st_mtime for p in logs)])
        spooled = await asyncio.to_thread(_spooled_ids, spool.directory)
        records = [
            record_of_pending(dataclasses.replace(p, progress=progress.get(rid)), last_alive)
            for rid, p in pending.items()
            if rid not in spooled
        ]
        try:
            await asyncio.gather(*(spool.append(r.to_json()) for r in records))
        except SpoolError as exc:
            # The files stay: the next start makes the same records (same ids) again.
            log.error("interrupted requests NOT recorded yet, journal kept: %s", exc)
            return []
        ended = sum(r.status != RequestStatus.INTERRUPTED.value for r in records)
        log.warning(
            "%d request(s) were running when the sidecar stopped, recorded as interrupted; "
            "%d had ended, recorded as they ended",
            len(records) - ended,
            ended,
        )
    else:
        records = []
    for path in paths:
        path.unlink(missing_ok=True)
    return records


def _read_unfinished(paths: list[Path]) -> dict[str, Pending]:
    def lines() -> Iterable[bytes]:
        for path in paths:
            with path.open("rb") as fh:
                yield from fh

    return unfinished(lines())


def _read_progress(paths: list[Path]) -> tuple[float, dict[str, Progress]]:
    """Every slot file's progress, and the latest tick time among them (0 without one)."""
    alive = 0.0
    found: dict[str, Progress] = {}
    for path in paths:
        tick, progress = read_slots(path.read_bytes())
        alive = max(alive, tick or 0.0)
        found |= progress
    return alive, found


def _spooled_ids(directory: Path) -> set[str]:
    return {
        r.get("request_id", "")
        for seg in directory.glob("seg-*.jsonl")
        for r in read_segment(seg)[0]
    }
