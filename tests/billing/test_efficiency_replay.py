"""The replay: recorded arrivals through the engine model on engines as they ran, worked by hand."""

from __future__ import annotations

import random

import duckdb
import pytest

from billing.efficiency.replay import Arrival, GroupSetup, ModelSetup, Run, percentile, replay
from infermeter.config import EngineProfile

# One step is 10 ms + 1 ms a sequence + 0.1 ms a token computed (a decoded token's KV entries
# included); a prompt of 100 tokens prefills in 10 ms.
PROFILE = EngineProfile(
    max_num_seqs=8,
    kv_cache_tokens=100_000,
    block_size=16,
    step_base_ms=10,
    step_per_seq_ms=1,
    prefill_tokens_per_second=10_000,
)


def _setup(*runs: Run, caching: bool = False, gpus: int = 2, usd: float = 3.90) -> ModelSetup:
    group = GroupSetup("g", "m", "H100", gpus, usd, PROFILE, caching)
    return ModelSetup("m", (group,), runs)


def _arrival(
    t: float, team: str = "search", prompt: int = 100, out: int = 11, **kw: object
) -> Arrival:
    return Arrival(t, team, "m", prompt, out, **kw)  # type: ignore[arg-type]


def test_a_lone_request_waits_one_prefill_step_then_one_step_a_token():
    """TTFT is the prefill step (10 + 1 + 10 ms); each next token one step (11.1 ms)."""
    r = replay(_setup(Run("g", "a", 0, 100, 0)), [_arrival(1.0)], 0, 100)
    assert r.ttft_p95() == pytest.approx(0.021)
    assert r.itl_p95() == pytest.approx(0.0111)
    assert (r.unserved, r.preemptions) == (0, 0)


def test_requests_go_to_the_serving_instances_in_turn():
    """Four requests over two serving instances: two each, so none waits for another."""
    runs = (Run("g", "a", 0, 100, 0), Run("g", "b", 0, 100, 0))
    arrivals = [_arrival(1.0 + 0.001 * k, out=200) for k in range(4)]
    together = replay(_setup(*runs), arrivals, 0, 100)
    alone = replay(_setup(runs[0]), arrivals, 0, 100)
    # Two at a time step in 12.2 ms, four in 14.4 ms: the decode is slower on one instance.
    assert together.itl_p95() == pytest.approx(0.0122, rel=0.01)
    assert alone.itl_p95() == pytest.approx(0.0144, rel=0.01)
    assert together.peak_in_engines == {0: 4.0}  # 2 + 2, summed over the instances


def test_an_arrival_with_no_engine_serving_waits_for_the_next():
    """An engine that serves from 50 s takes the request sent at 20 s: 30 s of waiting."""
    r = replay(_setup(Run("g", "a", 0, 100, 50.0)), [_arrival(20.0)], 0, 100)
    assert r.ttft_p95() == pytest.approx(30.021)
    gone = replay(_setup(Run("g", "a", 0, 10, 0)), [_arrival(20.0)], 0, 100)
    assert (gone.unserved, gone.ttft_p95()) == (1, float("inf"))


def test_gpu_time_is_each_instances_interval_inside_the_period():
    """Runs are paid over [start, end) within the period, busy or not, times their GPUs."""
    runs = (Run("g", "a", -3600, 3600, -3600), Run("g", "b", 1800, 9000, 1800))
    r = replay(_setup(*runs), [], 0, 7200)
    assert r.gpu_hours == pytest.approx(2 * (1.0 + 1.5))
    assert r.cost_usd == pytest.approx(2 * 2.5 * 3.90)


def test_a_prefix_cache_serves_a_shared_head_after_its_first_request():
    """Two requests of one 96-token head: with caching the second prefills 6 blocks fewer."""
    arrivals = [
        Arrival(t, "search", "m", 100, 11, head="policy", head_tokens=96) for t in (1.0, 2.0)
    ]
    cached = replay(_setup(Run("g", "a", 0, 100, 0), caching=True), arrivals, 0, 100)
    computed = replay(_setup(Run("g", "a", 0, 100, 0)), arrivals, 0, 100)
    assert sorted(computed.ttft) == pytest.approx([0.021, 0.021])
    assert sorted(cached.ttft) == pytest.approx([0.0114, 0.021])  # 4 tokens left: 0.4 ms


def test_each_teams_p95_is_its_own():
    """search's slow requests do not count against analytics' p95."""
    arrivals = [_arrival(1.0, out=2), _arrival(5.0, team="analytics", out=400)]
    r = replay(_setup(Run("g", "a", 0, 100, 0)), arrivals, 0, 100)
    assert r.teams == ["analytics", "search"]
    assert r.itl_p95("search") == pytest.approx(0.0111)
    assert r.ttft_p95("nobody") is None


def test_percentile_is_duckdbs_quantile_cont():
    """The replay's p95 is the measured one's: linear interpolation between ranks."""
    rng = random.Random(3)
    values = [rng.expovariate(1.0) for _ in range(101)]
    found = duckdb.execute("SELECT quantile_cont(v, 0.95) FROM (SELECT unnest(?) AS v)", [values])
    [(expected,)] = found.fetchall()
    assert percentile(values, 0.95) == pytest.approx(expected)
    assert percentile([], 0.95) is None


def test_ttft_counts_only_requests_whose_first_token_was_seen():
    """A long prompt the sidecar saw no first token of is replayed, and left out of TTFT as it is
    left out of the measured TTFT."""
    arrivals = [_arrival(1.0), Arrival(1.5, "search", "m", 3000, 11, timed=False)]
    r = replay(_setup(Run("g", "a", 0, 100, 0)), arrivals, 0, 100)
    assert len(r.ttft) == 2
    assert r.ttft_p95() == pytest.approx(0.021)
