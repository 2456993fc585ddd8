"""The advisor on simulated fleets whose saving is known: each estimate within 10% of the truth.

Each scenario runs the simulator's engine model in virtual time into a real ledger
(``tests.billing.scenario``). Where a change can be replayed, the truth is measured by running
the scenario again with the change applied; where the saving is an allocation (routing), it is
computed here from the scenario's own parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import yaml

from billing.ledger import Ledger
from infermeter.config import DEFAULT_CONFIG, Config
from tests.billing.scenario import Outcome, Scenario, Stream, by_kind, run, with_replicas

MONTH_HOURS = 730
SMALL_CHAT = Stream("search", "chat-small", every_seconds=4, user_words=40, completion_tokens=60)


@pytest.fixture
def config() -> Config:
    """The demo configuration with coarser engine steps, so an hour simulates in about a second."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["simulator"]["engines"]["chat-small"].update(step_base_ms=60, step_per_seq_ms=0.5)
    data["simulator"]["engines"]["chat-large"].update(step_base_ms=120, step_per_seq_ms=1.0)
    return Config.model_validate(data)


@pytest.fixture
def ledger_factory(config: Config) -> Iterator[Callable[[], Ledger]]:
    """Fresh in-memory ledgers, for running a scenario again with a change applied."""
    opened: list[Ledger] = []

    def make() -> Ledger:
        opened.append(Ledger.open(":memory:", [t.name for t in config.teams],
                                  {m.name: m.sla.ttft_p95_seconds for m in config.models}))  # fmt: skip
        return opened[-1]

    yield make
    for led in opened:
        led.close()


def _within_sla(outcome: Outcome, seconds: float) -> float:
    ttfts = [float(r["first_token_at"]) - float(r["received_at"]) for r in outcome.usage]
    return sum(t <= seconds for t in ttfts) / len(ttfts)


def test_an_over_provisioned_group_is_right_sized(ledger, ledger_factory, config):
    """Two L40S replicas whose load one holds: the estimate matches the cost saved by running one, SLA kept."""
    scenario = Scenario({"small-0": "L40S", "small-1": "L40S"}, (SMALL_CHAT,))
    [rec] = by_kind(run(ledger, config, scenario), "right_size")
    assert rec.action == {"replicas": 1}
    before = run(ledger_factory(), config, scenario).cost_usd()
    after = run(ledger_factory(), config, with_replicas(scenario, {"small-0": "L40S"}))
    measured = (before - after.cost_usd()) * MONTH_HOURS
    assert measured == pytest.approx(1.60 * MONTH_HOURS)
    assert rec.saving_usd_per_month == pytest.approx(measured, rel=0.10)
    assert _within_sla(after, 0.5) >= 0.95


def test_a_model_on_a_dearer_gpu_moves_to_the_cheaper_one(ledger, ledger_factory, config):
    """chat-small on an H100 and an L40S alike: the estimate matches the cost saved by an L40S in the H100's place."""
    scenario = Scenario({"small-0": "L40S", "small-1": "H100"}, (SMALL_CHAT,))
    [rec] = by_kind(run(ledger, config, scenario), "gpu_type")
    assert (rec.evidence["gpu_model_now"], rec.action) == ("H100", {"gpu_model": "L40S"})
    before = run(ledger_factory(), config, scenario).cost_usd()
    after = run(
        ledger_factory(), config, with_replicas(scenario, {"small-0": "L40S", "small-1": "L40S"})
    )
    measured = (before - after.cost_usd()) * MONTH_HOURS
    assert measured == pytest.approx((3.90 - 1.60) * MONTH_HOURS)
    assert rec.saving_usd_per_month == pytest.approx(measured, rel=0.10)
    assert _within_sla(after, 0.5) >= 0.95


def test_a_share_of_short_requests_is_routed_to_the_smaller_model(ledger, config):
    """60% of search's chat-large requests are short: the saving is their weighted tokens at both models' cost per token."""
    short = Stream("search", "chat-large", every_seconds=5, user_words=40, completion_tokens=100)
    long = Stream("search", "chat-large", every_seconds=7.5, user_words=700, completion_tokens=300,
                  offset_seconds=1.0)  # fmt: skip
    small = Stream("assistant", "chat-small", every_seconds=1, user_words=40, completion_tokens=60)
    scenario = Scenario({"large-0": "H100", "small-0": "L40S"}, (short, long, small))
    [rec] = by_kind(run(ledger, config, scenario), "route")
    assert (rec.team, rec.model, rec.action["route_to"]) == ("search", "chat-large", "chat-small")

    def weighted(s: Stream) -> float:
        arrivals = scenario.arrivals(s)
        prompt = sum(s.prompt_tokens(k) for k in range(len(arrivals)))
        return prompt + 3 * s.completion_tokens * len(arrivals)

    shares = len(scenario.arrivals(short)) / (
        len(scenario.arrivals(short)) + len(scenario.arrivals(long))
    )
    assert shares == pytest.approx(0.6, abs=0.01)
    large_rate = 2 * 3.90 / (weighted(short) + weighted(long))
    small_rate = 1.60 / weighted(small)
    expected = weighted(short) * (large_rate - small_rate) * MONTH_HOURS
    assert rec.saving_usd_per_month == pytest.approx(expected, rel=0.10)


def test_a_shared_system_prompt_without_prefix_caching_is_priced(ledger, ledger_factory, config):
    """Every request opens with one system prompt and the cache is off: the estimate matches the tokens caching serves when on."""
    shared = Stream("assistant", "chat-small", every_seconds=2, user_words=10, completion_tokens=20,
                    system_words=250)  # fmt: skip
    scenario = Scenario({"small-0": "L40S"}, (shared,))
    [rec] = by_kind(run(ledger, config, scenario), "prefix_cache")
    assert rec.title == "chat-small: turn on prefix caching"
    cached = run(
        ledger_factory(), config, Scenario({"small-0": "L40S"}, (shared,), prefix_caching=True)
    )
    served_from_cache = sum(r["cached_prompt_tokens"] for r in cached.usage)
    assert by_kind(cached, "prefix_cache") == []
    per_input_token = rec.evidence["usd_per_1m_input_tokens"] / 1e6
    measured = served_from_cache * per_input_token * MONTH_HOURS
    assert rec.saving_usd_per_month == pytest.approx(measured, rel=0.10)


def test_a_fleet_with_nothing_to_save_gets_no_recommendation(ledger, config):
    """One L40S replica serving distinct questions, nothing sent to a larger model: no advice at all."""
    scenario = Scenario({"small-0": "L40S"}, (SMALL_CHAT,))
    assert run(ledger, config, scenario).report.recommendations == ()


def _batch_fleet(config: Config) -> Config:
    """chat-small replicas of 16 sequences, on engines with 200 ms steps (TTFT still under 0.5 s)."""
    small = [r.model_copy(update={"max_num_seqs": 16}) if r.model == "chat-small" else r
             for r in config.replicas]  # fmt: skip
    sim = config.simulator
    slow = sim.engines["chat-small"].model_copy(update={"step_base_ms": 200})
    engines = {**sim.engines, "chat-small": slow}
    return config.model_copy(
        update={"replicas": small, "simulator": sim.model_copy(update={"engines": engines})}
    )


def test_a_batch_team_in_the_peak_is_moved_off_peak(ledger, ledger_factory, config):
    """analytics' unstreamed jobs double the 01:00 peak: the estimate matches one engine holding the day once they run at 02:00."""
    config = _batch_fleet(config)
    peak = Stream("search", "chat-small", every_seconds=2.5, user_words=40, completion_tokens=60,
                  until_seconds=3600)  # fmt: skip
    quiet = Stream("search", "chat-small", every_seconds=60, user_words=40, completion_tokens=60,
                   offset_seconds=3600)  # fmt: skip
    jobs = Stream("analytics", "chat-small", every_seconds=8, user_words=300,
                  completion_tokens=400, until_seconds=3600, stream=False)  # fmt: skip
    scenario = Scenario({"small-0": "L40S", "small-1": "L40S"}, (peak, quiet, jobs), hours=3)
    before = run(ledger, config, scenario)
    [rec] = by_kind(before, "off_peak")
    assert (rec.team, rec.evidence["peak_hours"]) == ("analytics", ["01:00-02:00"])
    assert rec.evidence["engines_needed_by_hour"][1:4] == [2, 1, 1]
    assert rec.evidence["engines_needed_by_hour_after"][1:4] == [1, 1, 1]
    assert by_kind(before, "right_size") == []
    [schedule] = by_kind(before, "schedule")
    moved = replace(jobs, offset_seconds=3600, until_seconds=7200)
    after = run(ledger_factory(), config,
                Scenario({"small-0": "L40S"}, (peak, quiet, moved), hours=3))  # fmt: skip
    # One engine now holds the day: right-sizing, the schedule and the move saved it all.
    measured = (before.cost_usd() - after.cost_usd()) * MONTH_HOURS / 3
    assert measured == pytest.approx(3 * 1.60 * MONTH_HOURS / 3)
    assert rec.saving_usd_per_month == pytest.approx(
        measured - schedule.saving_usd_per_month, rel=0.10
    )
    assert _within_sla(after, 0.5) >= 0.95
