"""The autoscaler's demand history on disk, so a restart keeps the predictive term.

The predictive term reads the peak demand of each time-of-day slot on previous days; in memory
only, a restarted autoscaler would know nothing for a day. ``HistoryFile`` writes every model's
``DemandHistory`` to one JSON file at most every ``autoscale.history_save_seconds`` and once more
on the way out, and reads it back at start.

Durability: a save writes a temporary file in the same directory, fsyncs it, renames it over the
file and fsyncs the directory, so the file on disk is always one whole save, the previous or the
new one, whatever moment the process dies at. Size: the history keeps ``history_days + 1`` rows
of ``day_seconds / history_slot_seconds`` slots per configured model, so the file is bounded by
the configuration (about 10 KB per model with the defaults); a file larger than
``MAX_FILE_BYTES`` is refused unread.

A file that cannot be used (torn by hand, another program's JSON, slots of another length) is
reported in one warning and the autoscaler starts with an empty history: a missing predictive
term costs a day of reactive scaling, a crash would cost the scaling itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from alerts.autoscale.policy import DemandHistory, ModelState, PolicyParams
from infermeter.atomic import write_atomically

__all__ = [
    "FORMAT",
    "MAX_FILE_BYTES",
    "HistoryFile",
    "HistoryFileError",
    "decode",
    "encode",
]

log = logging.getLogger("infermeter.autoscale")

FORMAT: Final = "infermeter.autoscale.history/1"
MAX_FILE_BYTES: Final = 16 << 20


class HistoryFileError(ValueError):
    """The history file is not one this autoscaler can use; the message says why."""


def _slots(params: PolicyParams) -> int:
    return max(1, round(params.day_seconds / params.slot_seconds))


def encode(histories: Mapping[str, DemandHistory], params: PolicyParams) -> bytes:
    """The file's bytes: the slot layout the rows were recorded with, and each model's rows."""
    return orjson.dumps(
        {
            "format": FORMAT,
            "slot_seconds": params.slot_seconds,
            "day_seconds": params.day_seconds,
            "models": {
                model: [[day, list(values)] for day, values in history.days]
                for model, history in sorted(histories.items())
                if history.days
            },
        }
    )


def decode(raw: bytes, params: PolicyParams, models: Sequence[str]) -> dict[str, DemandHistory]:
    """The histories of ``models`` in ``raw``; HistoryFileError when the file cannot be used.

    Rows recorded with another slot layout would put yesterday's 10:00 at another time of day,
    so they are refused rather than read; models no longer configured are dropped.
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise HistoryFileError(f"not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise HistoryFileError(f"not an autoscaler history (no format {FORMAT!r})")
    layout = (data.get("slot_seconds"), data.get("day_seconds"))
    if layout != (params.slot_seconds, params.day_seconds):
        raise HistoryFileError(
            f"recorded with slot_seconds={layout[0]!r}, day_seconds={layout[1]!r}; "
            f"this autoscaler uses {params.slot_seconds}, {params.day_seconds:g}"
        )
    stored = data.get("models")
    if not isinstance(stored, dict):
        raise HistoryFileError("'models' is not a mapping")
    return {
        model: _rows(model, stored[model], _slots(params), params.history_days + 1)
        for model in models
        if model in stored
    }


def _rows(model: str, rows: Any, slots: int, keep: int) -> DemandHistory:
    if not isinstance(rows, list):
        raise HistoryFileError(f"models.{model} is not a list of days")
    days: list[tuple[int, tuple[float | None, ...]]] = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 2 and type(row[0]) is int):
            raise HistoryFileError(f"models.{model}: a row is not [day, [demand, ...]]")
        day, values = row
        if not isinstance(values, list) or len(values) != slots:
            raise HistoryFileError(f"models.{model}: day {day} does not have {slots} slots")
        if not all(_demand(v) for v in values):
            raise HistoryFileError(f"models.{model}: day {day} holds a value that is not a demand")
        if days and day <= days[-1][0]:
            raise HistoryFileError(f"models.{model}: days are not in increasing order")
        days.append((day, tuple(None if v is None else float(v) for v in values)))
    return DemandHistory(tuple(days[-keep:]))


def _demand(value: Any) -> bool:
    if value is None:
        return True
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


@dataclass
class HistoryFile:
    """Loads the history at start and saves it at most every ``save_seconds``."""

    path: Path
    params: PolicyParams
    models: Sequence[str]
    save_seconds: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _last_save: float | None = field(default=None, init=False)
    _last_bytes: bytes | None = field(default=None, init=False)
    _failing: bool = field(default=False, init=False)

    def load(self) -> dict[str, ModelState]:
        """Each model's state with its saved history; empty (and one warning) when unusable."""
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise HistoryFileError(f"larger than {MAX_FILE_BYTES} bytes")
            raw = self.path.read_bytes()
            histories = decode(raw, self.params, self.models)
        except FileNotFoundError:
            log.info("autoscale: no demand history at %s yet; starting empty", self.path)
            return {}
        except (OSError, HistoryFileError) as exc:
            log.warning(
                "autoscale: ignoring the demand history in %s, starting with none: %s",
                self.path,
                exc,
            )
            return {}
        log.info("autoscale: demand history of %s loaded from %s", sorted(histories), self.path)
        self._last_bytes = raw
        return {model: ModelState(history=h) for model, h in histories.items()}

    async def maybe_save(self, states: Mapping[str, ModelState]) -> None:
        """Save if ``save_seconds`` have passed since the last save."""
        now = self.clock()
        if self._last_save is not None and now - self._last_save < self.save_seconds:
            return
        self._last_save = now
        await asyncio.to_thread(self.save, states)

    def save(self, states: Mapping[str, ModelState]) -> None:
        """Write the histories now (skipped when nothing changed); a failure is logged."""
        data = encode({m: s.history for m, s in states.items()}, self.params)
        if data == self._last_bytes:
            return
        try:
            write_atomically(self.path, data)
        except OSError as exc:
            # Said once per outage, not every few seconds (a read-only file system stays so).
            if not self._failing:
                log.error(
                    "autoscale: cannot save the demand history to %s (a restart will "
                    "forget it): %s",
                    self.path,
                    exc,
                )
            self._failing = True
            return
        if self._failing:
            log.warning("autoscale: the demand history is saved to %s again", self.path)
        self._failing = False
        self._last_bytes = data
