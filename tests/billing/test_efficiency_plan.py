"""The plan on small replayed worlds: what it vouches for, what it offers, how it prices it."""

from __future__ import annotations

import pytest

from billing.efficiency.advice import Policy
from billing.efficiency.changes import (
    Facts,
    batch_candidates,
    kv_capacity_tokens,
    off_peak_candidates,
    propose,
    route_candidates,
    sizing_notes,
)
from billing.efficiency.plan import GroupMeasured, Inputs, Target, World, build_plan, judge
from billing.efficiency.replay import Arrival, GroupSetup, ModelReplay, ModelSetup, Run, replay
from infermeter.config import EngineProfile, ModelArchitecture

H, DAY = 3600.0, 86400.0
PROFILE = EngineProfile(
    max_num_seqs=16,
    kv_cache_tokens=100_000,
    step_base_ms=10,
    step_per_seq_ms=1,
    prefill_tokens_per_second=10_000,
)
LLAMA_70B = ModelArchitecture(
    params_billions=70, layers=80, kv_heads=8, head_dim=128, precision="fp8"
)


def _model(
    name: str,
    engines: int,
    per_hour: float = 60,
    usd: float = 1.60,
    gpus: int = 1,
    team: str = "search",
) -> tuple[ModelSetup, list[Arrival]]:
    """``engines`` replicas of one GPU all day, and a request every minute of 100 in, 20 out."""
    groups = tuple(
        GroupSetup(f"{name}-{k}", name, "L40S", gpus, usd, PROFILE, False) for k in range(engines)
    )
    runs = tuple(Run(g.replica, g.replica, 0, DAY, 0) for g in groups)
    every = H / per_hour
    arrivals = [Arrival(k * every + 1, team, name, 100, 20) for k in range(int(DAY / every))]
    return ModelSetup(name, groups, runs), arrivals


def _inputs(
    *models: tuple[ModelSetup, list[Arrival]],
    min_replicas: int = 1,
    gpu_scale: float = 1.0,
    ttft: float | None = None,
) -> Inputs:
    """What the plan reads, measured as the replay as it ran finds it (GPU time x ``gpu_scale``)."""
    world = World({m.model: m for m, _ in models}, {m.model: a for m, a in models})
    measured = {}
    for setup, arrivals in models:
        r = replay(setup, arrivals, 0, DAY)
        for g in setup.groups:
            seconds = r.gpu_seconds[g.replica] * gpu_scale
            measured[g.replica] = GroupMeasured(
                g.replica,
                setup.model,
                seconds,
                seconds / H * g.usd_per_gpu_hour,
                ttft if ttft is not None else r.ttft_p95(group=g.replica),
                r.itl_p95(group=g.replica),
                0,
            )
    targets = {(m.model, ""): Target(0.5, 1 / 30) for m, _ in models}
    return Inputs(0, DAY, 24, world, measured, targets, min_replicas, Policy())


def _facts(inputs: Inputs, **kw: object) -> Facts:
    base: dict[str, object] = {
        "architectures": {},
        "use_cases": {},
        "served_versions": {},
        "max_model_len": {},
        "workloads": {},
        "engines": {},
        "measured": inputs.measured,
        "policy": inputs.policy,
    }
    return Facts(**(base | kw))  # type: ignore[arg-type]


def _plan(inputs: Inputs, **facts: object):  # type: ignore[no-untyped-def]
    return build_plan(inputs, propose(_facts(inputs, **facts)))


def test_an_over_provisioned_model_is_right_sized_by_its_replay():
    """Three replicas whose load one holds: run one; the saving is two replicas' day."""
    plan = _plan(_inputs(_model("m", 3)))
    [rec] = plan.recommendations
    assert (rec.kind, rec.change["engines_by_hour"]) == ("right_size", [1] * 24)
    assert rec.saving_usd == pytest.approx(2 * 24 * 1.60)
    assert rec.saving_usd_per_month == pytest.approx(2 * 1.60 * 730)
    assert all(row["holds"] for row in rec.replay["m"]["sla_after"])


def test_min_replicas_floors_every_hour():
    """With min_replicas 3, three replicas whose load one holds are left alone."""
    plan = _plan(_inputs(_model("m", 3), min_replicas=3))
    assert plan.recommendations == ()


def test_a_group_whose_gpu_hours_are_off_the_replay_is_not_vouched_for():
    """GPU time measured 10 % above the replay's: the advisor says it cannot vouch, offers nothing."""
    plan = _plan(_inputs(_model("m", 3), gpu_scale=1.10))
    assert plan.recommendations == ()
    assert {(n.kind, n.replica) for n in plan.notes} == {
        ("cannot_vouch", f"m-{k}") for k in range(3)
    }
    assert "GPU-hours" in plan.notes[0].text
    assert _plan(_inputs(_model("m", 3), gpu_scale=1.04)).recommendations != ()


def test_a_ttft_far_from_the_measured_one_is_not_vouched_for():
    """A measured TTFT p95 of 0.3 s the replay (21 ms) is far from: nothing is offered."""
    plan = _plan(_inputs(_model("m", 3), ttft=0.3))
    assert plan.recommendations == ()
    assert "TTFT p95" in plan.notes[0].text


def test_the_plan_never_saves_more_than_was_measured():
    """Measured 4 % below the replay as it ran: the saving is measured minus the replayed change."""
    inputs = _inputs(_model("m", 3), gpu_scale=0.96)
    [rec] = _plan(inputs).recommendations
    measured = sum(m.gpu_usd for m in inputs.measured.values())
    assert rec.saving_usd == pytest.approx(measured - 24 * 1.60)
    assert rec.saving_usd < 2 * 24 * 1.60


def test_the_changes_savings_add_up_to_the_plans():
    """Two over-provisioned models: each change priced on its own model, the plan their sum."""
    plan = _plan(_inputs(_model("a", 2), _model("b", 4)))
    assert sorted((r.model, r.saving_usd) for r in plan.recommendations) == [
        ("a", pytest.approx(24 * 1.60)),
        ("b", pytest.approx(3 * 24 * 1.60)),
    ]
    assert plan.saving_usd == pytest.approx(4 * 24 * 1.60)
    assert plan.saving_usd <= plan.measured_usd


def test_an_sla_is_held_only_with_the_policys_margin():
    """A p95 within its target but not 10 % under it does not hold."""
    r = replay(*_model("m", 1)[:1], _model("m", 1)[1], 0, DAY)
    ttft = r.ttft_p95()
    assert ttft is not None
    [row] = judge(r, lambda team: Target(ttft / 0.95, None), 0.10)
    assert not row["holds"]
    [row] = judge(r, lambda team: Target(ttft / 0.85, None), 0.10)
    assert row["holds"]


def test_kv_capacity_follows_the_capacity_planner():
    """70B at FP8 on two H100s leaves (2 x 71 GB / 1.1 - 70 GB) of 16-bit KV; at int4 on one,
    (71 / 1.1 - 35) GB: 327,680 bytes a token."""
    per_token = 2 * 80 * 8 * 128 * 2 / 1e9
    assert kv_capacity_tokens(LLAMA_70B, "fp8", 2, 80) == pytest.approx(
        (142 / 1.1 - 70) / per_token
    )
    assert kv_capacity_tokens(LLAMA_70B, "int4", 1, 80) == pytest.approx(
        (71 / 1.1 - 35) / per_token
    )
    assert kv_capacity_tokens(LLAMA_70B, "fp8", 1, 80) == 0.0  # the weights alone do not fit


def test_a_model_without_its_architecture_gets_no_memory_advice_and_says_why():
    """A model on two GPUs an engine but no models[].architecture: a note, no guess from its name."""
    inputs = _inputs(_model("llama-3.1-70b-instruct", 1, gpus=2))
    [note] = sizing_notes(inputs.world, _facts(inputs))
    assert (note.kind, note.model) == ("cannot_size", "llama-3.1-70b-instruct")
    assert "does not guess" in note.text
    with_arch = _facts(inputs, architectures={"llama-3.1-70b-instruct": LLAMA_70B})
    assert sizing_notes(inputs.world, with_arch) == []


def test_short_requests_go_to_a_smaller_model_of_the_same_use_case():
    """Routing picks the smaller model by architecture, never one of another use case."""
    inputs = _inputs(_model("large", 1), _model("small", 1), _model("embed", 1))
    arch = {"large": LLAMA_70B, "small": LLAMA_70B.model_copy(update={"params_billions": 8})}
    facts = _facts(
        inputs,
        architectures=arch,
        use_cases={"large": "chat", "small": "chat", "embed": "embeddings"},
    )
    [cand] = route_candidates(inputs.world, facts)
    assert (cand.model, cand.change["route"]["to"], cand.models) == (
        "large",
        "small",
        ("large", "small"),
    )
    moved = cand.apply(inputs.world)
    assert (len(moved.arrivals["large"]), len(moved.arrivals["small"])) == (0, 2 * 1440)


def test_batch_work_in_the_peak_is_proposed_for_the_quietest_hours_after():
    """analytics' unstreamed requests in the 10:00 peak move to the quietest hour; an
    interactive team's never do."""
    setup, arrivals = _model("m", 1, per_hour=1)
    peak = [Arrival(10 * H + k, "analytics", "m", 100, 20, stream=False) for k in range(40)]
    inputs = _inputs((setup, sorted([*arrivals, *peak], key=lambda a: a.t)))
    r = replay(setup, inputs.world.arrivals["m"], 0, DAY)
    r.peak_in_engines[10] = 40.0  # the peak needs 3 engines of 16, every other hour one
    facts = _facts(inputs, workloads={"analytics": "auto", "search": "auto"})
    [cand] = off_peak_candidates(inputs.world, facts, {"m": r})
    assert (cand.kind, cand.team, cand.evidence["peak_hours"]) == (
        "off_peak",
        "analytics",
        ["10:00-11:00"],
    )
    moved = [a for a in cand.apply(inputs.world).arrivals["m"] if a.team == "analytics"]
    assert all(int(a.t // H) % 24 != 10 for a in moved)
    interactive = _facts(inputs, workloads={"analytics": "interactive"})
    assert off_peak_candidates(inputs.world, interactive, {"m": r}) == []


def test_replays_of_a_world_are_judged_per_team():
    """Each team's row has its own p95s and targets."""
    r: ModelReplay = replay(*_model("m", 1)[:1], _model("m", 1)[1], 0, DAY)
    rows = judge(r, lambda team: Target(0.5, 1 / 30), 0.10)
    assert [(row["team"], row["holds"]) for row in rows] == [("search", True)]


def test_a_group_moves_to_the_gpu_type_measured_as_fast_and_cheaper():
    """chat on an L40S and on an H100, measured alike: the H100's replica moves to an L40S, and
    the plan saves the difference of their hours."""
    setup, arrivals = _model("chat", 2)
    dear = GroupSetup("chat-1", "chat", "H100", 1, 3.90, PROFILE, False)
    setup = ModelSetup("chat", (setup.groups[0], dear), setup.runs)
    inputs = _inputs((setup, arrivals), min_replicas=2)
    [rec] = _plan(inputs).recommendations
    assert (rec.kind, rec.change) == (
        "gpu_type",
        {"replica": "chat-1", "gpu_model": "L40S", "gpu_count": 1},
    )
    assert rec.saving_usd == pytest.approx(24 * (3.90 - 1.60))


def test_a_larger_batch_is_tried_only_where_the_batch_limit_sizes_the_engines():
    """Engines running a few sequences of 16 get no batch change, however large their KV cache."""
    inputs = _inputs(_model("m", 3))
    r = replay(inputs.world.setups["m"], inputs.world.arrivals["m"], 0, DAY)
    assert batch_candidates(inputs.world, _facts(inputs), {"m": r}) == []
    r.peak_in_engines[12] = 3 * 16.0  # every slot of the three engines held at noon
    [cand] = batch_candidates(inputs.world, _facts(inputs), {"m": r})
    assert cand.change == {"max_num_seqs": {f"m-{k}": 256 for k in range(3)}}
