"""What a replica's GPU time costs by the month, and the one rule a monthly budget cap counts by.

Two consumers count replicas against ``scaling.monthly_budget_cap_usd``: the alert rules refuse a
cap that cannot pay for one replica of a model, and the autoscaling policy holds each model to
the replicas the cap pays for. They must count a replica the same way, or a cap can pass the
check and still hold a model at zero replicas.

**A model whose replicas run on GPUs of different prices counts every replica at its dearest
replica's price.** The autoscaler asks for a number of replicas, not for particular ones; which
replica is added (which GPUs it gets) is the scheduler's choice. A platform team reads a budget
cap as a ceiling that holds whatever the autoscaler does, so it must hold whichever replica is
added: counted at the dearest price, ``n`` replicas never cost more than the cap, while counted
at the cheapest they could cost up to the price ratio more. The price of the guarantee is that a
mixed fleet may get fewer replicas than the cap would pay for if only cheap ones were added. And
a cap below one dearest replica is refused when rules are rendered, because the policy would
otherwise hold that model at zero replicas (the budget wins over ``min_replicas``).

The cost is GPU time from the price book, around the clock; energy is billed as measured and is
not part of it. Everything here is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infermeter.config import Config, Prices, Replica

__all__ = [
    "HOURS_PER_MONTH",
    "ReplicaCost",
    "budget_replica_cost",
    "replica_cost",
    "replicas_within",
]

# 365 days x 24 h / 12 months: the average month, so twelve of them make a year.
HOURS_PER_MONTH = 730.0


@dataclass(frozen=True)
class ReplicaCost:
    """One replica's GPU time by the month, with the figures it is worked out from."""

    replica: str
    gpu_count: int
    gpu_model: str
    usd_per_gpu_hour: float

    @property
    def usd_per_hour(self) -> float:
        """The replica's GPUs for one hour at the price book's rate."""
        return self.gpu_count * self.usd_per_gpu_hour

    @property
    def usd_per_month(self) -> float:
        """The replica running around the clock for ``HOURS_PER_MONTH``."""
        return self.usd_per_hour * HOURS_PER_MONTH

    def explain(self) -> str:
        """The sum as an operator can check it: ``2 x H100 at 3.90 USD/GPU-hour x 730 h``."""
        return (
            f"{self.gpu_count} x {self.gpu_model} at {self.usd_per_gpu_hour:.2f} USD/GPU-hour "
            f"x {HOURS_PER_MONTH:g} h"
        )


def replica_cost(replica: Replica, prices: Prices) -> ReplicaCost:
    """``replica``'s monthly cost from its GPU count and model and the price book.

    A loaded configuration prices every replica's GPU model, so the lookup cannot fail there.
    """
    return ReplicaCost(
        replica=replica.id,
        gpu_count=replica.gpu_count,
        gpu_model=replica.gpu_model,
        usd_per_gpu_hour=prices.usd_per_gpu_hour[replica.gpu_model],
    )


def budget_replica_cost(config: Config, model: str) -> ReplicaCost | None:
    """What the budget cap counts for each replica of ``model``: its dearest replica's cost.

    The first of equally dear replicas, in configuration order; ``None`` when ``model`` has no
    replicas. Why the dearest: see the module docstring.
    """
    costs = [replica_cost(r, config.prices) for r in config.replicas if r.model == model]
    return max(costs, key=lambda c: c.usd_per_month, default=None)


def replicas_within(monthly_cap_usd: float, cost: ReplicaCost) -> int | None:
    """Replicas at ``cost`` that ``monthly_cap_usd`` pays for around the clock, rounded down.

    ``None`` when a replica costs nothing: no count of them reaches the cap.
    """
    if cost.usd_per_month <= 0:
        return None
    return math.floor(monthly_cap_usd / cost.usd_per_month)
