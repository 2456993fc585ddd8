"""The continuous-batching scheduler, driven by a virtual clock."""

from __future__ import annotations

import statistics

import pytest

from infermeter.config import EngineProfile
from simulator.engine import Scheduler, Sequence

PROFILE = EngineProfile(
    max_num_seqs=8,
    kv_cache_tokens=4096,
    block_size=16,
    step_base_ms=10,
    step_per_seq_ms=1,
    prefill_tokens_per_second=10_000,
)


def _seq(i: int, prompt: int = 32, out: int = 32, at: float = 0.0) -> Sequence:
    return Sequence(f"s{i}", prompt_tokens=prompt, max_tokens=out, stop_after=out, arrived_at=at)


def drive(sched: Scheduler, seqs: list[Sequence], until: float = 1e9) -> float:
    """Run the engine on a virtual clock; arrivals are added when their time comes."""
    pending = sorted(seqs, key=lambda s: s.arrived_at)
    now = 0.0
    while (pending or not sched.idle) and now < until:
        while pending and pending[0].arrived_at <= now:
            sched.add(pending.pop(0))
        step = sched.plan(now)
        if step is None:
            now = pending[0].arrived_at
            continue
        now += step.duration
        sched.commit(step, now)
    return now


def ttft(seq: Sequence) -> float:
    assert seq.first_token_at is not None
    return seq.first_token_at - seq.arrived_at


def decode_rate(seq: Sequence) -> float:
    assert seq.finished_at is not None
    assert seq.first_token_at is not None
    return (seq.generated - 1) / (seq.finished_at - seq.first_token_at)


def test_generates_exactly_max_tokens_and_counts_them():
    """A sequence that never stops by itself ends at max_tokens with reason 'length'."""
    sched = Scheduler(PROFILE)
    seq = _seq(0, out=20)
    drive(sched, [seq])
    assert (seq.generated, seq.finish_reason) == (20, "length")
    assert sched.counters.generation_tokens == 20
    assert sched.counters.prompt_tokens == 32


def test_natural_stop_before_max_tokens_is_reason_stop():
    """A sequence whose model stops early ends with reason 'stop'."""
    sched = Scheduler(PROFILE)
    seq = Sequence("s", prompt_tokens=10, max_tokens=50, stop_after=7)
    drive(sched, [seq])
    assert (seq.generated, seq.finish_reason) == (7, "stop")


def test_ttft_grows_with_prompt_length():
    """Prefill costs time in proportion to the prompt."""
    short, long_ = _seq(0, prompt=50), _seq(1, prompt=3000)
    drive(Scheduler(PROFILE), [short])
    drive(Scheduler(PROFILE), [long_])
    assert ttft(long_) > ttft(short) + 0.25


def test_requests_beyond_max_num_seqs_wait_in_queue_and_their_ttft_grows():
    """With more requests than slots, the extra ones wait and see a longer TTFT."""
    sched = Scheduler(PROFILE)
    seqs = [_seq(i, out=64) for i in range(16)]
    sched.add(seqs[0])
    for s in seqs[1:]:
        sched.add(s)
    step = sched.plan(0.0)
    assert step is not None
    assert len(sched.running) == 8
    assert len(sched.waiting) == 8
    sched.commit(step, step.duration)
    drive(sched, [])
    first, second = seqs[:8], seqs[8:]
    assert min(ttft(s) for s in second) > max(ttft(s) for s in first)


def test_per_sequence_decode_slows_as_batch_grows_but_throughput_rises():
    """Larger batches: each sequence is slower, the engine as a whole is faster."""
    alone = _seq(0, out=100)
    drive(Scheduler(PROFILE), [alone])
    crowd = [_seq(i, out=100) for i in range(8)]
    end = drive(Scheduler(PROFILE), crowd)
    assert statistics.mean(decode_rate(s) for s in crowd) < decode_rate(alone)
    assert 800 / end > 100 / alone.finished_at  # type: ignore[operator]


def test_kv_cache_budget_limits_admission():
    """Requests that do not fit in the KV cache wait even when slots are free."""
    sched = Scheduler(PROFILE)
    for i in range(4):
        sched.add(_seq(i, prompt=1500, out=10))
    sched.plan(0.0)
    assert len(sched.running) == 2
    assert len(sched.waiting) == 2
    assert sched.kv_usage() > 0.7


def test_decode_growth_preempts_newest_sequence_when_cache_is_full():
    """When running sequences outgrow the cache, the newest is preempted and recomputed later."""
    sched = Scheduler(
        EngineProfile(
            max_num_seqs=4,
            kv_cache_tokens=256,
            block_size=16,
            step_base_ms=1,
            step_per_seq_ms=0,
            prefill_tokens_per_second=1e6,
        )
    )
    seqs = [_seq(i, prompt=60, out=60) for i in range(3)]
    drive(sched, seqs)
    assert sched.counters.preemptions > 0
    assert all(s.generated == 60 and s.finish_reason == "length" for s in seqs)


def test_abort_frees_the_slot_and_stops_generation():
    """An aborted sequence leaves the batch at once and generates nothing more."""
    sched = Scheduler(PROFILE)
    seq = _seq(0, out=1000)
    sched.add(seq)
    now = 0.0
    for _ in range(5):
        step = sched.plan(now)
        assert step is not None
        now += step.duration
        sched.commit(step, now)
    sched.abort(seq, now)
    assert seq.finish_reason == "abort"
    assert sched.idle
    assert sched.counters.generation_tokens == seq.generated == 5


def test_prefix_cache_hits_on_repeated_prompt():
    """A second request with the same prompt prefix is served partly from the prefix cache."""
    sched = Scheduler(PROFILE)
    blocks = (1, 2, 3, 4)
    a = Sequence("a", prompt_tokens=70, max_tokens=4, stop_after=4, prefix_blocks=blocks)
    drive(sched, [a])
    b = Sequence(
        "b", prompt_tokens=70, max_tokens=4, stop_after=4, prefix_blocks=blocks, arrived_at=1.0
    )
    drive(sched, [b])
    assert (a.cached_tokens, b.cached_tokens) == (0, 64)
    assert sched.counters.prefix_cache_hits == 64
    assert ttft(b) < ttft(a)


@pytest.mark.parametrize("n", [1, 5, 30])
def test_same_arrivals_give_same_timeline(n):
    """The scheduler is deterministic: the same arrivals give the same token times."""

    def run() -> list[float | None]:
        seqs = [_seq(i, prompt=10 + 7 * i, out=5 + i, at=0.003 * i) for i in range(n)]
        drive(Scheduler(PROFILE), seqs)
        return [s.finished_at for s in seqs]

    assert run() == run()
