"""The scaling policy, one rule per test, driven by sequences of observations."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from alerts.autoscale.policy import (
    Decision,
    DemandHistory,
    ModelLimits,
    ModelState,
    Observation,
    PolicyParams,
    decide,
    model_limits,
    params_from_config,
)
from alerts.rules import check
from infermeter.config import DEFAULT_CONFIG, Config, ConfigError, ScalingPolicy, load_config

SCALING = ScalingPolicy()  # the users' policy: min 2, queue > 10 for 30 s, util < 30% for 5 min
PARAMS = PolicyParams(scaling=SCALING, predictive=False)
LIMITS = ModelLimits("chat", sla_ttft_p95_seconds=1.0, min_replicas=2, max_replicas=None)


def obs(
    t: float, current: int = 3, queue: float = 0, ttft: float | None = 0.2, util: float | None = 0.6
) -> Observation:
    return Observation(t, current, queue, ttft, util, 900.0)


def run(
    observations: Iterable[Observation],
    params: PolicyParams = PARAMS,
    limits: ModelLimits = LIMITS,
    state: ModelState | None = None,
) -> tuple[list[Decision], ModelState]:
    state = state or ModelState()
    decisions = []
    for o in observations:
        decision, state = decide(params, limits, state, o)
        decisions.append(decision)
    return decisions, state


def test_a_brief_queue_does_not_scale_up():
    """A queue above the threshold for less than 30 s leaves the replicas alone."""
    decisions, _ = run([obs(0, queue=50), obs(15, queue=50), obs(25, queue=50), obs(40, queue=0)])
    assert [d.desired for d in decisions] == [3, 3, 3, 3]
    assert "waiting" in decisions[1].reasons[0]


def test_a_sustained_queue_scales_up_by_one():
    """A queue above 10 for 30 s asks for one more replica, and says why."""
    decisions, _ = run([obs(0, queue=11), obs(15, queue=12), obs(30, queue=12)])
    assert [d.desired for d in decisions] == [3, 3, 4]
    assert "queue 12 > 10 for 30 s" in decisions[-1].reasons[0]


@pytest.mark.parametrize(
    ("current", "queue", "desired"),
    [
        (10, 100, 19),  # ten times the threshold: nine thresholds' worth beyond it, at once
        (10, 101, 20),  # part of a further threshold's worth is a replica more
        (10, 20, 11),  # up to twice the threshold: one, as before
        (10, 21, 12),
        (4, 40.5, 8),  # a fractional queue (Prometheus's sum) rounds up
    ],
)
def test_a_sustained_queue_asks_for_replicas_in_proportion_to_it(current, queue, desired):
    """One replica per ``scale_up_queue_depth`` waiting beyond it, in one tick, from those serving."""
    decisions, _ = run(
        [obs(0, current=current, queue=queue), obs(30, current=current, queue=queue)]
    )
    assert [d.desired for d in decisions] == [current, desired]
    step = desired - current
    assert (
        f"queue {queue:g} > 10 for 30 s (>= 30 s): scale up to {desired} "
        f"({current} serving + {step}: one per 10 waiting beyond 10)"
    ) in decisions[-1].reasons


@pytest.mark.parametrize(
    ("current", "step"),
    # An HPA's default scale-up policy: at most max(100% of the replicas, 4) per period.
    [(2, 4), (3, 4), (4, 4), (6, 6), (12, 12)],
)
def test_the_queue_step_is_at_most_max_of_the_replicas_serving_and_4(current, step):
    """A backlog of hundreds adds at most max(serving, 4) replicas in a tick, and says so."""
    decisions, _ = run([obs(0, current=current, queue=900), obs(30, current=current, queue=900)])
    assert decisions[-1].desired == current + step
    assert f"at most max({current} serving, 4) a tick" in decisions[-1].reasons[0]


@pytest.mark.parametrize(("bound", "desired"), [(1, 4), (2, 5), (50, 12)])
def test_max_scale_up_step_bounds_the_queue_step(bound, desired):
    """``max_scale_up_step`` replaces the default bound; 1 is the rule as it was (one a tick)."""
    params = replace(PARAMS, scaling=SCALING.model_copy(update={"max_scale_up_step": bound}))
    decisions, _ = run([obs(0, queue=100), obs(30, queue=100)], params=params)
    assert decisions[-1].desired == desired
    capped = f"at most max_scale_up_step {bound} a tick"
    assert (capped in decisions[-1].reasons[0]) == (bound < 9)


def test_a_ttft_breach_beside_a_sustained_queue_takes_the_queue_step():
    """The two scale-up rules do not add up: the larger step, the queue's, is asked for."""
    decisions, _ = run([obs(0, current=10, queue=50), obs(30, current=10, queue=50, ttft=3.0)])
    assert decisions[-1].desired == 14
    assert any("TTFT p95 3 s over the SLA" in r for r in decisions[-1].reasons)


def test_a_proportional_step_is_clamped_to_max_replicas_and_the_budget():
    """A queue asking for 4 more than 6 serving gets the 8 the bound allows, and says why."""
    limits = replace(LIMITS, max_replicas=8, max_reason="budget cap pays for 8")
    decisions, _ = run([obs(0, current=6, queue=50), obs(30, current=6, queue=50)], limits=limits)
    assert decisions[-1].desired == 8
    assert "capped at 8: budget cap pays for 8" in decisions[-1].reasons


def test_no_step_asks_for_more_than_ten_thousand_replicas():
    """Without max_replicas, 6,000 serving and a long queue ask for the 10,000 billing keeps."""
    decisions, _ = run([obs(0, current=6000, queue=1e9), obs(30, current=6000, queue=1e9)])
    assert decisions[-1].desired == 10_000
    assert "capped at 10,000: the most a decision may ask for" in decisions[-1].reasons


def test_a_proportional_step_waits_out_the_cool_down_then_steps_again():
    """After 3 -> 7 the queue holds 7 for cool-down's 180 s, then steps from those serving."""
    held = [obs(t, current=c, queue=500) for t, c in [(0, 3), (30, 3), (90, 3), (180, 5)]]
    decisions, _ = run([*held, obs(210, current=7, queue=500)])
    assert [d.desired for d in decisions] == [3, 7, 7, 7, 14]
    assert any("cool-down: last change 150 s ago" in r for r in decisions[3].reasons)


def test_a_proportional_step_counts_the_replicas_still_starting():
    """Ten asked for, three serving: a queue asking for four more holds the ten."""
    state = ModelState(last_change_time=0.0, last_change_direction=1, last_desired=10)
    decisions, _ = run(
        [obs(10_000, current=3, queue=50), obs(10_030, current=3, queue=50)], state=state
    )
    assert [d.desired for d in decisions] == [10, 10]
    assert "holding 10: 7 asked for and not seen serving yet" in decisions[-1].reasons


def test_a_queue_draining_since_the_last_scale_up_adds_one_replica_at_a_time():
    """3 -> 7 on a queue of 500; after the cool-down the queue is down to 300, above the
    threshold still, but draining: one replica more, not the step of 300 waiting, which the
    replicas just added would have made an overshoot."""
    held = [obs(t, current=c, queue=500) for t, c in [(0, 3), (30, 3), (90, 3), (180, 5)]]
    decisions, state = run([*held, obs(210, current=7, queue=300)])
    assert [d.desired for d in decisions] == [3, 7, 7, 7, 8]
    assert (
        "queue 300 > 10 for 210 s (>= 30 s), down from 500 at the last scale-up: "
        "scale up to 8 (one while it drains)"
    ) in decisions[-1].reasons
    assert state.queue_at_scale_up == 300


def test_a_queue_grown_since_the_last_scale_up_gets_the_whole_step_again():
    """The same, but the queue grew to 700: the replicas added did not catch up, the step is in
    proportion again (max(7 serving, 4) here)."""
    held = [obs(t, current=c, queue=500) for t, c in [(0, 3), (30, 3), (90, 3), (180, 5)]]
    decisions, _ = run([*held, obs(210, current=7, queue=700)])
    assert decisions[-1].desired == 14


def test_a_scale_down_forgets_the_queue_of_the_last_scale_up():
    """A scale-up on a queue of 500, then an idle scale-down: a queue of 100 afterwards is
    judged afresh, the step in proportion to it (below 500, it would have been one)."""
    state = ModelState(
        last_change_time=0.0, last_change_direction=1, last_desired=4, queue_at_scale_up=500
    )
    idle = [obs(t, current=4, util=0.1) for t in (1_000, 1_150, 1_300)]
    busy = [obs(t, current=3, queue=100) for t in (1_330, 1_360)]
    decisions, _ = run([*idle, *busy], state=state)
    assert [d.desired for d in decisions] == [4, 4, 3, 3, 7]


def test_a_threshold_of_zero_counts_each_waiting_request_as_a_replica():
    """``scale_up_queue_depth: 0`` has no threshold's worth to divide by: one replica a request."""
    params = replace(PARAMS, scaling=SCALING.model_copy(update={"scale_up_queue_depth": 0}))
    decisions, _ = run([obs(0, queue=2), obs(30, queue=2)], params=params)
    assert decisions[-1].desired == 5
    assert "(3 serving + 2: one per request waiting)" in decisions[-1].reasons[0]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "scaling.max_scale_up_step = 0: Input should be greater than 0"),
        (-4, "scaling.max_scale_up_step = -4: Input should be greater than 0"),
        (10_001, "scaling.max_scale_up_step = 10001: Input should be less than or equal to 10000"),
        (2.5, "scaling.max_scale_up_step = 2.5: Input should be a valid integer"),
        ("many", "scaling.max_scale_up_step = 'many': Input should be a valid integer"),
    ],
)
def test_a_bad_max_scale_up_step_names_the_file_key_and_value(tmp_path, value, message):
    """The new key is refused like the other scaling keys: file, key, value and why."""
    path = _config_file(tmp_path, value)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_max_scale_up_step_reaches_the_policy(tmp_path):
    """A valid ``scaling.max_scale_up_step`` is what the policy's parameters carry; unset, None."""
    params = params_from_config(load_config(_config_file(tmp_path, 3), environ={}))
    assert params.scaling.max_scale_up_step == 3
    assert (
        params_from_config(load_config(DEFAULT_CONFIG, environ={})).scaling.max_scale_up_step
        is None
    )


def _config_file(tmp_path: Path, max_scale_up_step: object) -> Path:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["scaling"]["max_scale_up_step"] = max_scale_up_step
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_queue_at_the_threshold_is_not_over_it():
    """Exactly ``scale_up_queue_depth`` waiting is not a reason to scale."""
    decisions, _ = run(obs(t, queue=10) for t in range(0, 120, 15))
    assert {d.desired for d in decisions} == {3}


def test_a_ttft_breach_scales_up_at_once():
    """TTFT p95 over the model's SLA asks for a replica on the first tick."""
    decisions, _ = run([obs(0, ttft=1.4)])
    assert decisions[0].desired == 4
    assert "TTFT p95 1.4 s over the SLA 1 s" in decisions[0].reasons[0]


def test_idle_for_five_minutes_scales_down():
    """Utilization under 30% for 300 s removes one replica, not before."""
    decisions, _ = run(obs(t, current=4, util=0.1) for t in range(0, 301, 30))
    assert [d.desired for d in decisions[:-1]] == [4] * 10
    assert decisions[-1].desired == 3
    assert "GPU utilization 10% < 30% (900 tokens/s per GPU) for 300 s" in decisions[-1].reasons[0]


def test_a_busy_tick_restarts_the_idle_clock():
    """One tick above 30% in the five minutes means no scale-down at 300 s."""
    utils = [0.1] * 5 + [0.5] + [0.1] * 5
    decisions, _ = run(obs(30 * i, current=4, util=u) for i, u in enumerate(utils))
    assert {d.desired for d in decisions} == {4}


def test_cool_down_blocks_a_scale_down_right_after_a_scale_up():
    """After a scale-up, idleness cannot scale down for 180 s: no flapping."""
    up, state = run([obs(0, ttft=2.0)])
    assert up[0].desired == 4
    # The new replica is ready; the load vanished at once (idle for 5 min would scale down).
    state = replace(state, idle_since=-1000.0)
    decisions, _ = run([obs(60, current=4, util=0.05), obs(120, current=4, util=0.05)], state=state)
    assert [d.desired for d in decisions] == [4, 4]
    assert any("cool-down" in r for r in decisions[0].reasons)
    later, _ = run([obs(200, current=4, util=0.05)], state=replace(state, idle_since=-1000.0))
    assert later[0].desired == 3


def test_cool_down_blocks_a_second_scale_up_while_the_first_starts():
    """A breach that persists while the new replica starts does not add another one."""
    decisions, _ = run([obs(0, ttft=2.0), obs(30, ttft=2.0), obs(150, ttft=2.0)])
    assert [d.desired for d in decisions] == [4, 4, 4]
    after, _ = run([obs(0, ttft=2.0), obs(190, current=4, ttft=2.0)])
    assert after[-1].desired == 5


def test_a_scale_up_right_after_a_scale_down_is_allowed():
    """A latency breach just after a scale-down is not held back by the cool-down."""
    state = ModelState(last_change_time=0.0, last_change_direction=-1, last_desired=3)
    decisions, _ = run([obs(30, current=3, ttft=3.0)], state=state)
    assert decisions[0].desired == 4


ASKED_FOR_4_LONG_AGO = ModelState(last_change_time=0.0, last_change_direction=1, last_desired=4)


@pytest.mark.parametrize("seen", [3, 0])
def test_a_replica_whose_page_was_not_read_is_not_scaled_away(seen):
    """Fewer replicas seen than asked for, every signal in bounds: the count asked for holds."""
    decisions, _ = run([obs(10_000, current=seen)], state=ASKED_FOR_4_LONG_AGO)
    assert decisions[0].desired == 4
    assert decisions[0].reasons == (
        f"holding 4: {seen} seen serving (a replica whose page was not read this tick is not "
        "taken as gone)",
    )


def test_idle_scales_down_one_from_the_count_asked_for_not_from_the_count_seen():
    """One of four unread while the fleet is idle: 4 -> 3, not 4 -> 2."""
    state = replace(ASKED_FOR_4_LONG_AGO, idle_since=9_000.0)
    decisions, _ = run([obs(10_000, current=3, util=0.1)], state=state)
    assert decisions[0].desired == 3


def test_a_scale_up_not_serving_yet_is_not_cancelled_when_its_start_up_is_over():
    """A replica slower to start than ``startup_seconds`` is still asked for, not cancelled."""
    decisions, _ = run([obs(0, ttft=2.0), obs(200, current=3), obs(400, current=3)])
    assert [d.desired for d in decisions] == [4, 4, 4]


def test_a_scale_up_counts_from_the_replicas_seen_serving():
    """A breach while the replicas asked for are not all serving asks for none beyond them."""
    decisions, _ = run([obs(10_000, current=2, ttft=2.0)], state=ASKED_FOR_4_LONG_AGO)
    assert decisions[0].desired == 4
    assert "holding 4: 2 asked for and not seen serving yet" in decisions[0].reasons


@pytest.mark.parametrize(
    ("current", "signal", "limits", "expected", "reason"),
    [
        (2, {"util": 0.05}, LIMITS, 2, None),
        (1, {}, LIMITS, 2, "raised to min_replicas 2"),
        (
            6,
            {"ttft": 3.0},
            replace(LIMITS, max_replicas=6, max_reason="max_replicas 6"),
            6,
            "capped at 6: max_replicas 6",
        ),
        (2, {}, replace(LIMITS, max_replicas=1, max_reason="budget"), 1, "capped at 1: budget"),
    ],
)
def test_min_max_and_budget_clamp(current, signal, limits, expected, reason):
    """The result stays within min_replicas and the max (budget) bound; the budget wins."""
    observations = [obs(t, current=current, **signal) for t in range(0, 601, 60)]
    decisions, _ = run(observations, limits=limits)
    assert decisions[-1].desired == expected
    if reason:
        assert any(reason in r for r in decisions[-1].reasons)


def test_model_limits_read_the_config(config: Config) -> None:
    """Limits come from the model's SLA, min_replicas, max_replicas and the budget cap."""
    scaling = config.scaling.model_copy(update={"monthly_budget_cap_usd": 60_000.0})
    config = config.model_copy(update={"scaling": scaling})
    large = model_limits(config, "chat-large")
    assert (large.sla_ttft_p95_seconds, large.min_replicas, large.max_replicas) == (1.5, 2, 10)
    assert "budget cap" in large.max_reason
    scaling = scaling.model_copy(update={"max_replicas": 4})
    small = model_limits(config.model_copy(update={"scaling": scaling}), "chat-small")
    assert (small.max_replicas, small.max_reason) == (4, "max_replicas 4")


def _mixed_fleet(config: Config, cap: float) -> Config:
    """The demo fleet with a third chat-small replica on 2 H100s, and a monthly budget cap."""
    data = config.model_dump(mode="json")
    data["replicas"].append(
        {
            "id": "small-h100",
            "model": "chat-small",
            "node": "node-a",
            "upstream_url": "http://127.0.0.1:18004",
            "gpu_model": "H100",
            "gpu_count": 2,
        }
    )
    data["scaling"]["monthly_budget_cap_usd"] = cap
    return Config.model_validate(data)


@pytest.mark.parametrize(
    ("cap", "paid"),
    # 1168 USD is an L40S replica's month, 5694 USD an H100 pair's: a cap between them pays for
    # a cheap replica but not for whichever replica a scale-up adds.
    [(1000, 0), (1168, 0), (3000, 0), (5693.99, 0), (5694, 1), (12_000, 2), (60_000, 10)],
)
def test_the_rules_check_and_the_policy_cap_agree_on_a_mixed_price_model(config, cap, paid):
    """A model on L40S and H100 replicas: the rules refuse exactly the caps the policy holds at 0."""
    mixed = _mixed_fleet(config, cap)
    limits = model_limits(mixed, "chat-small")
    refused = [p for p in check(mixed) if "'chat-small'" in p]
    assert limits.max_replicas == paid
    assert bool(refused) == (paid == 0)
    dearest = "(2 x H100 at 3.90 USD/GPU-hour x 730 h"
    assert dearest in limits.max_reason
    assert all(dearest in p for p in refused)


def _day(util_by_hour: dict[int, float], day: int, current: int = 4) -> list[Observation]:
    return [
        obs(day * 86400 + minute * 60, current=current, util=util_by_hour.get(minute // 60, 0.1))
        for minute in range(24 * 60)
    ]


def test_predictive_term_scales_ahead_of_yesterdays_peak():
    """Yesterday's 10:00 demand brings replicas up startup_seconds before 10:00 today."""
    params = replace(PARAMS, predictive=True)
    # Yesterday, 4 replicas were 100% busy from 10:00 to 11:00: 4 / 0.7 -> 6 needed.
    _, state = run(_day({10: 1.0}, day=0), params=params)
    state = replace(state, idle_since=None, last_change_time=None, last_desired=None)
    today = [obs(86400 + 10 * 3600 + dt, current=2, util=0.1) for dt in (-240, -180, -120)]
    decisions, _ = run(today, params=params, state=state)
    assert decisions[0].desired == 2  # 4 minutes ahead: not yet
    assert decisions[1].desired == 6  # 180 s (the start-up time) ahead
    assert "previous days needed 6 replica(s) 180 s from now" in decisions[1].reasons[0]


def test_predictive_term_vetoes_a_scale_down_before_the_peak():
    """Idle at 09:57 does not scale down when yesterday's 10:00 needed these replicas."""
    params = replace(PARAMS, predictive=True)
    _, state = run(_day({10: 1.0}, day=0), params=params)
    state = replace(state, idle_since=86400 + 9 * 3600, last_change_time=None, last_desired=6)
    decisions, _ = run([obs(86400 + 10 * 3600 - 170, current=6, util=0.1)], params, state=state)
    assert decisions[0].desired == 6
    assert any("not scaling down" in r for r in decisions[0].reasons)


def test_without_history_the_predictive_term_is_silent():
    """On the first day there is nothing to predict from, and the reactive rules alone act."""
    params = replace(PARAMS, predictive=True)
    decisions, _ = run([obs(36000, util=0.5)], params=params)
    assert decisions[0].desired == 3
    assert decisions[0].reasons == ("holding 3: every signal within its bounds",)


def test_history_keeps_the_peak_of_each_slot_and_averages_days():
    """A slot holds the day's maximum; the expectation is the mean over earlier days only."""
    h = DemandHistory().record(0, 3, 96, 2.0, keep=7).record(0, 3, 96, 5.0, keep=7)
    h = h.record(0, 3, 96, 1.0, keep=7).record(1, 3, 96, 3.0, keep=7)
    assert h.expected(1, 3) == 5.0
    assert h.expected(2, 3) == 4.0
    assert h.expected(2, 4) is None


def test_state_is_returned_not_mutated():
    """decide() leaves the state it was given untouched and returns a new one."""
    state = ModelState()
    _, after = decide(PARAMS, LIMITS, state, obs(0, queue=50))
    assert state == ModelState()
    assert after.queue_high_since == 0
