"""Off-peak advice: a batch-type team whose work lands in the fleet's peak hours, moved out of it.

A team's requests to a model are batch work when its ``teams[].workload`` says ``batch``, or,
left at ``auto``, when at least ``Policy.min_batch_share`` of them were not streamed: nobody
watched them being written, so they can wait. (``interactive`` never moves.)

The engines by the hour of the day are the schedule's (``billing.efficiency.schedule``, the
scaling policy's own rule). The peak hours are those at the day's highest count. The team's
part of each peak hour's busiest minute is taken out and those hours' engines recomputed; its
work there (sequence-hours) goes into the other measured hours with the most spare capacity,
where it must fit under the engines those hours need already, within the headroom. The saving
is the engine-hours no longer needed, priced at each hour's measured cost of one engine-hour,
plus the start-ups the flatter day no longer pays.

It counts from the schedule's levels, never from the engines that ran: right-sizing saves what
is above the busiest hour's need, the schedule what is above each hour's, and this what the
moved work frees below that. The three add up to the engines that ran less what the day needs
after the move.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from billing.efficiency.advice import ModelFigures, Policy, Recommendation
from billing.efficiency.schedule import (
    HourFigures,
    daily_levels,
    engines_ran,
    needed,
    segments,
    startup_engine_hours,
)

__all__ = ["TeamHour", "TeamWorkload", "is_batch", "off_peak"]

_HOURS = 24


@dataclass(frozen=True, slots=True)
class TeamHour:
    """One team's part of one model's measured hour (a row of ``team_peak_sql``)."""

    model: str
    team: str
    t: float
    rest_peak: float  # the hour's busiest minute without the team
    team_at_peak: float  # the team's sequences in the hour's busiest minute
    sequence_hours: float  # the team's sequences summed over the hour: its work


@dataclass(frozen=True, slots=True)
class TeamWorkload:
    """One team's finished requests to a model, and those not streamed (``workload_sql``)."""

    model: str
    team: str
    requests: int
    unstreamed_requests: int

    @property
    def unstreamed_share(self) -> float:
        """The share of the requests nobody streamed."""
        return self.unstreamed_requests / self.requests if self.requests else 0.0


def is_batch(w: TeamWorkload, declared: str, policy: Policy) -> bool:
    """Whether the team's work on the model can wait: as declared, else by its unstreamed share."""
    if declared != "auto":
        return declared == "batch"
    return w.requests > 0 and w.unstreamed_share >= policy.min_batch_share


def _hod(t: float) -> int:
    return int(t // 3600) % _HOURS


def _hhmm(hod: int) -> str:
    return f"{hod:02d}:00-{(hod + 1) % _HOURS:02d}:00"


def _after_peak(m: ModelFigures, hours: Sequence[HourFigures], team: Mapping[float, TeamHour],
                peak: set[int], policy: Policy) -> dict[int, int]:  # fmt: skip
    """Engines each peak hour of the day needs with the team's part taken out (worst day)."""
    assert m.max_num_seqs is not None
    after: dict[int, int] = {}
    for h in hours:
        hod = _hod(h.t)
        if hod not in peak or h.peak_running is None:
            continue
        if (h.peak_waiting or 0) > 0:  # queued: every engine was needed, with or without it
            need = max(needed(h.peak_running, m.max_num_seqs, policy),
                       math.ceil(engines_ran(h) - 1e-9))  # fmt: skip
        else:
            found = team.get(h.t)
            rest = h.peak_running if found is None else max(0.0, found.rest_peak)
            need = needed(rest, m.max_num_seqs, policy)
        after[hod] = max(after.get(hod, 0), need)
    return after


def _spare(m: ModelFigures, hours: Sequence[HourFigures], levels: Sequence[int | None],
           peak: set[int], policy: Policy) -> dict[int, float]:  # fmt: skip
    """Sequences each off-peak hour could add, worst day, under the engines it needs already."""
    assert m.max_num_seqs is not None
    worst: dict[int, float] = {}
    queued: set[int] = set()
    for h in hours:
        hod = _hod(h.t)
        if hod in peak or h.peak_running is None or levels[hod] is None:
            continue
        worst[hod] = max(worst.get(hod, 0.0), h.peak_running)
        if (h.peak_waiting or 0) > 0:
            queued.add(hod)
    spare = {}
    for hod, busiest in worst.items():
        level = levels[hod]
        assert level is not None
        room = level * m.max_num_seqs / (1 + policy.headroom) - busiest
        if hod not in queued and room > 0:
            spare[hod] = room
    return spare


def _place(work: float, spare: Mapping[int, float]) -> dict[int, float] | None:
    """``work`` poured into the hours with the most room first; None when it does not fit."""
    placed: dict[int, float] = {}
    for hod in sorted(spare, key=lambda k: (-spare[k], k)):
        if work <= 1e-9:
            break
        placed[hod] = min(work, spare[hod])
        work -= placed[hod]
    return placed if work <= 1e-9 else None


def off_peak(m: ModelFigures, hours: Sequence[HourFigures], team_hours: Sequence[TeamHour],
             workload: TeamWorkload, declared: str,
             policy: Policy) -> Recommendation | None:  # fmt: skip
    """Move ``workload.team``'s work on ``m`` out of the peak hours, when that frees engines."""
    if m.max_num_seqs is None or not is_batch(workload, declared, policy):
        return None
    before = daily_levels(m, hours, policy)
    known = [lv for lv in before if lv is not None]
    if not known:
        return None
    top = max(known)
    peak = {hod for hod, lv in enumerate(before) if lv == top}
    mine = {th.t: th for th in team_hours}
    after_peak = _after_peak(m, hours, mine, peak, policy)
    work: dict[int, float] = defaultdict(float)
    for th in team_hours:
        if _hod(th.t) in peak:
            work[_hod(th.t)] = max(work[_hod(th.t)], th.sequence_hours)  # the worst day
    moved = sum(work.values())
    spare = _spare(m, hours, before, peak, policy)
    placed = _place(moved, spare)
    if moved <= 0 or placed is None:
        return None
    after = [after_peak.get(hod, lv) if hod in peak else lv for hod, lv in enumerate(before)]
    saved, days, per_engine_hour = _priced(m, hours, before, after)
    startup = startup_engine_hours(segments(before), policy) - startup_engine_hours(
        segments(after), policy
    )
    saving = m.per_month(saved + startup * days * per_engine_hour)
    if saved <= 0 or saving < policy.min_saving_usd_per_month:
        return None
    return _recommendation(m, workload, declared, policy, saving, before, after, peak, placed,
                           _share_of_peak(hours, mine, peak), days)  # fmt: skip


def _priced(m: ModelFigures, hours: Sequence[HourFigures], before: Sequence[int | None],
            after: Sequence[int | None]) -> tuple[float, int, float]:  # fmt: skip
    """USD of the engine-hours freed, the days measured, and the mean cost of an engine-hour."""
    saved = engine_hours = cost = 0.0
    days: set[int] = set()
    for h in hours:
        ran = engines_ran(h)
        lv, new = before[_hod(h.t)], after[_hod(h.t)]
        if ran <= 0 or lv is None or new is None:
            continue
        saved += h.gpu_usd / ran * max(0.0, min(ran, lv) - new)
        engine_hours += ran
        cost += h.gpu_usd
        days.add(int(h.t // 86400))
    return saved, len(days), cost / engine_hours if engine_hours else 0.0


def _share_of_peak(hours: Sequence[HourFigures], team: Mapping[float, TeamHour],
                   peak: set[int]) -> float:  # fmt: skip
    """The team's part of the busiest minute of the busiest peak hour measured."""
    busiest = max((h for h in hours if _hod(h.t) in peak and h.peak_running),
                  key=lambda h: h.peak_running or 0.0, default=None)  # fmt: skip
    if busiest is None or not busiest.peak_running or busiest.t not in team:
        return 0.0
    return team[busiest.t].team_at_peak / busiest.peak_running


def _recommendation(m: ModelFigures, w: TeamWorkload, declared: str, policy: Policy,
                    saving: float, before: Sequence[int | None], after: Sequence[int | None],
                    peak: set[int], placed: Mapping[int, float], share: float,
                    days: int) -> Recommendation:  # fmt: skip
    peak_hours = [_hhmm(hod) for hod in sorted(peak)]
    into = sorted(placed)
    why = (
        "the configuration declares it batch work (teams[].workload)"
        if declared == "batch"
        else f"{w.unstreamed_share:.0%} of its requests were not streamed: nobody watched them "
        "being written"
    )
    return Recommendation(
        kind="off_peak",
        model=m.model,
        team=w.team,
        title=f"{w.team}: run its {m.model} batch work at "
        f"{', '.join(_hhmm(h) for h in into)} instead of {', '.join(peak_hours)} (UTC)",
        saving_usd_per_month=saving,
        evidence={
            "share_of_peak": share,
            "peak_hours": peak_hours,
            "sequence_hours_moved": sum(placed.values()),
            "engines_needed_by_hour": list(before),
            "engines_needed_by_hour_after": list(after),
            "unstreamed_share": w.unstreamed_share,
            "workload": declared,
            "max_num_seqs": m.max_num_seqs,
            "hours_measured": m.hours,
            "days_measured": days,
        },
        assumptions=(
            f"the work can wait: {why}",
            "moved, it keeps its concurrency and length (its sequence-hours) and goes into the "
            "measured hours with the most spare capacity, under the engines they need already, "
            f"with {policy.headroom:.0%} headroom kept",
            "engines by the hour as the schedule advice sets them (each hour's busiest minute); "
            "a team's part of a minute is its share of the in-flight seconds",
            "an hour in which requests queued keeps every engine it ran and takes no moved work",
            "counted below the schedule's levels: right_size, schedule and this add up",
            f"the {m.hours} hours measured are representative of a month",
        ),
        caveat="its results arrive later: agree the hours with the team, and hold the work "
        "with a job scheduler (or a queue that releases it off-peak).",
        action={
            "team": w.team,
            "move_from": peak_hours,
            "move_to": [
                {"hours": _hhmm(hod), "sequence_hours": round(placed[hod], 3)} for hod in into
            ],
        },
    )
