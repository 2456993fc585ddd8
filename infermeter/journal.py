"""The admission journal's file format, and the records made of what a dead sidecar left in it.

The sidecar writes the journal (``sidecar.journal``, where the why is told); this module reads it,
so that whoever finds a journal a dead process left (the sidecar at its next start, or the node's
collector adopting an orphaned spool) turns it into the same records.

Files: ``<spool dir>/journal/journal-<ns>.log``, read in name order; one JSON object a line:

- ``{"a": <usage record>}``: a request admitted, its record as it would read if it ended there;
- ``{"m": id, "p", "c", "k", "t", "at"}``: a progress mark (prompt, completion and cached tokens,
  first-token time, time of the mark);
- ``{"f": id}``: the request's own record is durable in the spool.

A torn last line (the process died mid-write) is skipped.

Each request admitted without an end becomes its ``interrupted`` record: the counts of its last
mark, ending when the journal was last written (the process was alive then). A request whose real
record is still in the spool keeps that record instead; billing keeps the first record of a
request id, and the real one is always spooled, and so shipped, before an interrupted one could
be, so the real record wins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from infermeter.records import RequestStatus, UsageRecord
from infermeter.spool import Spool, SpoolError, read_segment

__all__ = [
    "JOURNAL_DIR",
    "Pending",
    "admission_line",
    "finish_line",
    "interrupted_record",
    "journal_files",
    "mark_line",
    "recover",
    "unfinished",
]

log = logging.getLogger("infermeter.journal")

# The journal's folder inside a spool directory.
JOURNAL_DIR = "journal"
_USAGE_FIELDS = frozenset(f.name for f in dataclasses.fields(UsageRecord))


def journal_files(spool_directory: Path) -> list[Path]:
    """The journal files in a spool directory, oldest first."""
    return sorted((spool_directory / JOURNAL_DIR).glob("journal-*.log"))


def admission_line(record: Mapping[str, Any]) -> bytes:
    """The line of an admitted request, from its record's JSON form (``UsageRecord.to_json``)."""
    return orjson.dumps({"a": record}) + b"\n"


def mark_line(request_id: str, prompt: int, completion: int, cached: int,
              first_token_at: float | None, at: float) -> bytes:  # fmt: skip
    """The line of a progress mark."""
    return orjson.dumps({"m": request_id, "p": prompt, "c": completion, "k": cached,
                         "t": first_token_at, "at": at}) + b"\n"  # fmt: skip


def finish_line(request_id: str) -> bytes:
    """The line of a request whose own record is durable."""
    return orjson.dumps({"f": request_id}) + b"\n"


@dataclass(frozen=True)
class Pending:
    """An admitted request that the journal saw no end of: its record and its last mark."""

    record: dict[str, Any]
    mark: dict[str, Any] | None = None


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

    Its counts are those of its last mark, so ``usage_exact`` is false; its HTTP status is 200 when
    a mark shows the stream had begun (the client had its headers), else 502 (it got nothing).
    """
    base = UsageRecord.from_json({k: v for k, v in pending.record.items() if k in _USAGE_FIELDS})
    mark = pending.mark or {}
    began = bool(mark.get("c")) or mark.get("t") is not None
    return dataclasses.replace(
        base, status=RequestStatus.INTERRUPTED.value, http_status=200 if began and base.stream else 502,
        prompt_tokens=mark.get("p", 0), completion_tokens=mark.get("c", 0), cached_prompt_tokens=mark.get("k", 0),
        first_token_at=mark.get("t"), finished_at=max(base.received_at, last_alive, mark.get("at", 0.0)),
        finish_reason=None, usage_exact=False,
    )  # fmt: skip


async def recover(paths: list[Path], spool: Spool) -> list[UsageRecord]:
    """Spool the interrupted records of journal files left by a dead process, then delete them.

    Returns the records made (for the caller's metrics). Idempotent: killed half-way, it makes the same records
    (same ids) again next time, and billing keeps one of each. When the spool refuses them (full,
    unwritable) the files are kept for the next start, and the sidecar starts all the same.
    """
    if not paths:
        return []
    pending = await asyncio.to_thread(_read_unfinished, paths)
    if pending:
        last_alive = max(p.stat().st_mtime for p in paths)
        spooled = await asyncio.to_thread(_spooled_ids, spool.directory)
        records = [
            interrupted_record(p, last_alive) for rid, p in pending.items() if rid not in spooled
        ]
        try:
            await asyncio.gather(*(spool.append(r.to_json()) for r in records))
        except SpoolError as exc:
            # The files stay: the next start makes the same records (same ids) again.
            log.error("interrupted requests NOT recorded yet, journal kept: %s", exc)
            return []
        log.warning("%d request(s) were running when the sidecar stopped; recorded as interrupted",
                    len(records))  # fmt: skip
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


def _spooled_ids(directory: Path) -> set[str]:
    return {r.get("request_id", "") for seg in directory.glob("seg-*.jsonl") for r in read_segment(seg)[0]}  # fmt: skip
