"""Schedule advice: "scale to N at these hours", from each hour's measured demand, priced.

Demand is what the engines ran: the busiest minute of every measured hour (running sequences
summed over a model's instances, the figure ``right_size`` reads for the whole period). Each
hour of the day (UTC) needs ``ceil(busiest minute of that hour on any day x (1 + headroom) /
max_num_seqs)`` engines, at least ``min_replicas``; an hour in which requests queued keeps
every engine it had. The schedule holds each level until the hour a different one is needed.

The saving is priced hour by hour at the measured GPU cost of one engine-hour in that hour,
against the engines that ran, capped at what the busiest hour of the period needs: what
``right_size`` already saves by removing engines at every hour is not counted twice. Every
scale-up of the daily schedule starts its engines ``startup_seconds`` early, and that time is
charged against the saving.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from billing.efficiency.advice import ModelFigures, Policy, Recommendation

__all__ = [
    "HourFigures",
    "Segment",
    "daily_levels",
    "engines_ran",
    "needed",
    "schedule",
    "segments",
    "startup_engine_hours",
]

_HOURS: Final = 24


@dataclass(frozen=True, slots=True)
class HourFigures:
    """One model's measured hour (a row of ``model_hourly_sql``)."""

    model: str
    t: float  # the hour's start, Unix seconds
    gpu_hours: float
    gpu_usd: float
    engines: float  # mean live instances: instance-minutes with GPU time / the hour's minutes
    peak_running: float | None
    peak_waiting: float | None


@dataclass(frozen=True, slots=True)
class Segment:
    """Hours of the day ``[start, end)`` (UTC) during which ``engines`` serve the model."""

    start: int
    end: int
    engines: int

    def to_json(self) -> dict[str, object]:
        """The segment as ``{"from": "HH:00", "to": "HH:00", "engines": N}``."""
        return {"from": f"{self.start:02d}:00", "to": f"{self.end % 24:02d}:00",
                "engines": self.engines}  # fmt: skip


def needed(peak_running: float, max_num_seqs: int, policy: Policy) -> int:
    """Engines a minute of ``peak_running`` sequences needs, with headroom, at least the minimum."""
    return max(policy.min_replicas,
               math.ceil(peak_running * (1 + policy.headroom) / max_num_seqs - 1e-9))  # fmt: skip


def engines_ran(h: HourFigures) -> float:
    """Engines that ran in the hour, on average: the mean of its live instances, as measured.

    Each instance counts for the minutes it had GPU time, so an autoscaled group is counted as
    it grew and shrank within the hour, whatever GPUs each instance holds.
    """
    return h.engines


def daily_levels(m: ModelFigures, hours: Sequence[HourFigures],
                 policy: Policy) -> list[int | None]:  # fmt: skip
    """Engines each hour of the day needs (None: not measured), the worst day of the period."""
    if m.max_num_seqs is None:
        return [None] * _HOURS
    levels: list[int | None] = [None] * _HOURS
    for h in hours:
        if h.peak_running is None:
            continue
        need = needed(h.peak_running, m.max_num_seqs, policy)
        if (h.peak_waiting or 0) > 0:
            need = max(need, math.ceil(engines_ran(h) - 1e-9))  # queued: every engine was needed
        hod = int(h.t // 3600) % _HOURS
        now = levels[hod]
        levels[hod] = need if now is None else max(now, need)
    return levels


def segments(levels: Sequence[int | None]) -> list[Segment]:
    """The daily levels as runs of equal hours; an unmeasured hour keeps the level before it."""
    known = [lv for lv in levels if lv is not None]
    if not known:
        return []
    filled: list[int] = []
    last = next(lv for lv in reversed(levels) if lv is not None)  # midnight follows 23:00
    for lv in levels:
        last = last if lv is None else lv
        filled.append(last)
    runs: list[Segment] = []
    for hod, lv in enumerate(filled):
        if runs and runs[-1].engines == lv:
            runs[-1] = Segment(runs[-1].start, hod + 1, lv)
        else:
            runs.append(Segment(hod, hod + 1, lv))
    return runs


def startup_engine_hours(runs: Sequence[Segment], policy: Policy) -> float:
    """Engine-hours a day spent starting engines ahead of each scale-up (midnight included)."""
    if len(runs) < 2:
        return 0.0
    ups = sum(
        max(0, b.engines - a.engines) for a, b in zip(runs, [*runs[1:], runs[0]], strict=True)
    )
    return ups * policy.startup_seconds / 3600


def schedule(
    m: ModelFigures, hours: Sequence[HourFigures], policy: Policy
) -> Recommendation | None:
    """A daily scaling schedule for ``m`` when its hours need different engine counts."""
    levels = daily_levels(m, hours, policy)
    runs = segments(levels)
    if len({r.engines for r in runs}) < 2 or m.max_num_seqs is None:
        return None
    cap = max(r.engines for r in runs)  # what the busiest hour needs: right_size's share above it
    filled = [next(r.engines for r in runs if r.start <= hod < r.end) for hod in range(_HOURS)]
    saved = engine_hours = cost = 0.0
    days: set[int] = set()
    for h in hours:
        ran = engines_ran(h)
        if ran <= 0:
            continue
        per_engine_hour = h.gpu_usd / ran
        hod = int(h.t // 3600) % _HOURS
        saved += per_engine_hour * max(0.0, min(ran, cap) - filled[hod])
        engine_hours += ran
        cost += h.gpu_usd
        days.add(int(h.t // 86400))
    startup = (
        startup_engine_hours(runs, policy)
        * len(days)
        * (cost / engine_hours if engine_hours else 0.0)
    )
    saving = m.per_month(saved - startup)
    if saving < policy.min_saving_usd_per_month:
        return None
    plan = ", ".join(f"{r.engines} {r.start:02d}-{r.end:02d}h" for r in runs)
    return Recommendation(
        kind="schedule",
        model=m.model,
        team=None,
        title=f"{m.model}: scale by the hour (UTC): {plan}",
        saving_usd_per_month=saving,
        evidence={
            "engines_needed_by_hour": levels,
            "engines_ran_mean": engine_hours / len(hours) if hours else 0.0,
            "max_num_seqs": m.max_num_seqs,
            "gpu_model": m.gpu_model,
            "gpu_usd_measured": cost,
            "hours_measured": m.hours,
            "days_measured": len(days),
        },
        assumptions=(
            f"each hour of the day needs its busiest minute on any measured day, plus "
            f"{policy.headroom:.0%} headroom, at {m.max_num_seqs} sequences an engine",
            f"engines start {policy.startup_seconds:g} s before the hour they are needed, "
            "and that time is paid for",
            "an hour in which requests queued keeps every engine it ran",
            "engines above what the busiest hour needs are counted by right_size, not here",
            f"the {m.hours} hours measured are representative of a month",
        ),
        caveat="the autoscaler can follow demand this way by itself: check its min_replicas "
        "and cooldown before adding a fixed schedule.",
        action={"schedule": [r.to_json() for r in runs]},
    )
