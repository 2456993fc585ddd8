"""The engine model's fast path: a run of identical decode steps applied at once, as one by one."""

from __future__ import annotations

import math
import random

import pytest

from infermeter.config import EngineProfile
from infermeter.engine_model import Scheduler, Sequence

PROFILE = EngineProfile(
    max_num_seqs=8,
    kv_cache_tokens=4096,
    block_size=16,
    step_base_ms=10,
    step_per_seq_ms=1,
    prefill_tokens_per_second=10_000,
)


def _arrivals(n: int, seed: int, prompt: int = 200, out: int = 120) -> list[Sequence]:
    rng = random.Random(seed)
    t, seqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(1 / 0.4)
        p, o = rng.randint(1, prompt), rng.randint(1, out)
        seqs.append(Sequence(f"s{i}", p, o, rng.randint(1, o), arrived_at=t))
    return seqs


def _drive(sched: Scheduler, seqs: list[Sequence], fast: bool) -> None:
    """Every arrival added at the first step boundary at or after it, stepping or advancing."""
    pending, i, now = sorted(seqs, key=lambda s: s.arrived_at), 0, 0.0
    while True:
        while i < len(pending) and pending[i].arrived_at <= now:
            sched.add(pending[i])
            i += 1
        step = sched.plan(now)
        if step is None:
            if i >= len(pending):
                return
            now = pending[i].arrived_at
            continue
        if fast:
            now, _ = sched.advance(
                step, now, pending[i].arrived_at if i < len(pending) else math.inf
            )
        else:
            now += step.duration
            sched.commit(step, now)


def _timeline(seqs: list[Sequence]) -> list[tuple[float | None, ...]]:
    return [
        (
            s.admitted_at,
            s.first_token_at,
            s.finished_at,
            s.generated,
            s.preemptions,
            s.cached_tokens,
        )
        for s in seqs
    ]


@pytest.mark.parametrize(
    ("profile", "seed"),
    [
        (PROFILE, 1),
        (PROFILE, 2),
        # A cache of 40 blocks: decode fills it, so sequences are preempted and recomputed.
        (PROFILE.model_copy(update={"kv_cache_tokens": 640}), 3),
        (PROFILE.model_copy(update={"max_num_seqs": 2}), 4),
    ],
)
def test_advancing_gives_the_timeline_of_stepping(profile, seed):
    """Admission, first token, finish, preemptions and counters agree with one step at a time."""
    stepped, fast = _arrivals(300, seed), _arrivals(300, seed)
    one, many = Scheduler(profile), Scheduler(profile)
    _drive(one, stepped, fast=False)
    _drive(many, fast, fast=True)
    for a, b in zip(_timeline(stepped), _timeline(fast), strict=True):
        assert a[3:] == b[3:]
        assert a[:3] == pytest.approx(b[:3], abs=1e-6)
    assert vars(one.counters) == vars(many.counters)
    assert [s.itl for s in stepped] == [pytest.approx(s.itl, abs=1e-9) for s in fast]
    if profile.kv_cache_tokens == 640:
        assert one.counters.preemptions > 0


def test_advancing_takes_fewer_passes_than_steps():
    """Long answers at a low rate: most steps are applied in bulk."""
    seqs = [Sequence(f"s{i}", 50, 2000, 2000, arrived_at=10.0 * i) for i in range(20)]
    sched, passes = Scheduler(PROFILE, keep_itl=False), 0
    pending, now = list(seqs), 0.0
    while pending or not sched.idle:
        while pending and pending[0].arrived_at <= now:
            sched.add(pending.pop(0))
        step = sched.plan(now)
        if step is None:
            now = pending[0].arrived_at
            continue
        now, _ = sched.advance(step, now, pending[0].arrived_at if pending else math.inf)
        passes += 1
    assert sched.counters.iterations > 10_000
    assert passes < 200
    assert all(s.generated == 2000 and s.itl == [] for s in seqs)
