"""Engines by the hour of the day: how many a model's load needs, and a fleet capped to that.

A capacity change is a cap on a model's live engines for each hour of the day (UTC): the same
count all day is a right-sizing ("run 2 replicas instead of 4"), counts that differ are a
schedule ("1 00-08h, 3 08-20h, 1 20-24h"). Applied to the engines as they ran, it keeps at each
moment ``min(engines that ran, cap)``: a fixed fleet becomes its schedule; an autoscaled group
keeps what its autoscaler did below the cap, so only the hours above it are saved.

The count an hour needs is sized from a replay: the hour's peak of sequences in the engines
(running and waiting) on its busiest day, with ``Policy.headroom`` on top, over what one engine
holds (``max_num_seqs``, or fewer when its KV cache holds fewer of the requests' mean context).
That is a first guess; the replay of the capped fleet is what decides (``billing.efficiency.plan``).

Pure: runs and replays in, runs out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from billing.efficiency.replay import Arrival, GroupSetup, ModelReplay, ModelSetup, Run

__all__ = [
    "Caps",
    "capped",
    "cuts",
    "engine_capacity",
    "engines_by_hour",
    "hour_segments",
    "needed_by_hour",
]

_HOURS = 24
_HOUR = 3600.0
# A cap per hour of the day; None: the hour is not capped (never measured).
Caps = tuple[int | None, ...]


def engine_capacity(group: GroupSetup, arrivals: Sequence[Arrival]) -> float:
    """Sequences one engine of ``group`` holds: ``max_num_seqs``, or what its KV cache holds of
    the requests' mean context (prompt plus output tokens per sequence)."""
    seqs = group.profile.max_num_seqs
    if not arrivals:
        return float(seqs)
    context = sum(a.prompt_tokens + a.completion_tokens / max(1, a.choices) for a in arrivals)
    mean = context / len(arrivals)
    return float(max(1.0, min(seqs, group.profile.kv_cache_tokens / max(1.0, mean))))


def engines_by_hour(runs: Sequence[Run]) -> list[int]:
    """The most engines live at once in each hour of the day (UTC), over every day."""
    most = [0] * _HOURS
    events = sorted([(r.start, 1) for r in runs] + [(r.end, -1) for r in runs])
    live, i = 0, 0
    while i < len(events):
        t = events[i][0]
        while i < len(events) and events[i][0] == t:
            live += events[i][1]
            i += 1
        if i < len(events):  # live holds over [t, next event)
            end = events[i][0]
            for hour in range(int(t // _HOUR), math.ceil(end / _HOUR)):
                if end > hour * _HOUR:
                    most[hour % _HOURS] = max(most[hour % _HOURS], live)
    return most


def needed_by_hour(
    r: ModelReplay, capacity: float, headroom: float, floor: int, ran: Sequence[int]
) -> list[int | None]:
    """Engines each hour of the day needs: its busiest day's peak in the engines, with headroom,
    over what one engine holds; at least ``floor`` (and one) in an hour that ran, idle or not.
    None: no engine ran in that hour."""
    least = max(floor, 1)
    need: list[int | None] = [least if n > 0 else None for n in ran]
    for hour, peak in r.peak_in_engines.items():
        count = max(least, math.ceil(peak * (1 + headroom) / capacity - 1e-9))
        now = need[hour % _HOURS]
        need[hour % _HOURS] = count if now is None else max(now, count)
    return need


def cuts(caps: Caps, ran: Sequence[int]) -> bool:
    """Whether ``caps`` is below what ran in some hour."""
    return any(c is not None and c < n for c, n in zip(caps, ran, strict=True))


def _order(setup: ModelSetup, run: Run) -> tuple[float, str, float, str]:
    """The order engines are kept in: the cheaper engine-hour first, then the older."""
    g = setup.group(run.replica)
    return (g.usd_per_gpu_hour * g.gpus, run.replica, run.start, run.instance)


def capped(setup: ModelSetup, caps: Caps, startup_seconds: float) -> ModelSetup:
    """``setup`` with at most ``caps[hour]`` engines live at each moment of that hour.

    Within each stretch between two changes (an engine starting or ending, an hour turning) the
    engines kept are the first by ``_order``. An engine stopped and needed again later is
    started ``startup_seconds`` before it serves, and pays for that time; a gap shorter than
    that keeps it running instead.
    """
    if not setup.runs:
        return setup
    bounds = {t for r in setup.runs for t in (r.start, r.end)}
    first, last = min(bounds), max(bounds)
    bounds |= {h * _HOUR for h in range(math.ceil(first / _HOUR), math.floor(last / _HOUR) + 1)}
    edges = sorted(bounds)
    ranked = sorted(setup.runs, key=lambda r: _order(setup, r))
    kept: dict[int, list[list[float]]] = {id(r): [] for r in setup.runs}
    for a, b in itertools.pairwise(edges):
        cap = caps[int(a // _HOUR) % _HOURS]
        live = [r for r in ranked if r.start <= a < r.end]
        for r in live if cap is None else live[:cap]:
            pieces = kept[id(r)]
            if pieces and pieces[-1][1] >= a - startup_seconds:
                pieces[-1][1] = b  # running on, or back before a restart would pay off
            else:
                pieces.append([a, b])
    runs = []
    for r in setup.runs:
        for k, (a, b) in enumerate(kept[id(r)]):
            restarted = a > r.start
            start = max(a - startup_seconds, r.start) if restarted else r.start
            name = r.instance if k == 0 else f"{r.instance}~{k}"
            runs.append(Run(r.replica, name, start, b, max(a, r.ready)))
    return replace(setup, runs=tuple(runs))


def hour_segments(caps: Caps) -> list[tuple[int, int, int]]:
    """The caps as runs of equal hours ``(from, to, engines)``; an uncapped hour keeps the level
    before it (midnight follows 23:00)."""
    known = [c for c in caps if c is not None]
    if not known:
        return []
    last = next(c for c in reversed(caps) if c is not None)
    runs: list[tuple[int, int, int]] = []
    for hod, c in enumerate(caps):
        last = last if c is None else c
        if runs and runs[-1][2] == last:
            runs[-1] = (runs[-1][0], hod + 1, last)
        else:
            runs.append((hod, hod + 1, last))
    return runs
