"""A replica's monthly cost, the dearest-replica rule for a model, and what a cap pays for."""

from __future__ import annotations

from typing import Any

import pytest

from infermeter.config import Config, Prices, Replica
from infermeter.pricing import (
    HOURS_PER_MONTH,
    ReplicaCost,
    budget_replica_cost,
    replica_cost,
    replicas_within,
)

PRICES = Prices(
    usd_per_gpu_hour={
        "H100": 3.90,
        "L40S": 1.60,
        "A100-80GB": 2.40,
        "T4": 0.50,
        "A10G": 1.00,
        "free": 0.0,
    }
)


def _replica(rid: str, model: str, gpu_model: str, gpu_count: int) -> dict[str, Any]:
    return {
        "id": rid,
        "model": model,
        "upstream_url": "http://127.0.0.1:9",
        "node": "n",
        "gpu_model": gpu_model,
        "gpu_count": gpu_count,
    }


def _fleet(config: Config, *replicas: tuple[str, int]) -> Config:
    """The demo configuration with ``chat-small`` served by ``replicas`` (GPU model, count)."""
    data = config.model_dump(mode="json")
    data["prices"] = PRICES.model_dump(mode="json")
    data["replicas"] = [r for r in data["replicas"] if r["model"] != "chat-small"] + [
        _replica(f"small-{i}", "chat-small", gpu, count) for i, (gpu, count) in enumerate(replicas)
    ]
    return Config.model_validate(data)


def test_a_month_is_a_twelfth_of_a_year():
    """HOURS_PER_MONTH is 365 x 24 / 12, so twelve months of a replica make its year."""
    assert HOURS_PER_MONTH == 365 * 24 / 12 == 730


@pytest.mark.parametrize(
    ("gpu_model", "gpu_count", "per_hour", "per_month", "explained"),
    [
        ("H100", 2, 7.80, 5694.00, "2 x H100 at 3.90 USD/GPU-hour x 730 h"),
        ("L40S", 1, 1.60, 1168.00, "1 x L40S at 1.60 USD/GPU-hour x 730 h"),
        ("A100-80GB", 4, 9.60, 7008.00, "4 x A100-80GB at 2.40 USD/GPU-hour x 730 h"),
        ("free", 8, 0.00, 0.00, "8 x free at 0.00 USD/GPU-hour x 730 h"),
    ],
)
def test_replica_cost_is_gpus_times_price_times_a_month(
    gpu_model, gpu_count, per_hour, per_month, explained
):
    """A replica costs its GPU count x the price book's GPU-hour x 730 h, and says so."""
    replica = Replica.model_validate(_replica("r", "m", gpu_model, gpu_count))
    cost = replica_cost(replica, PRICES)
    assert (cost.replica, cost.gpu_model, cost.gpu_count) == ("r", gpu_model, gpu_count)
    assert cost.usd_per_hour == pytest.approx(per_hour)
    assert cost.usd_per_month == pytest.approx(per_month)
    assert cost.explain() == explained


@pytest.mark.parametrize(
    ("replicas", "counted"),
    [
        ([("L40S", 1)], "small-0"),
        ([("L40S", 1), ("L40S", 1)], "small-0"),
        ([("L40S", 1), ("H100", 2)], "small-1"),
        ([("H100", 2), ("L40S", 1)], "small-0"),
        ([("L40S", 1), ("A100-80GB", 1), ("L40S", 2)], "small-2"),  # two L40S outprice one A100
        ([("L40S", 2), ("A100-80GB", 1), ("H100", 1)], "small-2"),
        ([("L40S", 4), ("A100-80GB", 1), ("H100", 1)], "small-0"),
        ([("free", 1), ("L40S", 1)], "small-1"),
    ],
)
def test_a_model_is_counted_at_its_dearest_replica(config, replicas, counted):
    """Whatever the order or mix, the budget counts the replica whose month costs most."""
    cost = budget_replica_cost(_fleet(config, *replicas), "chat-small")
    assert cost is not None
    assert cost.replica == counted


def test_equally_dear_replicas_count_the_first(config):
    """Two replicas with the same monthly cost: the first in the file is the one named."""
    cost = budget_replica_cost(_fleet(config, ("T4", 2), ("A10G", 1)), "chat-small")
    assert cost is not None
    assert (cost.replica, cost.usd_per_month) == ("small-0", 730.0)


def test_a_model_without_replicas_has_no_replica_cost(config):
    """A model no replica serves has nothing for a cap to count."""
    assert budget_replica_cost(_fleet(config), "chat-small") is None


@pytest.mark.parametrize(
    ("cap", "gpu_model", "gpu_count", "replicas"),
    [
        (60_000, "H100", 2, 10),  # 10.5 rounded down
        (5694, "H100", 2, 1),  # exactly one replica-month
        (5693.99, "H100", 2, 0),
        (0, "L40S", 1, 0),
        (11_680, "L40S", 1, 10),
        (1000, "free", 1, None),  # nothing to count: no bound
    ],
)
def test_replicas_within_a_cap_round_down(cap, gpu_model, gpu_count, replicas):
    """A cap pays for whole replicas running all month; a free replica sets no bound."""
    cost = ReplicaCost("r", gpu_count, gpu_model, PRICES.usd_per_gpu_hour[gpu_model])
    assert replicas_within(cap, cost) == replicas
