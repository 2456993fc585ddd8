"""The replay: a period's recorded arrivals through the engine model, on engines as set up.

The advisor's savings are proven here, not estimated. A model's requests, as the ledger recorded
them (arrival, team, prompt and output tokens, choices, the shared prompt head), go to the
model's engine instances in turn: each arrival to the next instance that is serving then, as a
Service spreads requests over its pods. Each instance is ``infermeter.engine_model.Scheduler``
(vLLM's continuous batching, KV cache, preemption and prefix cache), driven on a virtual clock
from its first arrival to its last token; a step that repeats unchanged is applied at once, so
a month costs per request, not per token.

What comes out is what the SLA and the bill are judged on: each request's time to first token
and mean inter-token gap, the engines' GPU time inside the period (each instance's interval
times its GPUs, whether busy or not, as GPU time is billed), and each hour's peak of sequences
in the engines (running and waiting, summed over instances), from which engine counts are sized.

Pure: no ledger, no clock. ``billing.efficiency.plan`` decides what to replay and judges it.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from infermeter.config import EngineProfile
from infermeter.engine_model import Scheduler, Sequence as Seq

__all__ = [
    "Arrival",
    "GroupSetup",
    "ModelReplay",
    "ModelSetup",
    "Run",
    "percentile",
    "replay",
]

_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class Arrival:
    """One recorded request: when it arrived, whose, and its size.

    ``head`` names the prompt head it shares with others (the sidecar's digest) and
    ``head_tokens`` that head's tokens: requests with one head share its KV blocks, which a
    prefix cache serves after the first.
    """

    t: float
    team: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    choices: int = 1
    head: str | None = None
    head_tokens: int = 0
    stream: bool = True
    timed: bool = True  # its first token was seen (the sidecar records none for some answers)


@dataclass(frozen=True, slots=True)
class Run:
    """One engine instance of a replica group: its GPUs paid over ``[start, end)``.

    It serves the arrivals routed to it from ``ready`` (an engine added by a schedule starts
    ``startup_seconds`` early and serves from the hour it is needed) until ``end``; what it
    holds then finishes, as a draining pod's requests do.
    """

    replica: str
    instance: str
    start: float
    end: float
    ready: float

    def overlap(self, lo: float, hi: float) -> float:
        """Seconds of ``[start, end)`` inside ``[lo, hi)``."""
        return max(0.0, min(self.end, hi) - max(self.start, lo))


@dataclass(frozen=True, slots=True)
class GroupSetup:
    """How a replica group's engines are set up: GPUs, price, engine profile, prefix cache."""

    replica: str
    model: str
    gpu_model: str
    gpus: int
    usd_per_gpu_hour: float
    profile: EngineProfile  # step timing, max_num_seqs, the KV cache's tokens and block size
    prefix_caching: bool
    dynamic: bool = False  # its instances come and go (an autoscaled group), by their lifetimes


@dataclass(frozen=True, slots=True)
class ModelSetup:
    """A model's replica groups and the instances they run."""

    model: str
    groups: tuple[GroupSetup, ...]
    runs: tuple[Run, ...]

    def group(self, replica: str) -> GroupSetup:
        """The setup of replica group ``replica``."""
        return next(g for g in self.groups if g.replica == replica)


@dataclass
class ModelReplay:
    """What a model's replay measured. Per request, in arrival order: team, group, hour, TTFT,
    mean inter-token gap (NaN with fewer than two tokens; TTFT infinite when no engine served
    it)."""

    model: str
    teams: list[str]
    team_of: array[int] = field(default_factory=lambda: array("H"))
    timed: array[int] = field(default_factory=lambda: array("b"))
    group_of: array[int] = field(default_factory=lambda: array("H"))
    hour_of: array[int] = field(default_factory=lambda: array("q"))
    ttft: array[float] = field(default_factory=lambda: array("d"))
    itl: array[float] = field(default_factory=lambda: array("d"))
    groups: list[str] = field(default_factory=list)
    gpu_seconds: dict[str, float] = field(default_factory=dict)  # per replica group
    usd: dict[str, float] = field(default_factory=dict)  # per replica group
    peak_in_engines: dict[int, float] = field(default_factory=dict)  # hour -> sequences
    preemptions: int = 0
    unserved: int = 0
    _index: dict[tuple[str, int], list[int]] = field(default_factory=dict, repr=False)

    @property
    def cost_usd(self) -> float:
        """The GPU cost of the replayed engines inside the period."""
        return sum(self.usd.values())

    @property
    def gpu_hours(self) -> float:
        """The replayed engines' GPU-hours inside the period."""
        return sum(self.gpu_seconds.values()) / _HOUR

    def ttft_p95(self, team: str | None = None, group: str | None = None) -> float | None:
        """The 95th percentile of TTFT, of one team's or one group's requests, or all: of those
        whose first token was seen, as the measured one is."""
        return percentile((self.ttft[i] for i in self._indexes(team, group) if self.timed[i]), 0.95)

    def itl_p95(self, team: str | None = None, group: str | None = None) -> float | None:
        """The 95th percentile of the requests' mean inter-token gaps (those of 2+ tokens)."""
        return percentile([v for v in self._pick(self.itl, team, group) if v == v], 0.95)

    def hours_missing(
        self, team: str, ttft_s: float, itl_s: float | None, share: float = 0.05
    ) -> set[int]:
        """Hours of the day (UTC) in which more than ``share`` of a team's requests missed."""
        asked: dict[int, int] = defaultdict(int)
        missed: dict[int, int] = defaultdict(int)
        for i in self._indexes(team, None):
            hod = self.hour_of[i] % 24
            asked[hod] += 1
            gap = self.itl[i]
            late = self.timed[i] and self.ttft[i] > ttft_s
            if late or (itl_s is not None and gap == gap and gap > itl_s):
                missed[hod] += 1
        return {h for h, n in missed.items() if n > share * asked[h]}

    def _indexes(self, team: str | None, group: str | None) -> list[int]:
        """The requests of a team, of a group, or all (each list built once)."""
        if not self._index:
            for i, (t, g) in enumerate(zip(self.team_of, self.group_of, strict=True)):
                self._index.setdefault(("team", t), []).append(i)
                self._index.setdefault(("group", g), []).append(i)
        if team is None and group is None:
            return list(range(len(self.ttft)))
        if team is not None and group is not None:
            return sorted(set(self._indexes(team, None)) & set(self._indexes(None, group)))
        if team is not None:
            key = ("team", self.teams.index(team)) if team in self.teams else None
        else:
            key = ("group", self.groups.index(group)) if group in self.groups else None
        return self._index.get(key, []) if key is not None else []

    def _pick(self, values: array[float], team: str | None, group: str | None) -> list[float]:
        return [values[i] for i in self._indexes(team, group)]


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile with linear interpolation (DuckDB's ``quantile_cont``); None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    if ordered[high] == math.inf:
        return math.inf if pos > low or ordered[low] == math.inf else ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _route(runs: Sequence[Run], arrivals: Sequence[Arrival]) -> list[list[int]]:
    """Each run's arrivals (indexes), each arrival to the next run serving at its time, in turn.

    An arrival when no run serves goes to the run that serves next (it waits); with none to
    come it is not served.
    """
    order = sorted(
        range(len(runs)), key=lambda i: (runs[i].replica, runs[i].instance, runs[i].ready)
    )
    events = sorted([(runs[i].ready, 1, i) for i in order] + [(runs[i].end, 0, i) for i in order])
    live: list[tuple[str, str, float, int]] = []
    assigned: list[list[int]] = [[] for _ in runs]
    e, turn = 0, 0
    for k, a in enumerate(arrivals):
        while e < len(events) and events[e][0] <= a.t:
            _, opens, i = events[e]
            key = (runs[i].replica, runs[i].instance, runs[i].ready, i)
            if opens:
                bisect.insort(live, key)
            elif key in live:
                live.remove(key)
            e += 1
        if live:
            assigned[live[turn % len(live)][3]].append(k)
            turn += 1
            continue
        later = [i for i in order if runs[i].ready > a.t and runs[i].end > runs[i].ready]
        if later:
            assigned[min(later, key=lambda i: runs[i].ready)].append(k)
    return assigned


def _blocks(
    a: Arrival, block_size: int, known: dict[tuple[str, int], tuple[int, ...]]
) -> tuple[int, ...]:
    """The KV blocks of the request's shared head, one key per whole block (``known`` keeps each
    head's, so requests with one head share one tuple)."""
    if a.head is None or a.head_tokens < block_size:
        return ()
    key = (a.head, a.head_tokens // block_size)
    found = known.get(key)
    if found is None:
        found = known[key] = tuple(hash((a.head, i)) for i in range(key[1]))
    return found


def _drive(
    run: Run,
    group: GroupSetup,
    arrivals: Sequence[Arrival],
    mine: Sequence[int],
    peak: dict[int, float],
) -> tuple[dict[int, tuple[float, float]], int]:
    """One instance through its arrivals: per arrival index, (TTFT, mean gap); preemptions.

    ``peak`` gains, per hour, the most sequences this engine held at once (running and waiting).
    """
    sched = Scheduler(group.profile, keep_itl=False)
    owners: dict[int, tuple[int, list[Seq]]] = {}
    done: dict[int, tuple[float, float]] = {}
    caching = group.prefix_caching
    size = group.profile.block_size
    known: dict[tuple[str, int], tuple[int, ...]] = {}
    i, n = 0, len(mine)
    t = max(run.ready, arrivals[mine[0]].t) if mine else run.ready

    def held(at: float, until: float) -> None:
        count = len(sched.running) + len(sched.waiting)
        for hour in range(int(at // _HOUR), int(until // _HOUR) + 1):
            if count > peak.get(hour, 0.0):
                peak[hour] = count

    while True:
        while i < n and max(run.ready, arrivals[mine[i]].t) <= t:
            k = mine[i]
            a = arrivals[k]
            blocks = _blocks(a, size, known) if caching else ()
            per = max(1, math.ceil(a.completion_tokens / max(1, a.choices)))
            seqs = [
                Seq(f"{k}-{c}", max(1, a.prompt_tokens), per, per, blocks, arrived_at=a.t)
                for c in range(max(1, a.choices))
            ]
            for s in seqs:
                sched.add(s)
                owners[id(s)] = (k, seqs)
            i += 1
        step = sched.plan(t)
        if step is None:
            if i >= n:
                break
            t = max(run.ready, arrivals[mine[i]].t)
            continue
        start = t
        until = max(run.ready, arrivals[mine[i]].t) if i < n else math.inf
        t, _ = sched.advance(step, t, until)
        held(start, t)
        for s in [*step.decode, *(s for s, _ in step.prefill)]:
            if s.done and id(s) in owners:
                k, seqs = owners.pop(id(s))
                if all(x.done for x in seqs):
                    done[k] = _outcome(arrivals[k], seqs)
    return done, sched.counters.preemptions


def _outcome(a: Arrival, seqs: Sequence[Seq]) -> tuple[float, float]:
    """TTFT (the first choice's first token) and the first choice's mean inter-token gap."""
    firsts = [s.first_token_at for s in seqs if s.first_token_at is not None]
    ttft = min(firsts) - a.t if firsts else math.inf
    s = seqs[0]
    if s.generated < 2 or s.first_token_at is None or s.finished_at is None:
        return ttft, math.nan
    return ttft, (s.finished_at - s.first_token_at) / (s.generated - 1)


def replay(setup: ModelSetup, arrivals: Sequence[Arrival], lo: float, hi: float) -> ModelReplay:
    """Replay ``arrivals`` (one model's, sorted by time) on ``setup``'s engines.

    GPU time and cost count each run's ``[start, end)`` inside ``[lo, hi)``.
    """
    teams = sorted({a.team for a in arrivals})
    groups = sorted(g.replica for g in setup.groups)
    out = ModelReplay(setup.model, teams, groups=groups)
    by_group: Mapping[str, GroupSetup] = {g.replica: g for g in setup.groups}
    for g in setup.groups:
        out.gpu_seconds[g.replica] = 0.0
        out.usd[g.replica] = 0.0
    for run in setup.runs:
        g = by_group[run.replica]
        seconds = run.overlap(lo, hi) * g.gpus
        out.gpu_seconds[run.replica] += seconds
        out.usd[run.replica] += seconds / _HOUR * g.usd_per_gpu_hour
    served: dict[int, tuple[float, float]] = {}
    where: dict[int, str] = {}
    peaks: list[dict[int, float]] = []
    for run, mine in zip(setup.runs, _route(setup.runs, arrivals), strict=True):
        peak: dict[int, float] = {}
        done, preempted = _drive(run, by_group[run.replica], arrivals, mine, peak)
        served.update(done)
        where.update(dict.fromkeys(mine, run.replica))
        out.preemptions += preempted
        peaks.append(peak)
    for peak in peaks:
        for hour, count in peak.items():
            out.peak_in_engines[hour] = out.peak_in_engines.get(hour, 0.0) + count
    team_index = {t: i for i, t in enumerate(teams)}
    group_index = {g: i for i, g in enumerate(groups)}
    for k, a in enumerate(arrivals):
        ttft, gap = served.get(k, (math.inf, math.nan))
        out.unserved += k not in served
        out.team_of.append(team_index[a.team])
        out.group_of.append(group_index.get(where.get(k, ""), len(groups)))
        out.hour_of.append(int(a.t // _HOUR))
        out.ttft.append(ttft)
        out.timed.append(int(a.timed))
        out.itl.append(gap)
    return out
