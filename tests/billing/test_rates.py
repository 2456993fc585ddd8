"""Each model's cost per weighted token: the last complete hour, else the month so far, else null."""

from __future__ import annotations

import pytest

from billing.charges import Policy
from billing.ledger import Ledger
from billing.rates import RateCache, rates
from tests.billing.conftest import OCT, batch, gpu_samples, usage

MODELS = ["chat-large", "chat-small"]
# One L40S at $1.00 an hour, no energy price; chat-small is replica group small-0.
POLICY = Policy.listed(
    usd_per_gpu_hour={"L40S": 1.0},
    prompt_weight=1.0,
    cached_prompt_weight=0.5,
    completion_weight=2.0,
    replica_model={"small-0": "chat-small"},
)


def _hour(ledger: Ledger, start: float, prompt: int, cached: int, completion: int) -> None:
    """small-0's GPU for the hour from ``start`` and one record in it."""
    ledger.ingest(
        batch(
            "usage",
            [
                usage(
                    "search",
                    start + 60,
                    10.0,
                    prompt_tokens=prompt,
                    cached_prompt_tokens=cached,
                    completion_tokens=completion,
                )
            ],
        ),
        now=start + 86400,
    )
    ledger.ingest(batch("gpu_samples", gpu_samples("small-0", start, 3600.0)), now=start + 86400)


def test_the_last_complete_hour_gives_the_rate(ledger: Ledger) -> None:
    """$1 over 600 + 200 x 0.5 + 150 x 2 = 1,000 weighted tokens: $0.001 each, basis hour."""
    _hour(ledger, OCT + 3600, 800, 200, 150)
    body = rates(ledger, POLICY, MODELS, OCT + 2 * 3600 + 30)
    assert body["weights"] == {"prompt": 1.0, "cached_prompt": 0.5, "completion": 2.0}
    small = body["models"]["chat-small"]
    assert small["usd_per_weighted_token"] == pytest.approx(0.001)
    assert (small["basis"], small["from"], small["until"]) == ("hour", OCT + 3600, OCT + 7200)
    assert body["models"]["chat-large"] == {
        "usd_per_weighted_token": None,
        "basis": None,
        "from": None,
        "until": None,
    }


def test_an_hour_without_work_falls_back_to_the_month_so_far(ledger: Ledger) -> None:
    """Nothing in the last complete hour: two hours of the month, $2 over 2,000 weighted tokens."""
    _hour(ledger, OCT, 800, 200, 150)
    _hour(ledger, OCT + 3600, 800, 200, 150)
    now = OCT + 5 * 3600
    small = rates(ledger, POLICY, MODELS, now)["models"]["chat-small"]
    assert small["usd_per_weighted_token"] == pytest.approx(0.001)
    assert (small["basis"], small["from"], small["until"]) == ("month", OCT, now)


def test_a_gpu_without_a_price_makes_the_rate_unknown(ledger: Ledger) -> None:
    """Unpriced GPU time is not free: the rate is null, not low."""
    _hour(ledger, OCT + 3600, 800, 200, 150)
    unpriced = Policy.listed(
        usd_per_gpu_hour={"H100": 4.0}, replica_model={"small-0": "chat-small"}
    )
    body = rates(ledger, unpriced, MODELS, OCT + 2 * 3600)
    assert body["models"]["chat-small"]["usd_per_weighted_token"] is None


def test_the_answer_is_kept_for_a_minute(ledger: Ledger) -> None:
    """Within the TTL the kept answer is served; past it the ledger is read again."""
    now = [OCT + 2 * 3600]
    cache = RateCache(60.0, clock=lambda: now[0])
    first = cache.get(ledger, POLICY, MODELS)
    _hour(ledger, OCT + 3600, 800, 200, 150)
    assert cache.get(ledger, POLICY, MODELS) is first
    now[0] += 61
    assert cache.get(ledger, POLICY, MODELS)["models"]["chat-small"]["basis"] == "hour"


def test_gpu_time_naming_only_its_instance_counts_for_the_group_it_served(ledger: Ledger) -> None:
    """A pod's GPU samples without a group are the group's its records name: same $0.001."""
    start = OCT + 3600
    ledger.ingest(
        batch(
            "usage",
            [
                usage(
                    "search",
                    start + 60,
                    10.0,
                    prompt_tokens=800,
                    cached_prompt_tokens=200,
                    completion_tokens=150,
                    instance="small-0-a",
                )
            ],
        ),
        now=start + 86400,
    )
    samples = [{**s, "instance": "small-0-a"} for s in gpu_samples("", start, 3600.0)]
    ledger.ingest(batch("gpu_samples", samples), now=start + 86400)
    small = rates(ledger, POLICY, MODELS, OCT + 2 * 3600)["models"]["chat-small"]
    assert small["usd_per_weighted_token"] == pytest.approx(0.001)


def test_the_rate_uses_the_node_pools_price(ledger: Ledger) -> None:
    """node-b is in pool spot at $0.40 an hour (the GPU model's list price is $1.00): $0.0004."""
    from dataclasses import replace

    from billing.pricebook import price_book
    from infermeter.config import Prices

    prices = Prices.model_validate(
        {
            "usd_per_gpu_hour": {"L40S": 1.0},
            "pools": [
                {
                    "name": "spot",
                    "nodes": ["node-b"],
                    "prices": [{"from": "2026-01-01", "category": "spot", "usd_per_gpu_hour": 0.4}],
                }
            ],
        }
    )
    _hour(ledger, OCT + 3600, 800, 200, 150)
    pooled = replace(POLICY, prices=price_book(prices))
    small = rates(ledger, pooled, MODELS, OCT + 2 * 3600 + 30)["models"]["chat-small"]
    assert small["usd_per_weighted_token"] == pytest.approx(0.0004)
