"""The two bases of a statement: list prices (usage), and invoices (allocation).

The usage basis prices every measured GPU-minute by the price book. Finance, though, checks a
chargeback against the invoice, and a cloud bill is rarely the list price times the hours:
discounts, credits, rounding, a price change the book did not hear of. So when an invoice has
been imported for a node pool (``billing.invoices``), the allocation basis scales the pool's
prices by ``invoiced / list cost``, where the list cost is everything the pool's measured time
and its unused commitment cost at list prices. The allocation is then run again at those
prices: the same exact split (``billing.charges``) makes the pool's team, idle and unused
commitment lines add up to the invoice, to the cent, and each team pays the same share of the
pool as on the usage basis. The usage basis stays on the statement beside it, and each pool's
row says where the two differ and by how much.

An invoice for a pool that measured nothing in the month cannot be split by use; it is a line
of its own on the platform account (``INVOICED_UNMEASURED``), so the basis still adds up to
the invoices. Pools without an invoice keep their list cost on both bases. Pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Final

import polars as pl

from billing.allocation import COUNTS, LINE_COLUMNS, LINE_TYPES, Allocation, Policy
from billing.pricebook import Commitment, PriceBook, categories
from billing.rounding import cents, microcents
from infermeter.statement import POOL_SCHEMA

__all__ = [
    "INVOICED_UNMEASURED",
    "invoice_factors",
    "pool_costs",
    "pool_frame",
    "scaled_policy",
    "unmeasured_invoice_lines",
    "with_unmeasured",
]

# The model column of an invoice's amount for a pool that measured nothing, after this.
INVOICED_UNMEASURED: Final = "(invoiced, not measured)"


def pool_costs(pools: pl.DataFrame, held: Sequence[Commitment]) -> dict[str, float]:
    """Each pool's cost in USD: its measured compute and energy (``pools``: allocation's
    ``pools`` rows) plus its unused commitments (``held``)."""
    out: dict[str, float] = {}
    if pools.height:
        for pool, compute, energy in pools.select("pool", "compute_usd", "energy_usd").iter_rows():
            out[pool] = out.get(pool, 0.0) + float(compute or 0.0) + float(energy or 0.0)
    for c in held:
        out[c.pool] = out.get(c.pool, 0.0) + c.unused_usd
    return out


def invoice_factors(costs: Mapping[str, float], invoices: Mapping[str, int]) -> dict[str, float]:
    """Per invoiced pool that measured a cost (``costs``: ``pool_costs``): ``invoice / list
    cost``, the allocation basis's scale."""
    return {
        pool: (billed / 100.0) / costs[pool]
        for pool, billed in sorted(invoices.items())
        if costs.get(pool, 0.0) > 0 and math.isfinite(costs[pool])
    }


def scaled_policy(
    policy: Policy, pools: pl.DataFrame, held: Sequence[Commitment], invoices: Mapping[str, int]
) -> Policy:
    """``policy`` with each invoiced pool's prices scaled to its invoice (``invoice_factors``)."""
    factors = invoice_factors(pool_costs(pools, held), invoices)
    return replace(policy, prices=policy.prices.scaled(factors))


def with_unmeasured(
    scaled: Allocation, listed: Allocation, invoices: Mapping[str, int], platform: str
) -> Allocation:
    """``scaled`` with the invoices of pools that measured nothing as the platform's lines."""
    lines, amount = unmeasured_invoice_lines(listed, invoices, platform)
    if not lines.height:
        return scaled
    merged = pl.concat([scaled.lines, lines.cast(LINE_TYPES)]).sort("team", "model")  # type: ignore[arg-type]
    return replace(scaled, lines=merged, fleet_microcents=scaled.fleet_microcents + amount)


def unmeasured_invoice_lines(
    listed: Allocation, invoices: Mapping[str, int], platform: str
) -> tuple[pl.DataFrame, int]:
    """Invoiced pools that measured nothing: the platform's lines for them, and their micro-cents."""
    costs = pool_costs(listed.pools, listed.commitments)
    rows = [
        {
            "team": platform,
            "model": f"{INVOICED_UNMEASURED} {pool}",
            **dict.fromkeys(COUNTS, 0),
            "gpu_hours": 0.0,
            "energy_kwh": 0.0,
            "compute_microcents": billed * 1_000_000,
            "energy_microcents": 0,
            "idle_microcents": 0,
        }
        for pool, billed in sorted(invoices.items())
        if costs.get(pool, 0.0) <= 0 and billed != 0
    ]
    frame = pl.DataFrame(rows, schema=LINE_TYPES) if rows else pl.DataFrame(schema=LINE_TYPES)
    return frame.select(LINE_COLUMNS), int(frame["compute_microcents"].sum()) if rows else 0


def _quantities(result: Allocation) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    if result.pools.height:
        for pool, hours, kwh in result.pools.select("pool", "gpu_hours", "energy_kwh").iter_rows():
            h, k = out.get(pool, (0.0, 0.0))
            out[pool] = (h + float(hours or 0.0), k + float(kwh or 0.0))
    return out


def _by_pool(held: Sequence[Commitment]) -> dict[str, list[Commitment]]:
    out: dict[str, list[Commitment]] = {}
    for c in held:
        out.setdefault(c.pool, []).append(c)
    return out


def pool_frame(
    book: PriceBook,
    period: tuple[float, float],
    listed: Allocation,
    scaled: Allocation | None,
    invoices: Mapping[str, int],
) -> pl.DataFrame:
    """Each node pool's month on both bases (``infermeter.statement.POOL_SCHEMA``), by pool name.

    ``list_cents``: measured cost plus unused commitment at list prices; ``allocation_cents``:
    the same at the allocation basis (the invoice, where there is one); ``difference_cents``:
    the second minus the first, with an ``explanation`` in words.
    """
    listed_cost, quantities = pool_costs(listed.pools, listed.commitments), _quantities(listed)
    scaled_cost = listed_cost if scaled is None else pool_costs(scaled.pools, scaled.commitments)
    held = _by_pool(listed.commitments)
    pools = sorted(set(listed_cost) | set(invoices) | set(held))
    cats = categories(book, pools, *period)
    rows = []
    for pool in pools:
        mine = held.get(pool, [])
        committed_h = sum(c.committed_gpu_hours for c in mine)
        ran = sum(min(c.used_gpu_hours, c.committed_gpu_hours) for c in mine)
        list_cents = cents(microcents(listed_cost.get(pool, 0.0)))
        invoice = invoices.get(pool)
        allocation_cents = (
            invoice if invoice is not None else cents(microcents(scaled_cost.get(pool, 0.0)))
        )
        hours, kwh = quantities.get(pool, (0.0, 0.0))
        rows.append(
            {
                "pool": pool,
                "category": cats.get(pool, "on_demand"),
                "gpu_hours": round(hours, 10),
                "energy_kwh": round(kwh, 10),
                "list_cents": list_cents,
                "committed_gpu_hours": round(committed_h, 10),
                "committed_cents": cents(microcents(sum(c.committed_usd for c in mine))),
                "unused_commitment_cents": cents(microcents(sum(c.unused_usd for c in mine))),
                "commitment_utilization": (
                    min(1.0, ran / committed_h) if committed_h > 0 else None
                ),
                "invoice_cents": invoice,
                "allocation_cents": allocation_cents,
                "difference_cents": allocation_cents - list_cents,
                "explanation": _explain(list_cents, invoice, listed_cost.get(pool, 0.0)),
            }
        )
    return pl.DataFrame(rows, schema=POOL_SCHEMA) if rows else pl.DataFrame(schema=POOL_SCHEMA)


def _explain(list_cents: int, invoice: int | None, measured_usd: float) -> str:
    """Why a pool's two bases differ, in words a finance reader can check."""
    if invoice is None:
        return "no invoice imported: on list prices"
    if measured_usd <= 0:
        return "invoiced, but no GPU time measured in the pool: charged to the platform account"
    diff = invoice - list_cents
    if diff == 0:
        return "the invoice matches list prices"
    pct = 100.0 * diff / list_cents if list_cents else math.inf
    word = "above" if diff > 0 else "below"
    return (
        f"the invoice is {abs(diff) / 100:.2f} USD ({abs(pct):.2f} %) {word} list prices; "
        "each team's share of the pool is scaled by the same factor"
    )
