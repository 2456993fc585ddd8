"""Cost allocation: who pays for each GPU-minute. Pure functions over Polars frames.

The fleet's cost is measured, not assumed: a replica's cost in a one-minute slot is the GPU time
its GPUs were seen for, at the price book's USD per GPU-hour, plus the energy they drew, at USD
per kWh times the data centre's PUE. That cost is split among teams by one of three rules:

``in_flight`` (default)
    At each moment the replica's GPU time is shared equally by the requests in flight on it, so
    ten requests sharing a batch each pay a tenth. Resolution is the one-minute slot: a team's
    share of a slot is its in-flight seconds divided by ``max(60, all in-flight seconds)``.
    When fewer than 60 in-flight seconds fall in a slot, the uncovered part of the minute is
    idle capacity; a request alone on a replica pays exactly the time it held it.
``tokens``
    The replica's busy cost in the month is split by weighted tokens
    (``prompt_weight * prompt + completion_weight * completion``).
``requests``
    The replica's busy cost in the month is split by request count.

Idle capacity (a slot, or the part of it, with nothing in flight) follows the replica's
``idle_policy``: ``spread`` over the teams in proportion to what they paid on that replica
that month, ``platform`` to the platform account, ``owner`` to the team that owns a dedicated
replica. GPUs that no replica runs on are the platform's, as model ``(unallocated)``.

``docs/billing.md`` works one example by hand; ``tests/billing`` checks these functions on it
and, with hypothesis, that every split adds up to the fleet cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

import polars as pl

from billing.schema import SLOT_SECONDS

__all__ = ["LINE_COLUMNS", "UNALLOCATED", "Policy", "allocate", "fleet_cost", "slot_costs"]

UNALLOCATED: Final = "(unallocated)"
LINE_COLUMNS: Final = (
    "team", "model", "requests", "prompt_tokens", "completion_tokens", "gpu_hours", "energy_kwh",
    "compute_usd", "energy_usd", "idle_usd",
)  # fmt: skip

IdlePolicy = Literal["spread", "platform", "owner"]


@dataclass(frozen=True, slots=True)
class Policy:
    """Everything allocation needs besides the measurements: prices and rules."""

    usd_per_gpu_hour: Mapping[str, float]
    usd_per_kwh: float = 0.0
    pue: float = 1.0
    allocation: Literal["in_flight", "tokens", "requests"] = "in_flight"
    prompt_weight: float = 1.0
    completion_weight: float = 1.0
    platform_account: str = "platform"
    # replica -> (idle policy, owner team); a replica not listed spreads its idle capacity.
    idle: Mapping[str, tuple[IdlePolicy, str | None]] = field(default_factory=dict)
    # replica -> model, for idle lines of replicas that served nothing in the month.
    replica_model: Mapping[str, str] = field(default_factory=dict)


_USAGE_SCHEMA: Final = {
    "replica": pl.String, "team": pl.String, "model": pl.String, "slot": pl.Int64,
    "inflight_seconds": pl.Float64, "requests": pl.Int64, "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
}  # fmt: skip
_GPU_SCHEMA: Final = {
    "replica": pl.String, "gpu_model": pl.String, "slot": pl.Int64, "gpu_seconds": pl.Float64,
    "energy_joules": pl.Float64,
}  # fmt: skip


def slot_costs(gpus: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """Cost, GPU-hours and kWh per replica and slot. ValueError names any unpriced GPU model."""
    gpus = gpus.cast(_GPU_SCHEMA).sort(pl.all())  # type: ignore[arg-type]
    unpriced = sorted(set(gpus["gpu_model"].unique()) - set(policy.usd_per_gpu_hour))
    if unpriced:
        raise ValueError(
            f"no price for GPU model(s) {', '.join(unpriced)} in prices.usd_per_gpu_hour"
        )
    price = pl.col("gpu_model").replace_strict(
        dict(policy.usd_per_gpu_hour), return_dtype=pl.Float64
    )
    kwh = pl.col("energy_joules") / 3.6e6
    return (
        gpus.with_columns(
            gpu_hours=pl.col("gpu_seconds") / 3600.0,
            energy_kwh=kwh,
            compute_usd=pl.col("gpu_seconds") / 3600.0 * price,
            energy_usd=kwh * (policy.usd_per_kwh * policy.pue),
        )
        .group_by("replica", "slot", maintain_order=True)
        .agg(pl.col("gpu_hours", "energy_kwh", "compute_usd", "energy_usd").sum())
        .sort("replica", "slot")
    )


def fleet_cost(gpus: pl.DataFrame, policy: Policy) -> float:
    """What the fleet cost in the frame's slots, in USD (unrounded)."""
    costs = slot_costs(gpus, policy)
    return float(costs.select(pl.col("compute_usd").sum() + pl.col("energy_usd").sum()).item())


def allocate(usage: pl.DataFrame, gpus: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """One line per (team, model), columns ``LINE_COLUMNS``, costs unrounded.

    The cost columns of all lines add up to ``fleet_cost(gpus, policy)`` (up to float
    rounding; ``billing.rounding`` turns them into cents that add up exactly).
    """
    # Sorted input makes every float sum run in one order, so the same rows always give the
    # same cents, however the ledger returned them.
    usage = usage.cast(_USAGE_SCHEMA).sort("replica", "slot", "team", "model")  # type: ignore[arg-type]
    costs = slot_costs(gpus, policy)
    occupancy = usage.group_by("replica", "slot", maintain_order=True).agg(
        occupied=pl.col("inflight_seconds").sum()
    )
    slots = costs.join(occupancy, on=["replica", "slot"], how="left").with_columns(
        busy=(pl.col("occupied").fill_null(0.0) / SLOT_SECONDS).clip(upper_bound=1.0)
    )
    busy = _busy_shares(usage, slots, policy)
    idle = _idle_lines(busy, slots, policy)
    counts = usage.group_by("team", "model", maintain_order=True).agg(
        pl.col("requests", "prompt_tokens", "completion_tokens").sum()
    )
    money = pl.concat([busy.drop("replica"), idle], how="diagonal_relaxed")
    lines = (
        money.group_by("team", "model", maintain_order=True)
        .agg(
            pl.col("gpu_hours", "energy_kwh", "compute_usd", "energy_usd", "idle_usd")
            .fill_null(0.0)
            .sum()
        )
        .join(counts, on=["team", "model"], how="full", coalesce=True)
        .with_columns(
            pl.col("requests", "prompt_tokens", "completion_tokens").fill_null(0),
            pl.col("gpu_hours", "energy_kwh", "compute_usd", "energy_usd", "idle_usd").fill_null(
                0.0
            ),
        )
    )
    # Float sums may differ in their last bits with the order rows arrive in; rounding far
    # below a cent makes the same usage give the same lines.
    return (
        lines.select(LINE_COLUMNS)
        .with_columns(
            pl.col("gpu_hours", "energy_kwh", "compute_usd", "energy_usd", "idle_usd").round(10)
        )
        .sort("team", "model")
    )


def _busy_shares(usage: pl.DataFrame, slots: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """Each team's part of the busy cost, per replica: replica, team, model and money columns."""
    money = ("gpu_hours", "energy_kwh", "compute_usd", "energy_usd")
    busy_slots = slots.with_columns(pl.col(c) * pl.col("busy") for c in money)
    if policy.allocation == "in_flight":
        joined = usage.join(busy_slots, on=["replica", "slot"], how="inner").with_columns(
            share=pl.when(pl.col("occupied") > 0)
            .then(pl.col("inflight_seconds") / pl.col("occupied"))
            .otherwise(0.0)
        )
        shares = joined.with_columns(pl.col(c) * pl.col("share") for c in money)
        return shares.group_by("replica", "team", "model", maintain_order=True).agg(
            pl.col(money).sum()
        )
    if policy.allocation == "tokens":
        weight = (
            pl.col("prompt_tokens") * policy.prompt_weight
            + pl.col("completion_tokens") * policy.completion_weight
        )
    else:
        weight = pl.col("requests").cast(pl.Float64)
    weights = (
        usage.group_by("replica", "team", "model", maintain_order=True)
        .agg(w=weight.sum())
        .filter(pl.col("w") > 0)
    )
    totals = busy_slots.group_by("replica", maintain_order=True).agg(pl.col(money).sum())
    joined = weights.join(totals, on="replica", how="inner").with_columns(
        share=pl.col("w") / pl.col("w").sum().over("replica")
    )
    return joined.select("replica", "team", "model", *(pl.col(c) * pl.col("share") for c in money))


def _idle_lines(busy: pl.DataFrame, slots: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    """Idle capacity per replica, charged by its policy: team, model, idle_usd."""
    idle_usd = (pl.col("compute_usd") + pl.col("energy_usd")) * (1.0 - pl.col("busy"))
    idle = slots.group_by("replica", maintain_order=True).agg(idle_usd=idle_usd.sum())
    # Busy cost with no team to carry it (tokens/requests split with zero weight) is idle too.
    carried = busy.group_by("replica", maintain_order=True).agg(
        paid=(pl.col("compute_usd") + pl.col("energy_usd")).sum()
    )
    busy_total = slots.group_by("replica", maintain_order=True).agg(
        busy_usd=((pl.col("compute_usd") + pl.col("energy_usd")) * pl.col("busy")).sum()
    )
    idle = (
        idle.join(busy_total, on="replica", how="left")
        .join(carried, on="replica", how="left")
        .with_columns(
            idle_usd=pl.col("idle_usd")
            + (pl.col("busy_usd") - pl.col("paid").fill_null(0.0)).clip(lower_bound=0.0)
        )
        .select("replica", "idle_usd")
    )
    rows: list[dict[str, object]] = []
    payers = busy.with_columns(paid=pl.col("compute_usd") + pl.col("energy_usd"))
    for replica, amount in idle.iter_rows():
        if amount == 0:
            continue
        rule, owner = policy.idle.get(replica, ("spread", None))
        model = policy.replica_model.get(replica, UNALLOCATED)
        if replica == "":
            rows.append({"team": policy.platform_account, "model": UNALLOCATED, "idle_usd": amount})
        elif rule == "owner" and owner:
            rows.append({"team": owner, "model": model, "idle_usd": amount})
        elif rule == "spread":
            mine = payers.filter(pl.col("replica") == replica)
            total = float(mine["paid"].sum())
            if total > 0:
                rows.extend(
                    {"team": t, "model": m, "idle_usd": amount * p / total}
                    for t, m, p in mine.select("team", "model", "paid").iter_rows()
                )
            else:
                rows.append({"team": policy.platform_account, "model": model, "idle_usd": amount})
        else:
            rows.append({"team": policy.platform_account, "model": model, "idle_usd": amount})
    return pl.DataFrame(
        rows, schema={"team": pl.String, "model": pl.String, "idle_usd": pl.Float64}
    )
