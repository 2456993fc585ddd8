"""The autoscaler's demand history, last desired counts and last changes on disk, so a restart
keeps them.

The predictive term reads the peak demand of each time-of-day slot on previous days; in memory
only, a restarted autoscaler would know nothing for a day. ``HistoryFile`` writes every model's
``DemandHistory`` to one JSON file at most every ``autoscale.history_save_seconds`` and once more
on the way out, and reads it back at start.

The same file keeps each model's last desired count (``desired``), saved at the tick it changes.
The policy steps from the count last asked for, as an HPA steps from ``spec.replicas``; without
it, a restarted autoscaler's first tick stepped from the replicas it saw serving, and so asked
away the replicas of a scale-up still starting (or one whose page was not read). It is kept here,
not read back from where it was published: only the Kubernetes hook's target could say it (a
webhook receiver cannot be asked, KEDA reads the autoscaler's own gauge, the local hook's
instances are the autoscaler's own children), and this file is already the autoscaler's state.
A count is a whole number from 0 to ``MAX_DESIRED`` (the most replicas a decision billing keeps
may ask for); the first tick clamps it to the limits in force as any decision is. A file written
before it kept counts has none: the first tick steps from the replicas seen, as it did.

With each count the file keeps when it last changed and which way (``changes``: the policy's
wall-clock time and +1 or -1), so the cool-down and the hold on replicas still starting are in
force after a restart as before it. Without them, an autoscaler restarted just after a scale-up
(a rollout, an eviction) had no cool-down: with the queue still high while the new replica
started, it added another 30 s later where the one before would have waited out the cool-down.
A time more than ``MAX_FUTURE_SECONDS`` ahead of the clock is refused with the file (it would
hold every model's cool-down that much longer). The rules' timers (queue high since, idle since)
are not kept: they are observations, and a restart's gap in them is no evidence; they start
afresh, which can only delay a step.

Durability: a save writes a temporary file in the same directory, fsyncs it, renames it over the
file and fsyncs the directory, so the file on disk is always one whole save, the previous or the
new one, whatever moment the process dies at. Size: the history keeps ``history_days + 1`` rows
of ``day_seconds / history_slot_seconds`` slots per configured model, so the file is bounded by
the configuration (about 10 KB per model with the defaults); a file larger than
``MAX_FILE_BYTES`` is refused unread.

A file that cannot be used (torn by hand, another program's JSON, slots of another length, a
count that is not one) is reported in one warning and the autoscaler starts with an empty
history and steps from the replicas it sees: a missing predictive term costs a day of reactive
scaling, a crash would cost the scaling itself.
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
from infermeter.records import MAX_SCALED_REPLICAS

__all__ = [
    "FORMAT",
    "MAX_DESIRED",
    "MAX_FILE_BYTES",
    "MAX_FUTURE_SECONDS",
    "HistoryFile",
    "HistoryFileError",
    "decode",
    "decode_states",
    "desired_counts",
    "encode",
]

log = logging.getLogger("infermeter.autoscale")

FORMAT: Final = "infermeter.autoscale.history/1"
MAX_FILE_BYTES: Final = 16 << 20
# A larger saved count is not one the policy decided (billing refuses a decision asking for
# more), and published as it is would ask a cluster for that many replicas.
MAX_DESIRED: Final = MAX_SCALED_REPLICAS
# How far ahead of this autoscaler's clock a saved change may be (another clock's skew).
MAX_FUTURE_SECONDS: Final = 300.0


class HistoryFileError(ValueError):
    """The history file is not one this autoscaler can use; the message says why."""


def _slots(params: PolicyParams) -> int:
    return max(1, round(params.day_seconds / params.slot_seconds))


def encode(
    histories: Mapping[str, DemandHistory],
    params: PolicyParams,
    desired: Mapping[str, int] | None = None,
    changes: Mapping[str, tuple[float, int]] | None = None,
) -> bytes:
    """The file's bytes: the slot layout the rows were recorded with, each model's rows, and
    each model's last desired count and last change (time, direction)."""
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
            "desired": dict(sorted((desired or {}).items())),
            "changes": {m: [t, d] for m, (t, d) in sorted((changes or {}).items())},
        }
    )


def decode(raw: bytes, params: PolicyParams, models: Sequence[str]) -> dict[str, DemandHistory]:
    """The histories of ``models`` in ``raw``; HistoryFileError when the file cannot be used.

    Rows recorded with another slot layout would put yesterday's 10:00 at another time of day,
    so they are refused rather than read; models no longer configured are dropped.
    """
    return _histories(_document(raw, params), params, models)


def decode_states(
    raw: bytes, params: PolicyParams, models: Sequence[str], now: float | None = None
) -> dict[str, ModelState]:
    """Each of ``models``' state in ``raw``: its history, last desired count and last change,
    as ``decode``; ``now`` (the policy's wall clock) bounds how late a change may be."""
    data = _document(raw, params)
    histories = _histories(data, params, models)
    desired = _desired(data.get("desired", {}), models)
    changes = _changes(data.get("changes", {}), models, time.time() if now is None else now)
    return {
        model: ModelState(
            history=histories.get(model, DemandHistory()),
            last_desired=desired.get(model),
            last_change_time=changes[model][0] if model in changes else None,
            last_change_direction=changes[model][1] if model in changes else 0,
        )
        for model in models
        if model in histories or model in desired
    }


def _changes(stored: Any, models: Sequence[str], now: float) -> dict[str, tuple[float, int]]:
    """The saved last changes of ``models``: [time, +1 or -1], no later than ``now`` allows."""
    if not isinstance(stored, dict):
        raise HistoryFileError("'changes' is not a mapping")
    out = {}
    for model in models:
        if model not in stored:
            continue
        change = stored[model]
        if not (
            isinstance(change, list)
            and len(change) == 2
            and type(change[0]) in (int, float)
            and math.isfinite(change[0])
            and change[0] >= 0
            and type(change[1]) is int
            and change[1] in (-1, 1)
        ):
            raise HistoryFileError(f"changes.{model} is {change!r}, not [time, 1 or -1]")
        if change[0] > now + MAX_FUTURE_SECONDS:
            raise HistoryFileError(
                f"changes.{model} is at {change[0]!r}, {change[0] - now:.0f} s ahead of the clock"
            )
        out[model] = (float(change[0]), change[1])
    return out


def _desired(stored: Any, models: Sequence[str]) -> dict[str, int]:
    """The saved counts of ``models``: whole numbers within 0..MAX_DESIRED, or the file is refused."""
    if not isinstance(stored, dict):
        raise HistoryFileError("'desired' is not a mapping")
    out = {}
    for model in models:
        if model not in stored:
            continue
        count = stored[model]
        # bool is an int to Python, and a float such as 3.0 was never written by ``encode``.
        if type(count) is not int or not 0 <= count <= MAX_DESIRED:
            raise HistoryFileError(
                f"desired.{model} is {count!r}, not a replica count within 0..{MAX_DESIRED}"
            )
        out[model] = count
    return out


def _document(raw: bytes, params: PolicyParams) -> dict[str, Any]:
    """The file's JSON object, once its format and slot layout are this autoscaler's."""
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
    return data


def _histories(
    data: dict[str, Any], params: PolicyParams, models: Sequence[str]
) -> dict[str, DemandHistory]:
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


def desired_counts(states: Mapping[str, ModelState]) -> dict[str, int]:
    """Each model's last desired count, for the models that have one."""
    return {m: s.last_desired for m, s in states.items() if s.last_desired is not None}


def last_changes(states: Mapping[str, ModelState]) -> dict[str, tuple[float, int]]:
    """Each model's last change (time, direction), for the models that have one."""
    return {
        m: (s.last_change_time, s.last_change_direction)
        for m, s in states.items()
        if s.last_change_time is not None and s.last_change_direction in (-1, 1)
    }


@dataclass
class HistoryFile:
    """Loads the history and desired counts at start; saves the history at most every
    ``save_seconds``, and a changed desired count at once."""

    path: Path
    params: PolicyParams
    models: Sequence[str]
    save_seconds: float = 5.0
    clock: Callable[[], float] = time.monotonic
    # The policy's clock (observations are stamped with wall-clock time): how late a saved
    # change may be.
    wall_clock: Callable[[], float] = time.time
    _last_save: float | None = field(default=None, init=False)
    _last_bytes: bytes | None = field(default=None, init=False)
    _failing: bool = field(default=False, init=False)
    _saved_desired: dict[str, int] = field(default_factory=dict, init=False)

    def load(self) -> dict[str, ModelState]:
        """Each model's state with its saved history and last desired count; empty (and one
        warning) when the file is unusable."""
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise HistoryFileError(f"larger than {MAX_FILE_BYTES} bytes")
            raw = self.path.read_bytes()
            states = decode_states(raw, self.params, self.models, self.wall_clock())
        except FileNotFoundError:
            log.info("autoscale: no demand history at %s yet; starting empty", self.path)
            return {}
        except (OSError, HistoryFileError) as exc:
            log.warning(
                "autoscale: ignoring the demand history in %s, starting with none and stepping "
                "from the replicas seen: %s",
                self.path,
                exc,
            )
            return {}
        desired = desired_counts(states)
        log.info(
            "autoscale: demand history of %s and desired counts %s loaded from %s",
            sorted(m for m, s in states.items() if s.history.days),
            desired,
            self.path,
        )
        self._last_bytes, self._saved_desired = raw, desired
        return states

    async def maybe_save(self, states: Mapping[str, ModelState]) -> None:
        """Save if ``save_seconds`` have passed since the last save, or a desired count changed.

        A change is what a restart must not lose: saved only with the history, a change followed
        by a crash within ``save_seconds`` was forgotten.
        """
        now = self.clock()
        changed = desired_counts(states) != self._saved_desired
        if (
            not changed
            and self._last_save is not None
            and now - self._last_save < self.save_seconds
        ):
            return
        self._last_save = now
        await asyncio.to_thread(self.save, states)

    def save(self, states: Mapping[str, ModelState]) -> None:
        """Write the histories and desired counts now (skipped when nothing changed); a failure
        is logged."""
        desired = desired_counts(states)
        data = encode(
            {m: s.history for m, s in states.items()}, self.params, desired, last_changes(states)
        )
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
        self._last_bytes, self._saved_desired = data, desired
