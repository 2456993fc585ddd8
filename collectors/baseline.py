"""Each GPU's last reading, kept on disk, so a restarted collector bills the time it was away.

A GPU sample covers the interval since the board's previous reading. A collector that starts
with no previous reading can only set a baseline, so every second it was down (a rollout of
the DaemonSet, an eviction, a crash) would be missing from the fleet's measured cost, although
the GPUs were held and drew power all along. The board's energy counter runs on regardless, so
with the last reading kept, the first interval after a restart is measured exactly like any
other: its energy is the counter's increase, its time the gap between the readings (a gap
longer than the collector's gap limit is a gap sample, as always: its time counted, its energy
unknown).

The file is written after each round's samples are in the spool, whole or not at all
(``infermeter.atomic``). A crash between the two writes, milliseconds apart, makes the next
start measure that one interval again. Times in the file are wall time: the loop measures on
the monotonic clock, but that one starts afresh with each process (``shifted`` moves the
readings between the two). A reading older than ``max_age_seconds`` is not restored: over so
long a time the boards may have changed hands, and nothing is invented.

The file says its ``version``. Version 1 (a bare list, written before MIG slices kept their
board's counter whole) held, for a MIG slice, the board's counter times the slice's share then:
set against the board's counter it would count the rest of the board's since-boot energy, so
such a slice's counter is not restored and its first interval is measured from power. A
collector older than version 2 refuses a version 2 file as not a baseline and starts afresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import orjson

from collectors.energy import Point
from infermeter.atomic import write_atomically

__all__ = ["MAX_AGE_SECONDS", "VERSION", "BaselineFile", "dump", "load", "shifted"]

log = logging.getLogger("infermeter.collector")

Key = tuple[str, str, str]
# A restart (a rollout, an eviction) is minutes at most; longer than this, start afresh.
MAX_AGE_SECONDS: Final = 600.0


# 2: a MIG slice's counter is its board's, whole (1: times the slice's share, see above).
VERSION: Final = 2


def dump(points: Mapping[Key, Point]) -> bytes:
    """The readings as JSON: the format's version, and one entry per GPU key."""
    rows = [
        {"key": list(k), "t": p.t, "w": p.power_watts, "mj": p.energy_mj} for k, p in points.items()
    ]
    return orjson.dumps({"version": VERSION, "readings": rows})


def load(data: bytes, now: float, max_age_seconds: float = MAX_AGE_SECONDS) -> dict[Key, Point]:
    """The readings of ``data`` no older than ``max_age_seconds`` at ``now`` (none in the future).

    ValueError when ``data`` is not what ``dump`` writes.
    """
    try:
        doc: Any = orjson.loads(data)
        # A bare list is version 1: its MIG slices' counters were scaled by their share then.
        rows, scaled = (doc, True) if isinstance(doc, list) else (doc["readings"], False)
        if not scaled and doc["version"] != VERSION:
            raise ValueError(f"version {doc['version']!r}, this collector reads {VERSION}")
        out = {}
        for row in rows:
            node, uuid, mig = (str(v) for v in row["key"])
            kept = row["mj"] is not None and not (scaled and mig)
            point = Point(float(row["t"]), float(row["w"]), float(row["mj"]) if kept else None)
            if now - max_age_seconds <= point.t <= now:
                out[(node, uuid, mig)] = point
        return out
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a baseline file: {exc}") from None


def shifted(points: Mapping[Key, Point], seconds: float) -> dict[Key, Point]:
    """The readings with their times moved by ``seconds``: from one clock onto another.

    The file keeps wall time, which outlives the process; the loop measures on the monotonic
    clock, whose zero is the process's (or the boot's) own.
    """
    return {k: replace(p, t=p.t + seconds) for k, p in points.items()}


class BaselineFile:
    """The baseline on disk, beside the collector's spools."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._failing = False

    def read(self, now: float) -> dict[Key, Point]:
        """The readings kept by the last run; none when there is no usable file (logged)."""
        try:
            points = load(self.path.read_bytes(), now)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("collector: ignoring the GPU baseline %s: %s", self.path, exc)
            return {}
        if points:
            log.info("collector: %d GPU readings restored from %s", len(points), self.path)
        return points

    async def save(self, points: Mapping[Key, Point]) -> None:
        """Replace the file with ``points`` (off the event loop: it fsyncs).

        A file that cannot be written costs only the next restart's interval: logged once.
        """
        data = dump(points)
        try:
            await asyncio.to_thread(write_atomically, self.path, data)
        except OSError as exc:
            if not self._failing:
                log.warning("collector: cannot keep the GPU baseline in %s: %s", self.path, exc)
            self._failing = True
        else:
            self._failing = False
