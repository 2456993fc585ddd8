"""The changes the plan tries, each a concrete change of the configuration and of the replay.

Each is proposed from measured figures and offered only if its replay holds every SLA and
lowers the plan's cost (``billing.efficiency.plan``); a change that saves GPU-hours only when
the fleet shrinks is priced with the engines it lets go, never at an average cost per token.

- **prefix_cache**: a model whose requests share prompt heads (the sidecar's digests) on
  engines without prefix caching: turned on, the shared heads' KV blocks are computed once.
- **batch**: ``max_num_seqs`` far below what the engine's KV cache holds (its real capacity,
  ``vllm:cache_config_info``) at the requests' 95th-percentile context: raised.
- **quantize**: a lower precision on fewer GPUs per replica, sized from the model's configured
  architecture (``models[].architecture``) and the KV cache the engine reported; needs the new
  build approved, and says so.
- **gpu_type**: a replica group moved to the GPU type another group of its model runs on, when
  that one costs less per engine-hour and was measured serving the model no slower.
- **route**: a team's short requests to a model sent to a smaller (or cheaper per token) model
  of the same use case.
- **off_peak**: a batch team's requests in the peak hours moved to the quietest hours after.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from billing.efficiency.advice import QUALITY_CAVEAT, Policy
from billing.efficiency.capacity import engine_capacity, engines_by_hour, needed_by_hour
from billing.efficiency.plan import Candidate, GroupMeasured, Note, World, with_setup
from billing.efficiency.replay import Arrival, GroupSetup, ModelReplay, ModelSetup, percentile
from infermeter.config import ModelArchitecture
from infermeter.planner import (
    ACTIVATION_SHARE,
    BYTES_PER_PARAM,
    FIXED_GB_PER_GPU,
    GPU_MEMORY_UTILIZATION,
    GPUS_GB,
    weights_gb,
)

__all__ = ["Facts", "GroupEngine", "kv_capacity_tokens", "propose", "sizing_notes"]

_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class GroupEngine:
    """A replica group's engines as measured (a row of ``group_engine_sql``)."""

    replica: str
    model: str
    batch_occupancy: float | None
    requests_waiting_max: float | None
    kv_cache_usage_max: float | None
    preemptions: float
    prefix_cache_queries: float
    prefix_cache_hits: float
    kv_cache_tokens: float | None


@dataclass(frozen=True)
class Facts:
    """What the proposals read beyond the replay: the configuration and the engines measured."""

    architectures: Mapping[str, ModelArchitecture]
    use_cases: Mapping[str, str]
    served_versions: Mapping[str, str]
    max_model_len: Mapping[str, int]
    workloads: Mapping[str, str]  # team -> auto | batch | interactive
    engines: Mapping[str, GroupEngine]  # per replica group
    measured: Mapping[str, GroupMeasured]
    policy: Policy
    min_replicas: int = 1
    period_end: float = math.inf  # work moved past it would leave the period: it stays


def kv_capacity_tokens(arch: ModelArchitecture, precision: str, gpus: int, gpu_gb: float) -> float:
    """KV-cache tokens ``gpus`` GPUs of ``gpu_gb`` leave beside the weights, by the capacity
    planner's memory model (``infermeter.planner``: 16-bit KV cache, 10 % overhead on both)."""
    usable = gpus * (gpu_gb * GPU_MEMORY_UTILIZATION - FIXED_GB_PER_GPU)
    free_gb = usable / (1 + ACTIVATION_SHARE) - weights_gb(arch.params_billions, precision)
    per_token_gb = 2 * arch.layers * arch.kv_heads * arch.head_dim * BYTES_PER_PARAM["fp16"] / 1e9
    return max(0.0, free_gb / per_token_gb)


def sizing_notes(world: World, facts: Facts) -> list[Note]:
    """Why a model on several GPUs per replica gets no memory-based (quantization) advice."""
    notes = []
    for model, setup in sorted(world.setups.items()):
        if max((g.gpus for g in setup.groups), default=1) < 2:
            continue
        if model not in facts.architectures:
            notes.append(
                Note(
                    model,
                    None,
                    "cannot_size",
                    f"{model}: no quantization advice: its architecture is not configured "
                    "(models[].architecture: parameters, layers, KV heads, head size, "
                    "precision), and the advisor does not guess a model's size from its "
                    "name",
                )
            )
        elif any(g.gpu_model not in GPUS_GB for g in setup.groups):
            notes.append(
                Note(
                    model,
                    None,
                    "cannot_size",
                    f"{model}: no quantization advice: the memory of "
                    f"{', '.join(sorted({g.gpu_model for g in setup.groups}))} is not known "
                    "to the capacity planner",
                )
            )
    return notes


def _regroup(setup: ModelSetup, change: Callable[[GroupSetup], GroupSetup]) -> ModelSetup:
    return replace(setup, groups=tuple(change(g) for g in setup.groups))


def _context(a: Arrival) -> float:
    return a.prompt_tokens + a.completion_tokens / max(1, a.choices)


# -- prefix caching ---------------------------------------------------------------------------


def prefix_candidates(world: World, facts: Facts) -> list[Candidate]:
    """Turn on prefix caching for a model whose requests share prompt heads."""
    policy, found = facts.policy, []
    for model, setup in sorted(world.setups.items()):
        arrivals = world.arrivals.get(model, ())
        if not arrivals or all(g.prefix_caching for g in setup.groups):
            continue
        heads = Counter(a.head for a in arrivals if a.head is not None)
        shared = {h: n for h, n in heads.items() if n >= policy.min_shared_requests}
        requests = sum(shared.values())
        if requests / len(arrivals) < policy.min_shared_share:
            continue
        head_tokens = [a.head_tokens for a in arrivals if a.head in shared]
        engines = [facts.engines[g.replica] for g in setup.groups if g.replica in facts.engines]
        queries = sum(e.prefix_cache_queries for e in engines)
        hits = sum(e.prefix_cache_hits for e in engines)

        def apply(w: World, model: str = model) -> World:
            on = _regroup(w.setups[model], lambda x: replace(x, prefix_caching=True))
            return with_setup(w, on)

        found.append(
            Candidate(
                kind="prefix_cache",
                model=model,
                team=None,
                models=(model,),
                title=f"{model}: turn on prefix caching",
                change={"enable_prefix_caching": True},
                evidence={
                    "requests": len(arrivals),
                    "shared_requests": requests,
                    "shared_share": requests / len(arrivals),
                    "shared_prefixes": len(shared),
                    "mean_head_tokens": sum(head_tokens) / len(head_tokens),
                    "prefix_cache_hit_rate": hits / queries if queries else None,
                },
                assumptions=(
                    f"a prompt head is shared when {policy.min_shared_requests} or more requests "
                    "begin with it (the sidecar's keyed digest of the first message)",
                    "a head's tokens are its share of the prompt's characters times vLLM's prompt "
                    "tokens; the cache keeps whole blocks of them",
                    "the engines measured no prefix-cache hits, so their cache was off",
                ),
                apply=apply,
                caveat="start vLLM with --enable-prefix-caching (the default in vLLM's V1 engine).",
                exclusive=f"prefix:{model}",
            )
        )
    return found


# -- batch size -------------------------------------------------------------------------------


def _batch_bound(setup: ModelSetup, r: ModelReplay | None, headroom: float) -> bool:
    """Whether the engines' batch limit is what sizes them: in some hour the peak per engine
    that ran, with headroom, is above ``max_num_seqs``."""
    if r is None:
        return False
    ran = engines_by_hour(setup.runs)
    seqs = min(g.profile.max_num_seqs for g in setup.groups)
    return any(
        ran[h % 24] and peak / ran[h % 24] * (1 + headroom) > seqs
        for h, peak in r.peak_in_engines.items()
    )


def batch_candidates(
    world: World, facts: Facts, replays: Mapping[str, ModelReplay]
) -> list[Candidate]:
    """Raise ``max_num_seqs`` where it sizes the engines and their KV cache holds many times it."""
    policy, found = facts.policy, []
    for model, setup in sorted(world.setups.items()):
        arrivals = world.arrivals.get(model, ())
        p95 = percentile((_context(a) for a in arrivals), 0.95)
        if p95 is None or not _batch_bound(setup, replays.get(model), policy.headroom):
            continue
        raised: dict[str, tuple[int, int]] = {}
        for g in setup.groups:
            holds = math.floor(g.profile.kv_cache_tokens / max(1.0, p95))
            new = min(policy.max_num_seqs_limit, holds)
            if new >= policy.under_batched * g.profile.max_num_seqs:
                raised[g.replica] = (g.profile.max_num_seqs, new)
        if not raised:
            continue

        def apply(
            w: World, model: str = model, raised: Mapping[str, tuple[int, int]] = raised
        ) -> World:
            def bigger(x: GroupSetup) -> GroupSetup:
                if x.replica not in raised:
                    return x
                profile = x.profile.model_copy(update={"max_num_seqs": raised[x.replica][1]})
                return replace(x, profile=profile)

            return with_setup(w, _regroup(w.setups[model], bigger))

        engines = {r: facts.engines.get(r) for r in raised}
        text = ", ".join(f"{r} {a} -> {b}" for r, (a, b) in sorted(raised.items()))
        found.append(
            Candidate(
                kind="batch",
                model=model,
                team=None,
                models=(model,),
                title=f"{model}: raise max_num_seqs ({text})",
                change={"max_num_seqs": {r: b for r, (_, b) in raised.items()}},
                evidence={
                    "max_num_seqs": {r: a for r, (a, _) in raised.items()},
                    "kv_cache_tokens": {
                        g.replica: g.profile.kv_cache_tokens
                        for g in setup.groups
                        if g.replica in raised
                    },
                    "p95_context_tokens": p95,
                    "batch_occupancy": {
                        r: e.batch_occupancy if e else None for r, e in engines.items()
                    },
                    "kv_cache_usage_max": {
                        r: e.kv_cache_usage_max if e else None for r, e in engines.items()
                    },
                    "requests_waiting_max": {
                        r: e.requests_waiting_max if e else None for r, e in engines.items()
                    },
                },
                assumptions=(
                    "the engine's KV cache is its real capacity: vLLM's vllm:cache_config_info where "
                    "the engine reported it, else the engine profile's",
                    f"a larger batch holds the requests' 95th-percentile context, "
                    f"{p95:,.0f} tokens, each; step times grow with the batch as the engine profile says",
                ),
                apply=apply,
                caveat="a larger batch slows each sequence: the replay holds the inter-token SLA, "
                "check it on the engines after the change.",
                exclusive=f"batch:{model}",
            )
        )
    return found


# -- quantization -----------------------------------------------------------------------------


def quantize_candidates(world: World, facts: Facts) -> list[Candidate]:
    """A lower precision on fewer GPUs per replica, for models whose architecture is known."""
    found = []
    for model, setup in sorted(world.setups.items()):
        arch = facts.architectures.get(model)
        gpus = {g.gpus for g in setup.groups}
        kinds = {g.gpu_model for g in setup.groups}
        if arch is None or len(gpus) != 1 or len(kinds) != 1 or max(gpus) < 2:
            continue
        now, gpu = max(gpus), next(iter(kinds))
        memory = GPUS_GB.get(gpu)
        if memory is None:
            continue
        lower = sorted(
            (p for p in ("fp8", "int4") if BYTES_PER_PARAM[p] < BYTES_PER_PARAM[arch.precision]),
            key=lambda p: -BYTES_PER_PARAM[p],
        )
        for precision in lower:
            tp = 1
            while tp < now:
                found += _quantize(world, facts, setup, arch, precision, tp, now, gpu, memory)
                tp *= 2
    return found


def _quantize(
    world: World,
    facts: Facts,
    setup: ModelSetup,
    arch: ModelArchitecture,
    precision: str,
    tp: int,
    now: int,
    gpu: str,
    memory: float,
) -> list[Candidate]:
    model = setup.model
    if arch.kv_heads % tp:
        return []
    predicted_now = kv_capacity_tokens(arch, arch.precision, now, memory)
    after = kv_capacity_tokens(arch, precision, tp, memory)
    measured = [
        facts.engines[g.replica].kv_cache_tokens
        for g in setup.groups
        if g.replica in facts.engines and facts.engines[g.replica].kv_cache_tokens
    ]
    if measured and predicted_now > 0:
        after *= min(m for m in measured if m is not None) / predicted_now
    if after < facts.max_model_len.get(model, 8192):
        return []
    tokens = int(after)

    def apply(w: World) -> World:
        def smaller(g: GroupSetup) -> GroupSetup:
            return replace(
                g, gpus=tp, profile=g.profile.model_copy(update={"kv_cache_tokens": tokens})
            )

        return with_setup(w, _regroup(w.setups[model], smaller))

    served = facts.served_versions.get(model, model)
    return [
        Candidate(
            kind="quantize",
            model=model,
            team=None,
            models=(model,),
            title=f"{model}: serve a {precision} build on {tp} {gpu} per replica instead of {now}",
            change={"precision": precision, "gpus_per_replica": tp},
            policy_change={
                "approve_version": f"a {precision} build of {served}",
                "where": f"models[{model}].approved_versions",
            },
            evidence={
                "precision_now": arch.precision,
                "gpus_per_replica": now,
                "kv_cache_tokens_now": min((m for m in measured if m), default=predicted_now),
                "kv_cache_tokens_after": tokens,
                "params_billions": arch.params_billions,
                "max_model_len": facts.max_model_len.get(model, 8192),
            },
            assumptions=(
                "the KV cache after is the engine's reported capacity scaled by the memory the new "
                "precision leaves (the capacity planner's model: 16-bit KV cache, 10% overhead)",
                "step times hold on fewer GPUs at the lower precision (it reads fewer bytes per token)",
                "the build is not approved yet: the change needs it approved first",
            ),
            apply=apply,
            caveat=QUALITY_CAVEAT[precision],
            exclusive=f"quantize:{model}",
        )
    ]


# -- GPU type ---------------------------------------------------------------------------------


def gpu_type_candidates(world: World, facts: Facts) -> list[Candidate]:
    """Move a group to the GPU type another group of its model runs on, cheaper and no slower."""
    found = []
    for model, setup in sorted(world.setups.items()):
        for g in setup.groups:
            for o in setup.groups:
                if (
                    o.gpu_model == g.gpu_model
                    or o.usd_per_gpu_hour * o.gpus >= g.usd_per_gpu_hour * g.gpus
                ):
                    continue
                mine, theirs = facts.measured.get(g.replica), facts.measured.get(o.replica)
                if (
                    mine is None
                    or theirs is None
                    or mine.ttft_p95 is None
                    or theirs.ttft_p95 is None
                ):
                    continue
                if theirs.ttft_p95 > mine.ttft_p95 * 1.1 or not _no_slower(mine, theirs):
                    continue
                found.append(_move(model, g, o, mine, theirs))
    return found


def _no_slower(mine: GroupMeasured, theirs: GroupMeasured) -> bool:
    if mine.itl_p95 is None or theirs.itl_p95 is None:
        return mine.itl_p95 is None and theirs.itl_p95 is None
    return theirs.itl_p95 <= mine.itl_p95 * 1.1


def _move(
    model: str, g: GroupSetup, o: GroupSetup, mine: GroupMeasured, theirs: GroupMeasured
) -> Candidate:
    def apply(w: World) -> World:
        def moved(x: GroupSetup) -> GroupSetup:
            if x.replica != g.replica:
                return x
            profile = x.profile.model_copy(update={"kv_cache_tokens": o.profile.kv_cache_tokens})
            return replace(
                x,
                gpu_model=o.gpu_model,
                usd_per_gpu_hour=o.usd_per_gpu_hour,
                gpus=o.gpus,
                profile=profile,
            )

        return with_setup(w, _regroup(w.setups[model], moved))

    return Candidate(
        kind="gpu_type",
        model=model,
        team=None,
        models=(model,),
        title=f"{model}: serve {g.replica} on {o.gpu_model} instead of {g.gpu_model}",
        change={"replica": g.replica, "gpu_model": o.gpu_model, "gpu_count": o.gpus},
        evidence={
            "gpu_model_now": g.gpu_model,
            "gpu_model_after": o.gpu_model,
            "usd_per_engine_hour_now": g.usd_per_gpu_hour * g.gpus,
            "usd_per_engine_hour_after": o.usd_per_gpu_hour * o.gpus,
            "ttft_p95_now_s": mine.ttft_p95,
            "ttft_p95_there_s": theirs.ttft_p95,
            "itl_p95_now_s": mine.itl_p95,
            "itl_p95_there_s": theirs.itl_p95,
        },
        assumptions=(
            f"{o.gpu_model} serves the model as fast as {g.gpu_model}: {o.replica} was measured "
            "no slower, and the replay uses one engine profile for both",
            f"the KV cache of {o.replica}'s engines",
        ),
        apply=apply,
        caveat=f"{o.gpu_model} must be available: check the cloud's or the cluster's capacity.",
        exclusive=f"gpu_type:{g.replica}",
    )


# -- routing ----------------------------------------------------------------------------------


def _usd_per_token(world: World, facts: Facts, model: str) -> float | None:
    cost = sum(m.gpu_usd for m in facts.measured.values() if m.model == model)
    tokens = sum(a.prompt_tokens + 3 * a.completion_tokens for a in world.arrivals.get(model, ()))
    return cost / tokens if tokens else None


def _smaller(world: World, facts: Facts, model: str) -> str | None:
    """The model of the same use case that is smaller (by architecture), else cheaper per token."""
    best: tuple[float, str] | None = None
    arch = facts.architectures.get(model)
    rate = _usd_per_token(world, facts, model)
    for other in world.setups:
        if other == model or facts.use_cases.get(other) != facts.use_cases.get(model):
            continue
        theirs = facts.architectures.get(other)
        if arch is not None and theirs is not None:
            key = theirs.params_billions
            if key >= arch.params_billions:
                continue
        else:
            their_rate = _usd_per_token(world, facts, other)
            if rate is None or their_rate is None or their_rate >= rate:
                continue
            key = their_rate
        if best is None or key < best[0]:
            best = (key, other)
    return best[1] if best else None


def route_candidates(world: World, facts: Facts) -> list[Candidate]:
    """A team's short requests to a model, sent to a smaller model of the same use case."""
    policy, found = facts.policy, []
    for model in sorted(world.setups):
        target = _smaller(world, facts, model)
        arrivals = world.arrivals.get(model, ())
        if target is None or not arrivals:
            continue
        for team in sorted({a.team for a in arrivals}):
            mine = [a for a in arrivals if a.team == team]
            short = [
                a
                for a in mine
                if a.prompt_tokens <= policy.short_prompt_tokens
                and a.completion_tokens <= policy.short_completion_tokens
            ]
            if len(short) / len(mine) < policy.min_short_share:
                continue
            found.append(_route(model, target, team, len(mine), short, policy))
    return found


def _route(
    model: str, target: str, team: str, requests: int, short: Sequence[Arrival], policy: Policy
) -> Candidate:
    p_max, c_max = policy.short_prompt_tokens, policy.short_completion_tokens

    def apply(w: World) -> World:
        def moves(a: Arrival) -> bool:
            return a.team == team and a.prompt_tokens <= p_max and a.completion_tokens <= c_max

        stay = [a for a in w.arrivals.get(model, ()) if not moves(a)]
        moved = [replace(a, model=target) for a in w.arrivals.get(model, ()) if moves(a)]
        into = sorted([*w.arrivals.get(target, ()), *moved], key=lambda a: a.t)
        return World(w.setups, {**w.arrivals, model: stay, target: into})

    return Candidate(
        kind="route",
        model=model,
        team=team,
        models=(model, target),
        title=f"{team}: send short requests for {model} to {target}",
        change={
            "route": {
                "team": team,
                "from": model,
                "to": target,
                "max_prompt_tokens": p_max,
                "max_completion_tokens": c_max,
            }
        },
        evidence={
            "requests": requests,
            "short_requests": len(short),
            "short_share": len(short) / requests,
            "short_prompt_tokens": sum(a.prompt_tokens for a in short),
            "short_completion_tokens": sum(a.completion_tokens for a in short),
        },
        assumptions=(
            f"short: at most {p_max} prompt and {c_max} output tokens",
            f"{target} answers them with as many tokens as {model} did",
            f"the team's requests moved are held to its SLA on {target}",
        ),
        apply=apply,
        caveat=f"check that {target} answers this team's short requests well enough.",
        exclusive=f"route:{team}:{model}",
    )


# -- off-peak ---------------------------------------------------------------------------------


def off_peak_candidates(
    world: World, facts: Facts, replays: Mapping[str, ModelReplay]
) -> list[Candidate]:
    """A batch team's requests in a model's peak hours, moved to the quietest hours after them."""
    policy, found = facts.policy, []
    for model, setup in sorted(world.setups.items()):
        r, arrivals = replays.get(model), world.arrivals.get(model, ())
        if r is None or not arrivals:
            continue
        capacity = min((engine_capacity(g, arrivals) for g in setup.groups), default=1.0)
        levels = needed_by_hour(
            r, capacity, policy.headroom, facts.min_replicas, engines_by_hour(setup.runs)
        )
        known = [lv for lv in levels if lv is not None]
        if not known or max(known) == min(known):
            continue
        peak = sorted(h for h, lv in enumerate(levels) if lv == max(known))
        busy = {h % 24: v for h, v in r.peak_in_engines.items()}
        quiet = sorted(
            (h for h, lv in enumerate(levels) if lv is not None and h not in peak),
            key=lambda h: (busy.get(h, 0.0), h),
        )[: len(peak)]
        if len(quiet) < len(peak):
            continue
        into = dict(zip(peak, quiet, strict=True))
        for team in sorted({a.team for a in arrivals}):
            mine = [a for a in arrivals if a.team == team]
            declared = facts.workloads.get(team, "auto")
            unstreamed = sum(not a.stream for a in mine) / len(mine)
            if declared == "interactive" or (
                declared == "auto" and unstreamed < policy.min_batch_share
            ):
                continue
            if not any(int(a.t // _HOUR) % 24 in into for a in mine):
                continue
            found.append(_off_peak(model, team, into, declared, unstreamed, facts.period_end))
    return found


def _off_peak(
    model: str, team: str, into: Mapping[int, int], declared: str, unstreamed: float, until: float
) -> Candidate:
    def shifted(a: Arrival) -> Arrival:
        hod = int(a.t // _HOUR) % 24
        if a.team != team or hod not in into:
            return a
        t = a.t + ((into[hod] - hod) % 24) * _HOUR
        return replace(a, t=t) if t < until else a

    def apply(w: World) -> World:
        moved = sorted((shifted(a) for a in w.arrivals.get(model, ())), key=lambda a: a.t)
        return World(w.setups, {**w.arrivals, model: moved})

    def hhmm(h: int) -> str:
        return f"{h:02d}:00-{(h + 1) % 24:02d}:00"

    why = (
        "the configuration declares it batch work (teams[].workload)"
        if declared == "batch"
        else f"{unstreamed:.0%} of its requests were not streamed: nobody watched them being written"
    )
    return Candidate(
        kind="off_peak",
        model=model,
        team=team,
        models=(model,),
        title=f"{team}: run its {model} batch work at {', '.join(hhmm(q) for q in into.values())} "
        f"instead of {', '.join(hhmm(p) for p in into)} (UTC)",
        change={"team": team, "move": [{"from": hhmm(p), "to": hhmm(q)} for p, q in into.items()]},
        evidence={
            "peak_hours": [hhmm(p) for p in into],
            "unstreamed_share": unstreamed,
            "workload": declared,
        },
        assumptions=(
            f"the work can wait: {why}",
            "each request keeps its size and its minute within the hour it moves to",
        ),
        apply=apply,
        caveat="its results arrive later: agree the hours with the team, and hold the work "
        "with a job scheduler (or a queue that releases it off-peak).",
        exclusive=f"off_peak:{team}:{model}",
    )


def propose(facts: Facts) -> Callable[[World, Mapping[str, ModelReplay]], list[Candidate]]:
    """The candidates for a world, in the order the plan tries them."""

    def candidates(world: World, replays: Mapping[str, ModelReplay]) -> list[Candidate]:
        return [
            *prefix_candidates(world, facts),
            *batch_candidates(world, facts, replays),
            *quantize_candidates(world, facts),
            *gpu_type_candidates(world, facts),
            *route_candidates(world, facts),
            *off_peak_candidates(world, facts, replays),
        ]

    return candidates
