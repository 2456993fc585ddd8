"""The plan: the advisor's changes replayed together, each priced by what it adds to the plan.

1. **Vouch.** Each model's requests are replayed on its engines as they ran (``replay``). A
   replica group whose replay is off the measured period, GPU-hours by more than
   ``Policy.vouch_gpu_hours`` (5 %) or TTFT p95 by more than ``Policy.vouch_ttft`` (20 %, or
   ``vouch_ttft_slack_seconds`` for sub-second TTFTs), is one the advisor cannot vouch for: its
   model gets no advice, and a note says why.
2. **Capacity.** Each vouched model's engines are capped by the hour of the day
   (``billing.efficiency.capacity``) to what its load needs, never below the policy's
   ``min_replicas``, and the capped fleet replayed. It is kept when every team's TTFT and
   inter-token p95 on the model hold the SLA with ``Policy.sla_margin`` to spare; else the
   hours that missed get an engine back, and the replay runs again (a few times at most).
3. **Changes.** Each candidate change (``billing.efficiency.changes``: prefix caching, a larger
   batch, a lower precision, routing short requests, moving batch work off-peak, another GPU
   type) is applied on top of those already accepted, the models it touches are sized again
   and replayed, and it is kept when every SLA holds and the plan's cost falls.

A change's saving is what it takes off the plan's cost when added, in order, so the savings add
up to the plan's, and the plan's never exceeds the measured cost it rests on: each model's cost
starts from the smaller of the measured cost and its replay as it ran, so a replay that runs
dear never shows as a saving. Savings are per month at the period's run rate: x 730 / the hours
measured.

Pure: the inputs are read by ``billing.efficiency.store``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from billing.efficiency.advice import Policy, Recommendation
from billing.efficiency.capacity import (
    Caps,
    capped,
    cuts,
    engine_capacity,
    engines_by_hour,
    hour_segments,
    needed_by_hour,
)
from billing.efficiency.figures import HOURS_PER_MONTH
from billing.efficiency.replay import Arrival, ModelReplay, ModelSetup, replay

__all__ = [
    "Candidate",
    "GroupMeasured",
    "Inputs",
    "Note",
    "Plan",
    "Target",
    "World",
    "build_plan",
    "judge",
    "vouch",
]

_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class Target:
    """What a team's requests to a model must meet: TTFT p95 and the mean inter-token gap's p95."""

    ttft_s: float
    itl_s: float | None  # 1 / min_output_tokens_per_second; None: no speed target


@dataclass(frozen=True, slots=True)
class GroupMeasured:
    """A replica group's measured period: GPU time, its cost, TTFT p95, requests."""

    replica: str
    model: str
    gpu_seconds: float
    gpu_usd: float
    ttft_p95: float | None
    itl_p95: float | None
    requests: int


@dataclass(frozen=True, slots=True)
class World:
    """What is replayed: each model's engines and its arrivals."""

    setups: Mapping[str, ModelSetup]
    arrivals: Mapping[str, Sequence[Arrival]]


@dataclass(frozen=True)
class Candidate:
    """A change to try: what it is, the models it touches, and how it changes the world."""

    kind: str
    model: str
    team: str | None
    models: tuple[str, ...]
    title: str
    change: Mapping[str, Any]
    evidence: Mapping[str, Any]
    assumptions: tuple[str, ...]
    apply: Callable[[World], World]
    caveat: str | None = None
    policy_change: Mapping[str, Any] = field(default_factory=dict)
    exclusive: str = ""  # candidates with one key: the first accepted wins


@dataclass(frozen=True, slots=True)
class Note:
    """Why the advisor says nothing about a model or group (it cannot vouch, cannot size...)."""

    model: str
    replica: str | None
    kind: str
    text: str

    def to_json(self) -> dict[str, Any]:
        """The note as JSON-ready values."""
        return {"model": self.model, "replica": self.replica, "kind": self.kind, "text": self.text}


@dataclass(frozen=True)
class Inputs:
    """Everything the plan is built from (``billing.efficiency.store`` reads it)."""

    lo: float
    hi: float
    hours: int  # hours with GPU time measured: what a month is scaled from
    world: World
    measured: Mapping[str, GroupMeasured]  # per replica group
    targets: Mapping[tuple[str, str], Target]  # (model, team); else (model, "")
    min_replicas: int
    policy: Policy
    notes: tuple[Note, ...] = ()


@dataclass(frozen=True)
class Plan:
    """The accepted changes, each with its saving within the plan, and what could not be judged."""

    recommendations: tuple[Recommendation, ...]
    notes: tuple[Note, ...]
    hours: int
    measured_usd: float  # the vouched models' measured GPU cost over the period
    saving_usd: float  # the plan's saving over the period

    def per_month(self, usd: float) -> float:
        """``usd`` over the period, per month at the period's run rate."""
        return usd * HOURS_PER_MONTH / self.hours if self.hours else 0.0


def _target(inputs: Inputs, model: str, team: str) -> Target:
    return inputs.targets.get((model, team)) or inputs.targets[(model, "")]


def judge(r: ModelReplay, target: Callable[[str], Target], margin: float) -> list[dict[str, Any]]:
    """Each team's p95s against its targets less ``margin``; ``holds`` says whether all do."""
    rows = []
    for team in r.teams:
        t = target(team)
        ttft, itl = r.ttft_p95(team), r.itl_p95(team)
        holds = ttft is not None and ttft <= t.ttft_s * (1 - margin)
        if t.itl_s is not None and itl is not None:
            holds = holds and itl <= t.itl_s * (1 - margin)
        rows.append(
            {
                "team": team,
                "ttft_p95_s": ttft,
                "ttft_target_s": t.ttft_s,
                "itl_p95_s": itl,
                "itl_target_s": t.itl_s,
                "holds": holds,
            }
        )
    return rows


def _holds(rows: Sequence[Mapping[str, Any]]) -> bool:
    return all(row["holds"] for row in rows)


def vouch(r: ModelReplay, measured: Sequence[GroupMeasured], policy: Policy) -> list[Note]:
    """Notes for each group of the model whose replay as it ran is off what was measured."""
    notes = []
    for m in measured:
        hours, gpu_h = r.gpu_seconds.get(m.replica, 0.0) / _HOUR, m.gpu_seconds / _HOUR
        problems = []
        if abs(hours - gpu_h) > policy.vouch_gpu_hours * gpu_h:
            problems.append(f"its replay holds {hours:,.2f} GPU-hours, {gpu_h:,.2f} were measured")
        ttft = r.ttft_p95(group=m.replica)
        if m.ttft_p95 is not None and ttft is not None:
            slack = max(policy.vouch_ttft * m.ttft_p95, policy.vouch_ttft_slack_seconds)
            if abs(ttft - m.ttft_p95) > slack:
                problems.append(
                    f"its replay's TTFT p95 is {ttft:.3g} s, {m.ttft_p95:.3g} s was measured"
                )
        if problems:
            notes.append(
                Note(
                    m.model,
                    m.replica,
                    "cannot_vouch",
                    f"{m.replica}: the advisor cannot vouch for this group, so offers "
                    f"nothing on {m.model}: {'; '.join(problems)} (the engine profile "
                    "or the lifetimes do not describe it)",
                )
            )
    return notes


@dataclass
class _Model:
    """A model's place in the plan being built: its world, engines, replay and cost so far."""

    setup: ModelSetup  # as the accepted changes leave it, engines as they ran
    arrivals: Sequence[Arrival]
    replay: ModelReplay  # of the capped setup
    cost: float  # the basis savings are taken from
    caps: Caps | None = None


def _refit(
    inputs: Inputs,
    setup: ModelSetup,
    arrivals: Sequence[Arrival],
    first: ModelReplay,
) -> tuple[ModelReplay, Caps | None] | None:
    """The fewest engines by the hour whose replay holds every SLA: (its replay, the caps).

    None when even the engines as they ran miss an SLA; caps None when none can go.
    """
    policy, model = inputs.policy, setup.model

    def target(team: str) -> Target:
        return _target(inputs, model, team)

    if not _holds(judge(first, target, policy.sla_margin)):
        return None
    ran = engines_by_hour(setup.runs)
    capacity = min((engine_capacity(g, arrivals) for g in setup.groups), default=1.0)
    caps = needed_by_hour(first, capacity, policy.headroom, inputs.min_replicas, ran)
    best: tuple[ModelReplay, Caps] | None = None
    held: bool | None = None  # whether the first capped replay held: then fewer, else more
    for _ in range(policy.max_refits):
        if not cuts(tuple(caps), ran):
            break
        r = replay(
            capped(setup, tuple(caps), policy.startup_seconds), arrivals, inputs.lo, inputs.hi
        )
        ok = _holds(judge(r, target, policy.sla_margin))
        held = ok if held is None else held
        if ok:
            best = (r, tuple(caps))
            if not held:
                break  # raised until it held
            lower = [
                c - 1 if c is not None and c > max(1, inputs.min_replicas) else c for c in caps
            ]
            if lower == caps:
                break
            caps = lower
            continue
        if held:
            break  # one fewer missed: the last that held stands
        missing: set[int] = set()
        for team in first.teams:
            t = target(team)
            missing |= r.hours_missing(
                team,
                t.ttft_s * (1 - policy.sla_margin),
                None if t.itl_s is None else t.itl_s * (1 - policy.sla_margin),
            )
        hours = missing or {h for h in range(24) if caps[h] is not None}
        caps = [c + 1 if c is not None and h in hours else c for h, c in enumerate(caps)]
    return (best[0], best[1]) if best is not None else (first, None)


def _capacity_rec(
    inputs: Inputs, m: _Model, r: ModelReplay, caps: Caps, saving: float, before: ModelReplay
) -> Recommendation:
    policy = inputs.policy
    ran = engines_by_hour(m.setup.runs)
    segs = hour_segments(caps)
    dynamic = any(g.dynamic for g in m.setup.groups)
    noun = "instance" if dynamic else "replica"
    most = max(ran)
    if len({c for _, _, c in segs}) == 1:
        n = segs[0][2]
        kind, title = (
            "right_size",
            (
                f"{m.setup.model}: cap the autoscaled groups at {n} {noun}{'s' * (n != 1)} (they ran up to {most})"
                if dynamic
                else f"{m.setup.model}: run {n} {noun}{'s' * (n != 1)} instead of {most}"
            ),
        )
    else:
        plan = ", ".join(f"{c} {a:02d}-{b:02d}h" for a, b, c in segs)
        kind, title = (
            "schedule",
            (
                f"{m.setup.model}: cap the autoscaled groups by the hour (UTC): {plan}"
                if dynamic
                else f"{m.setup.model}: scale by the hour (UTC): {plan}"
            ),
        )
    return _rec(
        inputs,
        kind,
        m.setup.model,
        None,
        title,
        saving,
        change={
            "engines_by_hour": list(caps),
            "schedule": [
                {"from": f"{a:02d}:00", "to": f"{b:02d}:00", "engines": c} for a, b, c in segs
            ],
        },
        evidence={
            "engines_ran_by_hour": ran,
            "peak_sequences_by_hour": _peaks_by_hour(before),
            "sequences_per_engine": min(engine_capacity(g, m.arrivals) for g in m.setup.groups),
            "min_replicas": inputs.min_replicas,
        },
        assumptions=(
            f"each hour of the day gets the engines its busiest day needs in the replay, "
            f"never below min_replicas {inputs.min_replicas}",
            f"an engine stopped and needed again starts {policy.startup_seconds:g} s "
            "early, and that time is paid for",
            "requests go to the serving engines in turn, as a Service spreads them",
            "energy follows the tokens, which stay: only GPU-hours are saved",
        ),
        caveat=(
            "the autoscaler keeps its own decisions under the cap: set its "
            "max_replicas by the hour (or a scheduled scaler)"
        )
        if dynamic
        else None,
        replays={m.setup.model: (before, r)},
    )


def _peaks_by_hour(r: ModelReplay) -> list[float | None]:
    peaks: list[float | None] = [None] * 24
    for hour, peak in r.peak_in_engines.items():
        now = peaks[hour % 24]
        peaks[hour % 24] = peak if now is None else max(now, peak)
    return peaks


def _sla_json(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [dict(row) for row in rows]


def _rec(
    inputs: Inputs,
    kind: str,
    model: str,
    team: str | None,
    title: str,
    saving: float,
    *,
    change: Mapping[str, Any],
    evidence: Mapping[str, Any],
    assumptions: tuple[str, ...],
    caveat: str | None,
    replays: Mapping[str, tuple[ModelReplay, ModelReplay]],
    policy_change: Mapping[str, Any] | None = None,
) -> Recommendation:
    """A recommendation with its replay evidence: per model touched, before and after."""
    evidence_out = dict(evidence) | {"hours_measured": inputs.hours}
    replay_out = {}
    for name, (before, after) in sorted(replays.items()):

        def target(team_: str, name_: str = name) -> Target:
            return _target(inputs, name_, team_)

        replay_out[name] = {
            "gpu_hours_before": before.gpu_hours,
            "gpu_hours_after": after.gpu_hours,
            "cost_usd_before": before.cost_usd,
            "cost_usd_after": after.cost_usd,
            "sla_before": _sla_json(judge(before, target, inputs.policy.sla_margin)),
            "sla_after": _sla_json(judge(after, target, inputs.policy.sla_margin)),
            "preemptions_before": before.preemptions,
            "preemptions_after": after.preemptions,
        }
    hours = inputs.hours
    return Recommendation(
        kind=kind,
        model=model,
        team=team,
        title=title,
        saving_usd_per_month=saving * HOURS_PER_MONTH / hours if hours else 0.0,
        evidence=evidence_out,
        assumptions=(*assumptions, f"the {hours} hours measured are representative of a month"),
        caveat=caveat,
        change=dict(change),
        replay=replay_out,
        policy_change=dict(policy_change or {}),
        saving_usd=saving,
    )


def _baseline(inputs: Inputs) -> tuple[dict[str, _Model], list[Note]]:
    """Each model replayed as it ran, and the notes for those the advisor cannot vouch for."""
    models: dict[str, _Model] = {}
    notes = list(inputs.notes)
    for name, setup in sorted(inputs.world.setups.items()):
        arrivals = inputs.world.arrivals.get(name, ())
        r = replay(setup, arrivals, inputs.lo, inputs.hi)
        measured = [m for m in inputs.measured.values() if m.model == name]
        problems = vouch(r, measured, inputs.policy)
        notes += problems
        if problems or not measured:
            continue
        cost = min(sum(m.gpu_usd for m in measured), r.cost_usd)
        models[name] = _Model(setup, arrivals, r, cost)
    return models, notes


def build_plan(
    inputs: Inputs, candidates: Callable[[World, Mapping[str, ModelReplay]], Sequence[Candidate]]
) -> Plan:
    """The plan for ``inputs``: capacity first, then each candidate change in turn."""
    policy = inputs.policy
    models, notes = _baseline(inputs)
    floor = policy.min_saving_usd_per_month * inputs.hours / HOURS_PER_MONTH
    measured_usd = sum(m.cost for m in models.values())
    recs: list[Recommendation] = []
    for name, m in sorted(models.items()):
        fit = _refit(inputs, m.setup, m.arrivals, m.replay)
        if fit is None:
            notes.append(
                Note(
                    name,
                    None,
                    "sla_missed",
                    f"{name}: replayed as it ran, a team "
                    "misses its SLA: no engine of it is taken away unless another "
                    "change makes up for it",
                )
            )
            continue
        r, caps = fit
        if caps is not None and m.cost - r.cost_usd >= floor:
            recs.append(_capacity_rec(inputs, m, r, caps, m.cost - r.cost_usd, m.replay))
            m.replay, m.cost, m.caps = r, r.cost_usd, caps
    world = World(
        {n: m.setup for n, m in models.items()}, {n: m.arrivals for n, m in models.items()}
    )
    taken: set[str] = set()
    for cand in candidates(world, {n: m.replay for n, m in models.items()}):
        if cand.exclusive and cand.exclusive in taken:
            continue
        if any(n not in models for n in cand.models):
            continue
        found = _try(inputs, cand, world)
        if found is None:
            continue
        trial_world, fits = found
        saving = sum(models[n].cost - fits[n][0].cost_usd for n in cand.models)
        if saving < floor:
            continue
        recs.append(_change_rec(inputs, cand, models, fits, saving))
        taken.add(cand.exclusive)
        world = trial_world
        for n in cand.models:
            r, caps = fits[n]
            models[n] = _Model(world.setups[n], world.arrivals[n], r, r.cost_usd, caps)
    total = sum(r.saving_usd for r in recs)
    return Plan(tuple(recs), tuple(notes), inputs.hours, measured_usd, total)


def _try(
    inputs: Inputs,
    cand: Candidate,
    world: World,
) -> tuple[World, dict[str, tuple[ModelReplay, Caps | None]]] | None:
    """The candidate applied and its models sized again; None when an SLA would be missed."""
    trial = cand.apply(world)
    fits: dict[str, tuple[ModelReplay, Caps | None]] = {}
    for n in cand.models:
        setup, arrivals = trial.setups[n], trial.arrivals.get(n, ())
        first = replay(setup, arrivals, inputs.lo, inputs.hi)
        fit = _refit(inputs, setup, arrivals, first)
        if fit is None:
            return None
        fits[n] = fit
    return trial, fits


def _change_rec(
    inputs: Inputs,
    cand: Candidate,
    models: Mapping[str, _Model],
    fits: Mapping[str, tuple[ModelReplay, Caps | None]],
    saving: float,
) -> Recommendation:
    """The candidate as a recommendation: its change, with the engines it lets go."""
    change = dict(cand.change)
    title = cand.title
    for n in cand.models:
        caps = fits[n][1]
        ran = engines_by_hour(inputs.world.setups[n].runs)
        if caps is not None and caps != models[n].caps:
            change[f"{n}.engines_by_hour"] = list(caps)
            segs = hour_segments(caps)
            text = (
                f"{segs[0][2]} engine{'s' * (segs[0][2] != 1)} instead of {max(ran)}"
                if len(segs) == 1
                else ", ".join(f"{c} {a:02d}-{b:02d}h" for a, b, c in segs)
            )
            title += f"; then {n} runs {text}"
    return _rec(
        inputs,
        cand.kind,
        cand.model,
        cand.team,
        title,
        saving,
        change=change,
        evidence=cand.evidence,
        assumptions=cand.assumptions,
        caveat=cand.caveat,
        replays={n: (models[n].replay, fits[n][0]) for n in cand.models},
        policy_change=cand.policy_change,
    )


def with_setup(world: World, setup: ModelSetup) -> World:
    """``world`` with one model's engines replaced."""
    return replace(world, setups={**world.setups, setup.model: setup})
