"""The advisor on scripted months whose right answer is known, each held to the simulator's truth.

Each month runs a simulated fleet in virtual time into a real ledger (``tests.billing.fleet_month``:
the engine model on a virtual clock, requests spread at random over the serving instances, pods
with lifetimes). The advisor replays the ledger; the test then runs the month again with the
recommended change applied and holds the advice to it: the expected kind and change and no
other, its saving within 10 % of the cost the second run saved, and every team's TTFT p95 still
within its target.

Some months run engines ``slower`` times slower than the demo's, with SLAs as much looser: the
load is the same, in ``slower`` times fewer requests, so a month replays in about a second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from billing.efficiency.advice import Recommendation
from billing.ledger import Ledger
from infermeter.config import Config
from tests.billing.fleet_month import Group, Month, Outcome, Stream, hourly, month_config, run
from tests.conftest import config_ledger

PEAK = tuple(int(10 <= h < 14) for h in range(24))  # 10:00-14:00 UTC


@pytest.fixture
def ledger_for() -> Iterator[Callable[[Config], Ledger]]:
    """Fresh in-memory ledgers, one per scenario run."""
    opened: list[Ledger] = []

    def make(config: Config) -> Ledger:
        opened.append(config_ledger(config))
        return opened[-1]

    yield make
    for led in opened:
        led.close()


def advised(config: Config, month: Month, ledger: Ledger) -> tuple[Outcome, list[Recommendation]]:
    """The month simulated into ``ledger``, and the advisor's recommendations on it."""
    outcome = run(config, month, ledger)
    assert outcome.report is not None
    return outcome, list(outcome.report.recommendations)


def held_to_truth(rec: Recommendation, before: Outcome, after: Outcome, config: Config) -> None:
    """The saving within 10 % of what the month run again saved, and every team's TTFT p95 after
    within the strictest target of the models it used."""
    measured = before.per_month(before.cost_usd - after.cost_usd)
    assert measured > 0
    assert rec.saving_usd_per_month == pytest.approx(measured, rel=0.10)
    for team in after.ttft:
        target = min(m.sla.ttft_p95_seconds for m in config.models if (team, m.name) in after.used)
        assert after.ttft_p95(team) <= target, team


def test_an_over_provisioned_group_is_right_sized(ledger_for):
    """Two L40S replicas whose load one holds: run one, and save what the second cost."""
    config = month_config()
    month = Month(
        (Group("small-0"), Group("small-1")),
        (Stream("search", "chat-small", hourly(8, 8), 300, 150),),
    )
    before, [rec] = advised(config, month, ledger_for(config))
    assert (rec.kind, rec.change["engines_by_hour"]) == ("right_size", [1] * 24)
    assert rec.title == "chat-small: run 1 replica instead of 2"
    after = run(config, Month((Group("small-0"),), month.streams))
    held_to_truth(rec, before, after, config)
    assert rec.saving_usd_per_month == pytest.approx(1.60 * 730)


def test_an_autoscaled_group_already_right_sized_gets_no_advice(ledger_for):
    """Pods of one group run 1 at night and 3 by day, each KV cache holding 4 of the requests: the
    load needs them all, so nothing is offered."""
    config = month_config(slower=40, **{"small-0": {"max_num_seqs": 4}})
    counts = tuple(3 if 8 <= h < 20 else 1 for h in range(24))
    month = Month(
        (Group("small-0", counts, dynamic=True, kv_cache_tokens=9000),),
        (Stream("search", "chat-small", hourly(5, 40), 500, 1500),),
    )
    before, recs = advised(config, month, ledger_for(config))
    assert recs == []
    assert before.report is not None
    assert before.report.notes == ()
    fewer = Month(
        (Group("small-0", tuple(min(c, 2) for c in counts), dynamic=True, kv_cache_tokens=9000),),
        month.streams,
    )
    assert run(config, fewer).ttft_p95("search") > 0.5 * 40  # one pod fewer by day misses the SLA


def test_an_under_batched_engine_gets_a_larger_batch(ledger_for):
    """Four pods of 2 sequences whose KV caches hold 120 each: one pod with a larger batch holds."""
    config = month_config(slower=40, **{"small-0": {"max_num_seqs": 2}})
    month = Month(
        (Group("small-0", (4,) * 24, dynamic=True),),
        (Stream("search", "chat-small", hourly(20, 20), 500, 1500),),
    )
    before, [rec] = advised(config, month, ledger_for(config))
    assert rec.kind == "batch"
    assert rec.change["max_num_seqs"] == {"small-0": 120}
    assert rec.change["chat-small.engines_by_hour"] == [1] * 24
    after = run(
        config, Month((Group("small-0", (1,) * 24, dynamic=True, max_num_seqs=120),), month.streams)
    )
    held_to_truth(rec, before, after, config)


def test_a_model_that_fits_on_fewer_gpus_at_lower_precision_is_quantized(ledger_for):
    """The 70B FP8 model on two H100s, configured by its architecture: int4 on one holds its load."""
    config = month_config()
    data = config.model_dump()
    data["models"][0]["architecture"] = {
        "params_billions": 70,
        "layers": 80,
        "kv_heads": 8,
        "head_dim": 128,
        "precision": "fp8",
    }
    config = Config.model_validate(data)
    month = Month((Group("large-0"),), (Stream("search", "chat-large", hourly(3, 3), 1000, 300),))
    before, [rec] = advised(config, month, ledger_for(config))
    assert (rec.kind, rec.change) == ("quantize", {"precision": "int4", "gpus_per_replica": 1})
    assert rec.policy_change["where"] == "models[chat-large].approved_versions"
    kv = rec.evidence["kv_cache_tokens_after"]
    assert kv == pytest.approx(120_000 / 2, rel=0.01)  # half the KV cache: half the memory left
    after = run(config, Month((Group("large-0", gpus=1, kv_cache_tokens=kv),), month.streams))
    held_to_truth(rec, before, after, config)
    assert rec.saving_usd_per_month == pytest.approx(3.90 * 730)


def test_short_requests_are_routed_to_the_smaller_model(ledger_for):
    """search's short chat-large requests make the peak need a second pod; on chat-small they fit."""
    config = month_config(slower=20)
    data = config.model_dump()
    data["simulator"]["engines"]["chat-large"]["step_per_seq_ms"] = 5 * 20
    config = Config.model_validate(data)
    month = Month(
        (Group("large-0", tuple(2 if p else 1 for p in PEAK), dynamic=True), Group("small-0")),
        (
            Stream("search", "chat-large", tuple(50.0 * p for p in PEAK), 200, 250),
            Stream("search", "chat-large", (2.0,) * 24, 2000, 1000),
            Stream("assistant", "chat-small", (10.0,) * 24, 300, 150),
        ),
    )
    before, [rec] = advised(config, month, ledger_for(config))
    assert (rec.kind, rec.team) == ("route", "search")
    assert rec.change["route"]["to"] == "chat-small"
    assert rec.change["chat-large.engines_by_hour"] == [1] * 24
    after = run(
        config,
        Month(
            (Group("large-0", (1,) * 24, dynamic=True), Group("small-0")),
            month.streams,
            routes={("search", "chat-large"): ("chat-small", 512, 256)},
        ),
    )
    held_to_truth(rec, before, after, config)


def test_a_prefix_heavy_team_gets_prefix_caching(ledger_for):
    """Every request opens with one 1,000-token system prompt on engines slow to prefill: cached,
    one pod holds the peak that needed three."""
    config = month_config(slower=40)
    data = config.model_dump()
    data["simulator"]["engines"]["chat-large"]["prefill_tokens_per_second"] = 34
    config = Config.model_validate(data)
    month = Month(
        (Group("large-0", tuple(3 if p else 1 for p in PEAK), dynamic=True),),
        (
            Stream(
                "assistant",
                "chat-large",
                tuple(60.0 if p else 7.5 for p in PEAK),
                1040,
                40,
                head="policy",
                head_tokens=1000,
            ),
        ),
    )
    before, [rec] = advised(config, month, ledger_for(config))
    assert rec.kind == "prefix_cache"
    assert rec.change["enable_prefix_caching"] is True
    assert rec.change["chat-large.engines_by_hour"] == [1] * 24
    after = run(
        config,
        Month((Group("large-0", (1,) * 24, dynamic=True, prefix_caching=True),), month.streams),
    )
    held_to_truth(rec, before, after, config)


def test_a_group_the_replay_does_not_match_gets_no_advice(ledger_for):
    """Engines three times slower than their profile says: the advisor cannot vouch, and says so."""
    config = month_config(slower=20)
    month = Month(
        (Group("small-0", slower=3), Group("small-1", slower=3)),
        (Stream("search", "chat-small", hourly(8, 8), 300, 150),),
    )
    before, recs = advised(config, month, ledger_for(config))
    assert recs == []
    assert before.report is not None
    assert {(n.kind, n.replica) for n in before.report.notes} >= {("cannot_vouch", "small-0")}
