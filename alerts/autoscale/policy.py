"""The scaling policy: pure functions from one tick's observations to a desired replica count.

Nothing here reads a clock, the network or a file. Each call takes the model's previous
``ModelState`` and one ``Observation`` (which carries the time) and returns a ``Decision`` and
the next ``ModelState``; the caller keeps the state. So a day can be replayed in milliseconds and
every rule is tested by feeding it a sequence of observations.

Rules, in the order they are applied (defaults from ``scaling`` in the configuration):

1. **Sustained queue**: requests waiting (summed over the model's replicas) above
   ``scale_up_queue_depth`` for ``scale_up_after_seconds`` adds one replica for every
   ``scale_up_queue_depth`` requests (or part of them) waiting beyond ``scale_up_queue_depth``,
   at most ``max_scale_up_step`` (default: max(replicas serving, 4), as an HPA's default
   scale-up policy); one replica while the queue is below what it was at the last scale-up (it
   is draining). A brief burst does not.
2. **SLA**: TTFT p95 above the model's ``sla.ttft_p95_seconds`` adds one replica at once (the
   p95 is already an aggregate over a window, so it is not debounced again).
3. **Idle**: mean GPU utilization below ``scale_down_gpu_utilization`` for
   ``scale_down_after_seconds`` removes one replica.
4. **Predictive**: a new replica takes ``startup_seconds`` to serve, so the policy looks at the
   demand recorded at ``now + startup_seconds`` on previous days (same time-of-day slot) and asks
   for enough replicas ahead of time; it also vetoes a scale-down that yesterday's demand says
   would soon be undone.
5. **Cool-down**: within ``cooldown_seconds`` of the last change nothing scales down, and nothing
   scales up again after a scale-up (the replicas asked for are still starting). A scale-up right
   after a scale-down is allowed: a latency breach must not wait.
6. **Clamp**: at least ``min_replicas``, at most ``max_replicas`` and the budget cap; the budget
   wins over the minimum, since it is the one limit that costs money to break. Never more than
   10,000, the most replicas a decision may ask for (``MAX_SCALED_REPLICAS``).

A rule steps from the count last asked for, not from the replicas seen serving (a scale-up from
those seen, and never below the count asked for): an engine whose page could not be read this
tick is not evidence that it is gone, so, as with an HPA, a missing metric never scales down and
a slow start-up is never cancelled. Only the idle rule removes a replica.

Demand is measured as busy replica-equivalents: ``current_replicas x gpu_utilization``. The
replicas it needs are ``ceil(demand / target_gpu_utilization)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from infermeter.config import Config, ScalingPolicy
from infermeter.pricing import budget_replica_cost, replicas_within
from infermeter.records import MAX_SCALED_REPLICAS

__all__ = [
    "HPA_MIN_SCALE_UP_STEP",
    "Decision",
    "DemandHistory",
    "ModelLimits",
    "ModelState",
    "Observation",
    "PolicyParams",
    "decide",
    "evaluate",
    "model_limits",
    "params_from_config",
    "queue_step",
    "scale_up_step_bound",
]

# Kubernetes' default HPA scale-up policy adds at most max(100% of the current replicas, 4 pods)
# per 15 s; the step bound when ``max_scale_up_step`` is not set follows it.
HPA_MIN_SCALE_UP_STEP = 4


@dataclass(frozen=True)
class PolicyParams:
    """The policy's knobs: the ``scaling`` section plus the predictive term's settings."""

    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)
    predictive: bool = True
    target_gpu_utilization: float = 0.7
    slot_seconds: int = 900
    history_days: int = 7
    day_seconds: float = 86400.0


@dataclass(frozen=True)
class ModelLimits:
    """What the policy knows about one model beyond its observations."""

    model: str
    sla_ttft_p95_seconds: float
    min_replicas: int
    max_replicas: int | None
    max_reason: str = ""


@dataclass(frozen=True)
class Observation:
    """One evaluation tick's inputs for one model. ``None`` means "not measured"."""

    time: float
    current_replicas: int
    queue_depth: float
    ttft_p95_seconds: float | None = None
    gpu_utilization: float | None = None
    tokens_per_second_per_gpu: float | None = None


@dataclass(frozen=True)
class Decision:
    """What the policy wants for one model now, and why, in words an operator can read."""

    model: str
    time: float
    current: int
    desired: int
    reasons: tuple[str, ...]

    @property
    def direction(self) -> int:
        """+1 to scale up, -1 to scale down, 0 to hold."""
        return (self.desired > self.current) - (self.desired < self.current)


@dataclass(frozen=True)
class DemandHistory:
    """Peak demand per time-of-day slot, one row per day, the newest last."""

    days: tuple[tuple[int, tuple[float | None, ...]], ...] = ()

    def record(self, day: int, slot: int, slots: int, demand: float, keep: int) -> DemandHistory:
        """This history with ``demand`` folded (as a maximum) into ``day``'s ``slot``."""
        rows = list(self.days)
        if not rows or rows[-1][0] != day:
            rows.append((day, (None,) * slots))
        values = list(rows[-1][1])
        old = values[slot]
        values[slot] = demand if old is None else max(old, demand)
        rows[-1] = (day, tuple(values))
        return DemandHistory(tuple(rows[-(keep + 1) :]))

    def expected(self, day: int, slot: int) -> float | None:
        """Mean demand in ``slot`` over the days before ``day`` that recorded it."""
        seen = [
            values[slot]
            for d, values in self.days
            if d < day and slot < len(values) and values[slot] is not None
        ]
        return sum(v for v in seen if v is not None) / len(seen) if seen else None


@dataclass(frozen=True)
class ModelState:
    """Everything the policy remembers about a model between ticks."""

    queue_high_since: float | None = None
    idle_since: float | None = None
    last_change_time: float | None = None
    last_change_direction: int = 0
    last_desired: int | None = None
    history: DemandHistory = field(default_factory=DemandHistory)
    # The queue when the last scale-up was asked for (None: none since the process started).
    queue_at_scale_up: float | None = None


def params_from_config(config: Config, day_seconds: float = 86400.0) -> PolicyParams:
    """The policy's knobs from the ``scaling`` and ``autoscale`` sections."""
    a = config.autoscale
    return PolicyParams(
        scaling=config.scaling,
        predictive=a.predictive,
        target_gpu_utilization=a.target_gpu_utilization,
        slot_seconds=a.history_slot_seconds,
        history_days=a.history_days,
        day_seconds=day_seconds,
    )


def model_limits(config: Config, model: str) -> ModelLimits:
    """SLA and replica bounds of ``model``: min, ``max_replicas`` and the budget cap.

    The budget cap pays for the replicas ``infermeter.pricing`` counts: every replica at the
    model's dearest replica's cost, since the cap must hold whichever replica a scale-up adds.
    The alert rules refuse a cap below one such replica by the same count.
    """
    scaling = config.scaling
    bounds: list[tuple[int, str]] = []
    if scaling.max_replicas is not None:
        bounds.append((scaling.max_replicas, f"max_replicas {scaling.max_replicas}"))
    budget = _budget_bound(config, model)
    if budget is not None:
        bounds.append(budget)
    upper, why = min(bounds) if bounds else (None, "")
    return ModelLimits(
        model=model,
        sla_ttft_p95_seconds=config.model(model).sla.ttft_p95_seconds,
        min_replicas=scaling.min_replicas,
        max_replicas=upper,
        max_reason=why,
    )


def _budget_bound(config: Config, model: str) -> tuple[int, str] | None:
    """The replicas of ``model`` the monthly budget cap pays for, and the sum that says so."""
    cap, cost = config.scaling.monthly_budget_cap_usd, budget_replica_cost(config, model)
    if cap is None or cost is None:
        return None
    paid = replicas_within(cap, cost)
    if paid is None:
        return None
    return paid, (
        f"budget cap ${cap:,.0f}/month pays for {paid} replica(s) at "
        f"${cost.usd_per_month:,.2f}/month each ({cost.explain()})"
    )


def decide(
    params: PolicyParams, limits: ModelLimits, state: ModelState, obs: Observation
) -> tuple[Decision, ModelState]:
    """One tick for one model: the decision and the state to pass to the next tick."""
    s = params.scaling
    now, current = obs.time, obs.current_replicas
    reasons: list[str] = []
    state = _track_timers(s, state, obs)
    step = _scale_up_step(s, limits, state, obs, reasons)
    down = not step and state.queue_high_since is None and _idle_for_long(s, state, obs, reasons)
    base = _in_force(state, current)
    desired = _step_up(current, base, step, reasons) if step else base - 1 if down else base

    history, predicted = _predict(params, state.history, obs)
    if predicted is not None:
        desired = _apply_prediction(params, predicted, base, desired, reasons)
    desired = _keep_pending(s, state, now, current, desired, reasons)
    desired = _cool_down(s, state, now, current, desired, reasons)
    desired = _clamp(limits, desired, reasons)

    previous = state.last_desired if state.last_desired is not None else current
    state = replace(state, history=history)
    if desired != previous:
        state = replace(
            state,
            last_change_time=now,
            last_change_direction=1 if desired > previous else -1,
            idle_since=None,
            queue_at_scale_up=obs.queue_depth if desired > previous else None,
        )
    state = replace(state, last_desired=desired)
    if not reasons:
        reasons.append(_holding(limits, current, desired))
    return Decision(limits.model, now, current, desired, tuple(reasons)), state


def _in_force(state: ModelState, current: int) -> int:
    """The count a rule steps from: the one last asked for, else (first tick) the one seen.

    Not the replicas seen serving: an engine whose page could not be read this tick is not
    evidence that it is gone, nor is one stopping that it is still wanted. As with an HPA, whose
    step is from the scale target's ``spec.replicas``, a missing metric never scales anything
    down; only the idle rule does.
    """
    return state.last_desired if state.last_desired is not None else current


def _step_up(current: int, base: int, step: int, reasons: list[str]) -> int:
    """``step`` more than the replicas seen serving, never less than the count in force.

    Counted from those seen, like an HPA's scale-up (a replica with no metrics counts as idle
    there): replicas asked for and not serving yet are already the answer to the signal.
    """
    if current + step <= base:
        reasons.append(f"holding {base}: {base - current} asked for and not seen serving yet")
        return base
    return current + step


def queue_step(queue_depth: float, threshold: int, bound: int) -> int:
    """Replicas a sustained queue asks for beyond those serving: from 1 to ``bound``.

    ``threshold`` (``scale_up_queue_depth``) is what the model may hold waiting, summed over its
    replicas, and more than it is worth one replica (the rule's meaning since it added one). So
    each further ``threshold`` waiting, or part of it, is one replica more:
    ``ceil((queue - threshold) / threshold)``, which is one just over the threshold, as before,
    and nine at ten times it. A threshold of 0 makes each waiting request a replica's worth.
    Compared before rounding, so a queue no engine could hold cannot overflow the count.
    """
    wanted = (queue_depth - threshold) / max(threshold, 1)
    return bound if wanted >= bound else max(1, math.ceil(wanted))


def scale_up_step_bound(s: ScalingPolicy, current: int) -> int:
    """The most replicas one tick's queue rule may add, ``current`` serving.

    ``max_scale_up_step`` when set, else max(``current``, 4): an HPA's default scale-up policy,
    which at most doubles a fleet, or adds 4 to a small one, per period. A step per tick, not per
    burst: the cool-down holds the next one until the replicas asked for have had time to start.
    """
    if s.max_scale_up_step is not None:
        return s.max_scale_up_step
    return max(current, HPA_MIN_SCALE_UP_STEP)


def _track_timers(s: ScalingPolicy, state: ModelState, obs: Observation) -> ModelState:
    """Start or clear the "queue high since" and "idle since" clocks."""
    queue_since = None
    if obs.queue_depth > s.scale_up_queue_depth:
        queue_since = state.queue_high_since if state.queue_high_since is not None else obs.time
    idle_since = None
    util = obs.gpu_utilization
    if util is not None and util < s.scale_down_gpu_utilization:
        idle_since = state.idle_since if state.idle_since is not None else obs.time
    return replace(state, queue_high_since=queue_since, idle_since=idle_since)


def _scale_up_step(
    s: ScalingPolicy, limits: ModelLimits, state: ModelState, obs: Observation, reasons: list[str]
) -> int:
    """Replicas the scale-up rules ask for beyond those serving (0: none), with their reasons.

    The larger of the two rules' steps: the queue's, proportional to it, and the SLA's one (a
    TTFT p95 says the model is late, not by how many replicas).
    """
    step = 0
    if state.queue_high_since is not None:
        held = obs.time - state.queue_high_since
        if held >= s.scale_up_after_seconds:
            step = _queue_scale_up(s, state, obs, held, reasons)
        else:
            reasons.append(
                f"queue {obs.queue_depth:g} > {s.scale_up_queue_depth} for only {held:.0f} s "
                f"(< {s.scale_up_after_seconds:g} s): waiting"
            )
    ttft = obs.ttft_p95_seconds
    if ttft is not None and ttft > limits.sla_ttft_p95_seconds:
        reasons.append(
            f"TTFT p95 {ttft:.3g} s over the SLA {limits.sla_ttft_p95_seconds:g} s: scale up"
        )
        step = max(step, 1)
    return step


def _queue_scale_up(
    s: ScalingPolicy, state: ModelState, obs: Observation, held: float, reasons: list[str]
) -> int:
    """The sustained-queue rule's step, and the reason that shows its sum.

    A queue below what it was when the last scale-up was asked for is draining: the replicas
    added are catching up with it, and what is left of it says nothing of how many more are
    needed, so it adds one replica, as the rule did before its step was in proportion.
    """
    draining = state.queue_at_scale_up is not None and obs.queue_depth < state.queue_at_scale_up
    if draining:
        reasons.append(
            f"queue {obs.queue_depth:g} > {s.scale_up_queue_depth} for {held:.0f} s "
            f"(>= {s.scale_up_after_seconds:g} s), down from {state.queue_at_scale_up:g} at the "
            f"last scale-up: scale up to {obs.current_replicas + 1} (one while it drains)"
        )
        return 1
    bound = scale_up_step_bound(s, obs.current_replicas)
    step = queue_step(obs.queue_depth, s.scale_up_queue_depth, bound)
    depth, serving = s.scale_up_queue_depth, obs.current_replicas
    why = f"one per {depth} waiting beyond {depth}" if depth else "one per request waiting"
    if step == bound and queue_step(obs.queue_depth, depth, bound + 1) > bound:
        limit = (
            f"max_scale_up_step {bound}"
            if s.max_scale_up_step is not None
            else f"max({serving} serving, {HPA_MIN_SCALE_UP_STEP})"
        )
        why += f", at most {limit} a tick"
    reasons.append(
        f"queue {obs.queue_depth:g} > {depth} for {held:.0f} s "
        f"(>= {s.scale_up_after_seconds:g} s): scale up to {serving + step} "
        f"({serving} serving + {step}: {why})"
    )
    return step


def _idle_for_long(
    s: ScalingPolicy, state: ModelState, obs: Observation, reasons: list[str]
) -> bool:
    if state.idle_since is None or obs.gpu_utilization is None:
        return False
    held = obs.time - state.idle_since
    util = f"GPU utilization {obs.gpu_utilization:.0%} < {s.scale_down_gpu_utilization:.0%}"
    if obs.tokens_per_second_per_gpu is not None:
        util += f" ({obs.tokens_per_second_per_gpu:.0f} tokens/s per GPU)"
    if held >= s.scale_down_after_seconds:
        reasons.append(f"{util} for {held:.0f} s: scale down")
        return True
    return False


def _predict(
    params: PolicyParams, history: DemandHistory, obs: Observation
) -> tuple[DemandHistory, int | None]:
    """Record this tick's demand; the replicas previous days needed ``startup_seconds`` ahead."""
    slots = max(1, round(params.day_seconds / params.slot_seconds))

    def where(t: float) -> tuple[int, int]:
        day = math.floor(t / params.day_seconds)
        slot = min(slots - 1, int((t - day * params.day_seconds) / params.slot_seconds))
        return day, slot

    if obs.gpu_utilization is not None:
        demand = obs.current_replicas * obs.gpu_utilization
        history = history.record(*where(obs.time), slots, demand, params.history_days)
    if not params.predictive:
        return history, None
    expected = history.expected(*where(obs.time + params.scaling.startup_seconds))
    if expected is None:
        return history, None
    return history, math.ceil(expected / params.target_gpu_utilization - 1e-9)


def _apply_prediction(
    params: PolicyParams, predicted: int, base: int, desired: int, reasons: list[str]
) -> int:
    ahead = params.scaling.startup_seconds
    if predicted > desired and predicted > base:
        reasons.append(
            f"previous days needed {predicted} replica(s) {ahead:g} s from now (start-up time): "
            "scale up ahead"
        )
        return predicted
    if desired < base <= predicted:
        reasons.append(
            f"not scaling down: previous days needed {predicted} replica(s) {ahead:g} s from now"
        )
        return base
    return desired


def _keep_pending(
    s: ScalingPolicy, state: ModelState, now: float, current: int, desired: int, reasons: list[str]
) -> int:
    """Do not cancel a scale-up whose replicas are still starting."""
    if (
        state.last_desired is not None
        and current < state.last_desired
        and state.last_change_direction > 0
        and state.last_change_time is not None
        and now - state.last_change_time < s.startup_seconds
        and desired < state.last_desired
    ):
        reasons.append(
            f"keeping {state.last_desired}: replicas asked for "
            f"{now - state.last_change_time:.0f} s ago are still starting"
        )
        return state.last_desired
    return desired


def _cool_down(
    s: ScalingPolicy, state: ModelState, now: float, current: int, desired: int, reasons: list[str]
) -> int:
    if state.last_change_time is None or now - state.last_change_time >= s.cooldown_seconds:
        return desired
    since = now - state.last_change_time
    left = s.cooldown_seconds - since
    held = state.last_desired if state.last_desired is not None else current
    if desired < held or (desired > held and state.last_change_direction > 0):
        if desired < current or desired > held:
            word = "down" if desired < held else "up again"
            reasons.append(
                f"cool-down: last change {since:.0f} s ago; not scaling {word} to {desired} "
                f"for {left:.0f} s more"
            )
        return held
    return desired


def _clamp(limits: ModelLimits, desired: int, reasons: list[str]) -> int:
    if desired < limits.min_replicas:
        reasons.append(f"raised to min_replicas {limits.min_replicas}")
        desired = limits.min_replicas
    if limits.max_replicas is not None and desired > limits.max_replicas:
        reasons.append(f"capped at {limits.max_replicas}: {limits.max_reason}")
        desired = limits.max_replicas
    if desired > MAX_SCALED_REPLICAS:
        # Without max_replicas or a budget cap, a queue step doubling the fleet every cool-down
        # would pass the count billing keeps and the history file holds (0..10,000).
        reasons.append(f"capped at {MAX_SCALED_REPLICAS:,}: the most a decision may ask for")
        desired = MAX_SCALED_REPLICAS
    return desired


def _holding(limits: ModelLimits, current: int, desired: int) -> str:
    """Why a tick with no rule to apply asks for ``desired`` when ``current`` are seen serving."""
    if limits.max_replicas is not None and current > limits.max_replicas == desired:
        return f"capped at {limits.max_replicas}: {limits.max_reason}"
    if current < limits.min_replicas == desired:
        return f"raised to min_replicas {limits.min_replicas}"
    if current < desired:
        return (
            f"holding {desired}: {current} seen serving (a replica whose page was not read "
            "this tick is not taken as gone)"
        )
    if current > desired:
        return f"holding {desired}: {current} seen serving (those asked away may be stopping)"
    return f"holding {desired}: every signal within its bounds"


def evaluate(
    params: PolicyParams,
    limits: Mapping[str, ModelLimits],
    states: Mapping[str, ModelState],
    observations: Mapping[str, Observation],
) -> tuple[dict[str, Decision], dict[str, ModelState]]:
    """One tick for every observed model; models not observed keep their state."""
    decisions: dict[str, Decision] = {}
    next_states = dict(states)
    for model, obs in observations.items():
        if model not in limits:
            continue
        decision, next_states[model] = decide(
            params, limits[model], states.get(model, ModelState()), obs
        )
        decisions[model] = decision
    return decisions, next_states
