"""Energy a GPU drew between two readings: pure functions, no clocks, no I/O.

From the board's millijoule counter when both readings have it: the difference, where a
decrease means the counter was reset (a reboot or driver reload) and counts from 0 again, so
the increase is the new value. A reading that stands for part of its board (a MIG slice) has
the board's counter and gets its share of the board's increase: the counter is differenced
before it is split, so a share that changes between readings (a GPU instance created or
destroyed) splits one interval's increase differently, and never turns since-boot energy into
an interval's. Without a counter, power is integrated over the interval (trapezoid rule).
A counter increase no board could draw in the interval (more than its power limit over the
interval and the exporter's refresh slack: a counter that jumped, or a fall that is no reset
to zero) is no measurement: power measures that interval instead, and the flag says so. Taken
as read, such an increase (a jump of 1e12 mJ, or a since-boot counter after it) was refused by
billing's bounds, and the interval's GPU time with it. An interval longer than the gap limit
(``gap_after_intervals`` scrape intervals) is a gap: nobody knows what was drawn, so energy is
``None``, never guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infermeter.boards import COUNTER_SLACK_SECONDS

__all__ = ["Energy", "Point", "counter_increase", "interval_energy", "next_baseline"]


@dataclass(frozen=True, slots=True)
class Point:
    """One reading's time (s), power (W) and its board's energy counter (mJ, or None)."""

    t: float
    power_watts: float
    energy_mj: float | None


@dataclass(frozen=True, slots=True)
class Energy:
    """Energy over one interval; ``joules`` is None exactly when ``gap`` is true.

    ``counter_refused``: the counters' increase was more than the board can draw, so ``joules``
    came from power.
    """

    joules: float | None
    interval_seconds: float
    gap: bool = False
    counter_refused: bool = False


def counter_increase(previous: float, current: float) -> float:
    """Increase of a monotonic counter; a decrease means it was reset and counts from 0."""
    return current - previous if current >= previous else current


def next_baseline(previous: Point | None, current: Point) -> Point:
    """The reading the next interval starts from: ``current``, unless it is not after ``previous``.

    An interval of no time measures nothing (0 s, 0 J). Moving the baseline to such a reading
    anyway lost what the counter drew since ``previous``: the next interval started later.
    """
    return current if previous is None or current.t > previous.t else previous


def interval_energy(
    previous: Point | None,
    current: Point,
    gap_seconds: float,
    share: float = 1.0,
    max_watts: float = math.inf,
) -> Energy:
    """Joules drawn from ``previous`` to ``current``; the first reading starts at 0 s, 0 J.

    ``share`` is the part of the board the readings stand for. Their counter is the board's, so
    its increase is multiplied by it; their power is their own already, so it is not.
    ``max_watts`` is the most the board can draw: a counter increase above it over the interval
    plus ``COUNTER_SLACK_SECONDS`` (the exporter's refresh) is refused, and power measures.
    """
    if previous is None:
        return Energy(0.0, 0.0)
    dt = current.t - previous.t
    if dt <= 0:
        return Energy(0.0, 0.0)
    if dt > gap_seconds:
        return Energy(None, dt, gap=True)
    if previous.energy_mj is not None and current.energy_mj is not None:
        increase = counter_increase(previous.energy_mj, current.energy_mj)
        if increase <= max_watts * (dt + COUNTER_SLACK_SECONDS) * 1000.0:
            return Energy(increase * share / 1000.0, dt)
        return Energy(_trapezoid(previous, current, dt), dt, counter_refused=True)
    return Energy(_trapezoid(previous, current, dt), dt)


def _trapezoid(previous: Point, current: Point, dt: float) -> float:
    return (previous.power_watts + current.power_watts) / 2.0 * dt
