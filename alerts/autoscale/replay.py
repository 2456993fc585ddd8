"""Replay the policy over a recorded or simulated day and compare it with a peak-sized fleet.

What is modelled, per model, one tick (default one minute) at a time:

- **Demand** is output tokens per second: from a recording, or from the daily shape the
  simulator's traffic follows (``infermeter.day_curve.share_of_peak``: a night floor, a 10:00 peak
  and a smaller 15:00 one), scaled so the peak needs ``peak_replicas`` replicas at the target
  utilization.
- **Capacity** of a replica is its engine's decode throughput with a full batch, from the
  simulator's engine profile: ``max_num_seqs / (step_base_ms + step_per_seq_ms x max_num_seqs)``
  tokens per millisecond. Prefill and the KV-cache limit are not modelled separately.
- **Queueing** is a fluid model: work that does not fit in a tick's capacity waits as a token
  backlog, served first in the next tick. Queue depth is the backlog in requests.
- **TTFT p95** is an estimate, not a measurement: one prompt's prefill, plus one engine step at
  the tick's batch size, plus three times the time to drain the backlog (the p95 of an
  exponential wait is three times its mean), plus a congestion term ``step x rho / (1 - rho)``
  that grows as utilization ``rho`` approaches 1.
- **Replicas** asked for take ``startup_seconds`` to serve and cost GPU time from the moment they
  are asked for; removed replicas stop costing at once.

The first ``days - 1`` days only fill the policy's demand history (for the predictive term);
every figure in the report is for the last day. The fixed fleet runs the same day with
``ceil(peak demand / (capacity x target utilization))`` replicas, never fewer than
``min_replicas``.
"""

from __future__ import annotations

import csv
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson

from alerts.autoscale.policy import (
    Decision,
    ModelLimits,
    ModelState,
    Observation,
    PolicyParams,
    decide,
)
from infermeter.config import Config, EngineProfile
from infermeter.day_curve import hour_of_day, share_of_peak

__all__ = [
    "DemandPoint",
    "Engine",
    "ModelReport",
    "engine_for",
    "format_report",
    "read_recording",
    "replay_model",
    "simulated_demand",
]

PROMPT_TOKENS = 512  # prompt length assumed for the prefill part of TTFT


@dataclass(frozen=True)
class Engine:
    """What one replica of a model can do, from the simulator's engine profile."""

    gpu_count: int
    tokens_per_second: float
    max_num_seqs: int
    step_base_seconds: float
    step_per_seq_seconds: float
    prefill_seconds: float
    mean_output_tokens: float

    def step_seconds(self, utilization: float) -> float:
        """One engine step with the batch a utilization implies."""
        batch = min(1.0, utilization) * self.max_num_seqs
        return self.step_base_seconds + self.step_per_seq_seconds * batch


def engine_for(config: Config, model: str) -> Engine:
    """The replay's engine for ``model``: its profile and its replicas' GPU count."""
    p: EngineProfile = config.simulator.engine_for(model)
    replicas = [r for r in config.replicas if r.model == model]
    seqs = max([r.max_num_seqs for r in replicas if r.max_num_seqs] or [p.max_num_seqs])
    step_full_ms = p.step_base_ms + p.step_per_seq_ms * seqs
    return Engine(
        gpu_count=max([r.gpu_count for r in replicas] or [1]),
        tokens_per_second=seqs * 1000.0 / step_full_ms,
        max_num_seqs=seqs,
        step_base_seconds=p.step_base_ms / 1000.0,
        step_per_seq_seconds=p.step_per_seq_ms / 1000.0,
        prefill_seconds=PROMPT_TOKENS / p.prefill_tokens_per_second,
        mean_output_tokens=p.mean_output_tokens,
    )


@dataclass(frozen=True)
class DemandPoint:
    """Output tokens per second wanted at ``time`` (seconds since the replay's start)."""

    time: float
    tokens_per_second: float


def simulated_demand(
    peak_tokens_per_second: float,
    days: int,
    day_seconds: float,
    tick_seconds: float,
    noise: float = 0.1,
    seed: int = 7,
) -> list[DemandPoint]:
    """The daily traffic shape from midnight (``infermeter.day_curve``), in tokens/s, up to the peak.

    Each tick is multiplied by a log-normal factor (sigma ``noise``), so no two days are the
    same and the predictive term cannot simply copy yesterday.
    """
    rng = random.Random(seed)
    ticks = round(days * day_seconds / tick_seconds)
    return [
        DemandPoint(
            i * tick_seconds,
            peak_tokens_per_second
            * share_of_peak(hour_of_day(i * tick_seconds, day_seconds))
            * rng.lognormvariate(0, noise),
        )
        for i in range(ticks)
    ]


def read_recording(path: Path) -> dict[str, list[DemandPoint]]:
    """Per-model demand from a CSV or JSONL recording, one row per model and tick.

    Each row has ``time`` (seconds, any origin; or ``minute``), ``model`` and either
    ``tokens_per_second`` (the model's total output tokens/s) or, as the autoscaler observes
    them, ``tokens_per_second_per_gpu`` with ``gpus`` (GPUs serving at the time).
    """
    if path.suffix == ".csv":
        with path.open(newline="") as fh:
            rows: list[Mapping[str, object]] = list(csv.DictReader(fh))
    else:
        lines = path.read_bytes().splitlines()
        rows = [orjson.loads(line) for line in lines if line.strip()]
    by_model: dict[str, list[DemandPoint]] = defaultdict(list)
    for number, row in enumerate(rows, start=1):
        try:
            time = float(str(row["time"])) if "time" in row else 60.0 * float(str(row["minute"]))
            if row.get("tokens_per_second") not in (None, ""):
                demand = float(str(row["tokens_per_second"]))
            else:
                demand = float(str(row["tokens_per_second_per_gpu"])) * float(str(row["gpus"]))
            by_model[str(row["model"])].append(DemandPoint(float(str(time)), demand))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{path}: row {number}: missing or bad field {exc}") from None
    for points in by_model.values():
        points.sort(key=lambda p: p.time)
        origin = points[0].time
        points[:] = [replace(p, time=p.time - origin) for p in points]
    return dict(by_model)


@dataclass
class ModelReport:
    """What a day of the policy cost and how it served, against a fixed peak-sized fleet."""

    model: str
    tick_seconds: float
    gpu_hours: float = 0.0
    minutes_over_sla: float = 0.0
    fixed_replicas: int = 0
    fixed_gpu_hours: float = 0.0
    fixed_minutes_over_sla: float = 0.0
    peak_replicas: int = 0
    events: list[Decision] = field(default_factory=list)

    @property
    def saving(self) -> float:
        """Share of the fixed fleet's GPU-hours the policy did not use."""
        return 1.0 - self.gpu_hours / self.fixed_gpu_hours if self.fixed_gpu_hours else 0.0


@dataclass
class _Fleet:
    """Replicas serving and starting (their ready times), and the backlog."""

    ready: int
    starting: list[float] = field(default_factory=list)
    backlog_tokens: float = 0.0

    @property
    def provisioned(self) -> int:
        return self.ready + len(self.starting)

    def advance(self, now: float) -> None:
        came_up = [t for t in self.starting if t <= now]
        self.ready += len(came_up)
        self.starting = [t for t in self.starting if t > now]

    def resize(self, desired: int, now: float, startup_seconds: float) -> None:
        while self.provisioned < desired:
            self.starting.append(now + startup_seconds)
        while self.provisioned > desired and self.starting:
            self.starting.pop()  # the latest to have been asked for is furthest from serving
        self.ready = min(self.ready, desired)


def _serve(engine: Engine, fleet: _Fleet, demand: float, now: float, dt: float) -> Observation:
    """Run one tick of the fluid queue; what the autoscaler would observe at its end."""
    capacity = fleet.ready * engine.tokens_per_second * dt
    work = fleet.backlog_tokens + demand * dt
    served = min(work, capacity)
    fleet.backlog_tokens = work - served
    rho = served / capacity if capacity else 1.0
    drain = fleet.backlog_tokens / (capacity / dt) if capacity else math.inf
    step = engine.step_seconds(rho)
    congestion = step * min(100.0, rho / max(1e-9, 1.0 - rho))
    ttft = engine.prefill_seconds + step + 3.0 * drain + congestion
    gpus = fleet.ready * engine.gpu_count
    return Observation(
        time=now,
        current_replicas=fleet.ready,
        queue_depth=fleet.backlog_tokens / engine.mean_output_tokens,
        ttft_p95_seconds=ttft,
        gpu_utilization=rho if fleet.ready else None,
        tokens_per_second_per_gpu=served / dt / gpus if gpus else None,
    )


def replay_model(
    params: PolicyParams,
    limits: ModelLimits,
    engine: Engine,
    demand: Sequence[DemandPoint],
    measure_from: float,
    tick_seconds: float,
) -> ModelReport:
    """Run the policy (and, for comparison, a fixed fleet) over ``demand``."""
    report = ModelReport(limits.model, tick_seconds)
    measured = [p for p in demand if p.time >= measure_from]
    peak = max((p.tokens_per_second for p in measured), default=0.0)
    fixed = math.ceil(peak / (engine.tokens_per_second * params.target_gpu_utilization) - 1e-9)
    report.fixed_replicas = max(limits.min_replicas, fixed)

    hours = tick_seconds / 3600.0
    fleet, state = _Fleet(ready=limits.min_replicas), ModelState()
    static = _Fleet(ready=report.fixed_replicas)
    for point in demand:
        now = point.time + tick_seconds  # observed at the end of the tick
        fleet.advance(point.time)
        obs = _serve(engine, fleet, point.tokens_per_second, now, tick_seconds)
        fixed_obs = _serve(engine, static, point.tokens_per_second, now, tick_seconds)
        decision, state = decide(params, limits, state, obs)
        counted = point.time >= measure_from
        if counted:
            report.gpu_hours += fleet.provisioned * engine.gpu_count * hours
            report.fixed_gpu_hours += static.ready * engine.gpu_count * hours
            report.minutes_over_sla += _over(obs, limits) * tick_seconds / 60.0
            report.fixed_minutes_over_sla += _over(fixed_obs, limits) * tick_seconds / 60.0
        if decision.desired != fleet.provisioned:
            if counted:
                report.events.append(replace(decision, current=fleet.provisioned))
            fleet.resize(decision.desired, now, params.scaling.startup_seconds)
        if counted:
            report.peak_replicas = max(report.peak_replicas, fleet.provisioned)
    return report


def _over(obs: Observation, limits: ModelLimits) -> bool:
    return obs.ttft_p95_seconds is None or obs.ttft_p95_seconds > limits.sla_ttft_p95_seconds


def format_report(
    reports: Iterable[ModelReport], events: bool = True, day_seconds: float = 86400.0
) -> str:
    """A plain-text summary per model, then the scale events of the measured day."""
    lines = [
        f"{'model':<14} {'GPU-h policy':>12} {'GPU-h fixed':>11} {'saved':>6} "
        f"{'fixed size':>10} {'peak':>5} {'min over SLA':>12} {'fixed over SLA':>14} {'events':>6}"
    ]
    reports = list(reports)
    for r in reports:
        lines.append(
            f"{r.model:<14} {r.gpu_hours:>12.1f} {r.fixed_gpu_hours:>11.1f} {r.saving:>6.0%} "
            f"{r.fixed_replicas:>10} {r.peak_replicas:>5} {r.minutes_over_sla:>12.0f} "
            f"{r.fixed_minutes_over_sla:>14.0f} {len(r.events):>6}"
        )
    if events:
        for r in reports:
            lines.append(f"\nscale events, {r.model}:")
            for e in r.events:
                lines.append(
                    f"  {_clock(e.time, day_seconds)}  {e.current:>2} -> {e.desired:<2}  {'; '.join(e.reasons)}"
                )
    return "\n".join(lines)


def _clock(seconds: float, day_seconds: float) -> str:
    """Simulated time of day as HH:MM."""
    minutes = int((seconds % day_seconds) / day_seconds * 24 * 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"
