"""The price book: what a GPU-minute costs, on which node, at which minute.

Platform teams pay for GPUs in several ways at once: some node pools on demand, some under a
commitment paid whether used or not, some on spot, some bought outright. The configuration's
``prices`` section says so (``infermeter.config.Prices``): a list price per GPU model, and node
pools (a node list or a glob on node names) with dated entries, each in effect from its minute
until the next entry. This module turns that into what the ledger's SQL needs, with no I/O:

- ``priced_sql``: the GPU rows (``gpu_slots``) with their pool, pricing category, SKU, USD per
  GPU-hour and USD per kWh (energy price x PUE) in effect at their minute. A price change
  mid-month splits the month at that minute, because every minute is priced by the entry in
  effect at it. A node in no pool is priced by its GPU model, on demand, as pool
  ``(default) <gpu model>``. A pool's minutes before its first entry fall back to the same.
- ``owned_rate``: the GPU-hour rate of owned hardware, by straight-line depreciation::

      (purchase - salvage) / depreciation_months + hosting per GPU-month
      ------------------------------------------------------------------
                          HOURS_PER_MONTH (730)

  Power is not in it: an owned GPU's energy is billed as measured, kWh x USD/kWh x PUE, like
  every GPU's. The rate is what the hardware costs per hour of its life whether it is used or
  not, so its idle hours are idle capacity, exactly as for any other GPU.
- ``commitments``: a committed entry pays for ``committed_gpus`` around the clock. Measured
  GPU time in the pool is charged at the committed rate as usual; what the commitment paid for
  and no GPU ran is the pool's *unused commitment*, a line of its own (like idle capacity),
  with the commitment's utilisation. GPU time beyond the commitment is charged at the same rate
  (a commitment that bills overage at another rate is two entries: configure the overage's
  pool separately).
- ``scaled``: the allocation basis. With an imported invoice for a pool, every price of the
  pool in the month is multiplied by ``invoice / list cost`` (list cost = the pool's measured
  cost plus its unused commitment at list prices), so the same exact split that makes lines
  add up to the fleet cost makes the pool's lines add up to its invoice.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from infermeter.config import NodePool, PoolPrice, Prices
from infermeter.pricing import HOURS_PER_MONTH

__all__ = [
    "DEFAULT_POOL_PREFIX",
    "Commitment",
    "PriceBook",
    "Rate",
    "categories",
    "commitments",
    "compute_usd_sql",
    "default_pool",
    "energy_usd_sql",
    "entry_rate",
    "owned_rate",
    "pool_name_sql",
    "price_book",
    "priced_sql",
]

# A node in no configured pool is priced by its GPU model, in the pool named so.
DEFAULT_POOL_PREFIX: Final = "(default) "
_SLOT: Final = 60


def compute_usd_sql(gpu_seconds: str, usd_per_gpu_hour: str) -> str:
    """GPU time's cost in USD, as an SQL expression: GPU-seconds at a price per GPU-hour.

    With ``energy_usd_sql``, the one GPU-minute cost formula: the statements' allocation, the
    efficiency figures and the sidecars' rates cost every GPU row with these two and the prices
    ``priced_sql`` gives it, so they agree on what a minute cost. What an unpriced GPU (``usd``
    NULL) costs is the caller's to say, by the price expression it passes: allocation leaves
    its time out as an error line, the estimates count it as free.
    """
    return f"{gpu_seconds} / 3600.0 * {usd_per_gpu_hour}"


def energy_usd_sql(energy_joules: str, usd_per_kwh: str) -> str:
    """Energy's cost in USD, as an SQL expression: joules at a price per kWh (PUE included)."""
    return f"{energy_joules} / 3.6e6 * {usd_per_kwh}"


def default_pool(gpu_model: str) -> str:
    """The pool name of nodes in no configured pool with GPUs of ``gpu_model``."""
    return DEFAULT_POOL_PREFIX + gpu_model


def owned_rate(entry: PoolPrice) -> float:
    """USD per GPU-hour of owned hardware: depreciation plus hosting, over ``HOURS_PER_MONTH``."""
    purchase = entry.purchase_usd_per_gpu or 0.0
    months = entry.depreciation_months or 1
    monthly = (purchase - entry.salvage_usd_per_gpu) / months + entry.hosting_usd_per_gpu_month
    return monthly / HOURS_PER_MONTH


def entry_rate(entry: PoolPrice) -> float:
    """USD per GPU-hour of ``entry``: its rate, or worked out from the purchase if owned."""
    if entry.category == "owned":
        return owned_rate(entry)
    return float(entry.usd_per_gpu_hour or 0.0)


@dataclass(frozen=True, slots=True)
class Rate:
    """One pool's price from ``start`` (epoch seconds, on a minute) until its next rate."""

    pool: str
    start: float
    category: str
    usd_per_gpu_hour: float
    usd_per_kwh: float  # energy price x PUE
    committed_gpus: int | None = None
    sku: str | None = None


@dataclass(frozen=True, slots=True)
class PriceBook:
    """The price book as allocation reads it: list prices, pools and their dated rates.

    ``scale``: pool -> factor multiplying every price of the pool (the allocation basis; 1 when
    absent). ``nodes`` and ``patterns``: how a node finds its pool, first match in ``order``.
    """

    usd_per_gpu_hour: Mapping[str, float]
    usd_per_kwh: float = 0.0
    order: tuple[str, ...] = ()
    nodes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    patterns: Mapping[str, str] = field(default_factory=dict)
    rates: tuple[Rate, ...] = ()
    scale: Mapping[str, float] = field(default_factory=dict)

    @property
    def has_pools(self) -> bool:
        """Whether any node pool is configured (without one, prices go by GPU model only)."""
        return bool(self.order)

    def pool_of(self, node: str) -> str | None:
        """The configured pool ``node`` belongs to: the first that names or matches it."""
        for name in self.order:
            if node in self.nodes.get(name, frozenset()):
                return name
            pattern = self.patterns.get(name)
            if pattern is not None and fnmatch.fnmatchcase(node, pattern):
                return name
        return None

    def rates_of(self, pool: str) -> list[Rate]:
        """``pool``'s rates, oldest first."""
        return [r for r in self.rates if r.pool == pool]

    def scaled(self, factors: Mapping[str, float]) -> PriceBook:
        """This price book with every price of each pool in ``factors`` multiplied by its factor."""
        return PriceBook(
            self.usd_per_gpu_hour,
            self.usd_per_kwh,
            self.order,
            self.nodes,
            self.patterns,
            self.rates,
            dict(factors),
        )


def price_book(prices: Prices) -> PriceBook:
    """The ``PriceBook`` of a configuration's ``prices`` section."""
    energy = prices.usd_per_kwh * prices.pue
    return PriceBook(
        usd_per_gpu_hour=dict(prices.usd_per_gpu_hour),
        usd_per_kwh=energy,
        order=tuple(p.name for p in prices.pools),
        nodes={p.name: frozenset(p.nodes) for p in prices.pools},
        patterns={p.name: p.node_pattern for p in prices.pools if p.node_pattern is not None},
        rates=tuple(_rate(pool, e, prices) for pool in prices.pools for e in pool.prices),
    )


def _rate(pool: NodePool, entry: PoolPrice, prices: Prices) -> Rate:
    kwh = prices.usd_per_kwh if entry.usd_per_kwh is None else entry.usd_per_kwh
    pue = prices.pue if entry.pue is None else entry.pue
    return Rate(
        pool.name,
        entry.from_,
        entry.category,
        entry_rate(entry),
        kwh * pue,
        entry.committed_gpus,
        entry.sku,
    )


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _num(value: float) -> str:
    return f"{float(value)!r}::DOUBLE"


def pool_name_sql(pool: str, gpu_model: str) -> str:
    """SQL: the pool name of a priced row (``priced_sql``): its pool, or its GPU model's default."""
    return f"coalesce({pool}, {_lit(DEFAULT_POOL_PREFIX)} || {gpu_model})"


def _default_kwh_sql(book: PriceBook) -> str:
    """SQL: USD per kWh (PUE included) of a GPU row priced by its GPU model, scaled if it is."""
    scaled = [
        (m, f)
        for m in sorted(book.usd_per_gpu_hour)
        if (f := book.scale.get(default_pool(m), 1.0)) != 1.0
    ]
    if not scaled:
        return _num(book.usd_per_kwh)
    whens = " ".join(
        f"WHEN g.gpu_model = {_lit(m)} THEN {_num(book.usd_per_kwh * f)}" for m, f in scaled
    )
    return f"CASE {whens} ELSE {_num(book.usd_per_kwh)} END"


def _pool_case(book: PriceBook, node: str) -> str:
    """SQL: the configured pool of ``node`` (a column), NULL for none; first match wins."""
    whens = []
    for name in book.order:
        tests = []
        listed = sorted(book.nodes.get(name, frozenset()))
        if listed:
            tests.append(f"{node} IN ({', '.join(_lit(n) for n in listed)})")
        if name in book.patterns:
            tests.append(f"{node} GLOB {_lit(book.patterns[name])}")
        whens.append(f"WHEN {' OR '.join(tests)} THEN {_lit(name)}")
    return f"CASE {' '.join(whens)} ELSE NULL END" if whens else "NULL::VARCHAR"


def priced_sql(book: PriceBook, gpus: str, nodes_from: str | None = None) -> str:
    """A parenthesised subquery: ``gpus`` (gpu_slots rows) priced by ``book``.

    Adds ``pool`` (NULL for a GPU priced by its GPU model: pool ``default_pool(gpu_model)``,
    named only where rows are few, as ``pool_name_sql`` does), ``category``, ``sku``,
    ``rate_slot`` (the first minute of the pool's rate in
    effect; NULL for a list price), ``usd`` (per GPU-hour) and ``kwh_usd`` (per kWh, PUE
    included), each in effect at the row's minute, scaled for the allocation basis; ``usd`` is
    NULL for a GPU that nothing prices (a GPU model without a list price on a node in no pool,
    or before its pool's first entry), which allocation shows as an error line. The node ->
    pool mapping is worked out once per distinct node, and a pool's dated rates are matched by
    an ASOF join, so a price book adds two small joins to the pass over the GPU rows.
    ``nodes_from``: a cheaper relation with the same nodes as ``gpus``, to list them from.
    """
    models = sorted(book.usd_per_gpu_hour.items())
    list_rows = ", ".join(
        f"({_lit(m)}, {_num(p * book.scale.get(default_pool(m), 1.0))})" for m, p in models
    )
    list_prices = (
        f"(VALUES {list_rows}) AS lp(gpu_model, list_usd)"
        if list_rows
        else "(SELECT NULL::VARCHAR AS gpu_model, NULL::DOUBLE AS list_usd WHERE false) AS lp"
    )
    default_kwh = _default_kwh_sql(book)
    if not book.has_pools:
        # Prices by GPU model only: one small join, as before pools existed.
        return f"""(SELECT g.*, NULL::VARCHAR AS pool, 'on_demand' AS category, NULL::VARCHAR AS sku, NULL::BIGINT AS rate_slot,
    lp.list_usd AS usd, {default_kwh} AS kwh_usd
    FROM {gpus} g LEFT JOIN {list_prices} USING (gpu_model))"""
    rate_rows = ", ".join(
        f"({_lit(r.pool)}, {int(r.start // _SLOT)}::BIGINT, {_lit(r.category)}, "
        f"{_lit(r.sku) if r.sku else 'NULL::VARCHAR'}, "
        f"{_num(r.usd_per_gpu_hour * book.scale.get(r.pool, 1.0))}, "
        f"{_num(r.usd_per_kwh * book.scale.get(r.pool, 1.0))})"
        for r in book.rates
    )
    rates = f"(VALUES {rate_rows}) AS r(pool, from_slot, category, sku, usd, kwh_usd)"
    return f"""(SELECT g.* EXCLUDE (node_pool),
    r.pool AS pool,
    coalesce(r.category, 'on_demand') AS category, r.sku AS sku, r.from_slot AS rate_slot,
    CASE WHEN r.pool IS NOT NULL THEN r.usd ELSE lp.list_usd END AS usd,
    CASE WHEN r.pool IS NOT NULL THEN r.kwh_usd ELSE {default_kwh} END AS kwh_usd
    FROM (SELECT g.*, np.node_pool FROM {gpus} g
        JOIN (SELECT node, {_pool_case(book, "node")} AS node_pool
              FROM (SELECT DISTINCT node FROM {nodes_from or gpus})) np USING (node)) g
    ASOF LEFT JOIN {rates} ON r.pool = g.node_pool AND g.slot >= r.from_slot
    LEFT JOIN {list_prices} USING (gpu_model))"""


@dataclass(frozen=True, slots=True)
class Commitment:
    """One committed rate's month: what it paid for, what ran under it, what was left unused."""

    pool: str
    start: float
    end: float
    committed_gpu_hours: float
    used_gpu_hours: float
    usd_per_gpu_hour: float

    @property
    def committed_usd(self) -> float:
        """The commitment's price for its hours in the month, used or not."""
        return self.committed_gpu_hours * self.usd_per_gpu_hour

    @property
    def unused_gpu_hours(self) -> float:
        """GPU-hours paid for and not run (never negative: overage is billed as measured)."""
        return max(0.0, self.committed_gpu_hours - self.used_gpu_hours)

    @property
    def unused_usd(self) -> float:
        """What the unused GPU-hours cost: the unused commitment's line."""
        return self.unused_gpu_hours * self.usd_per_gpu_hour

    @property
    def utilization(self) -> float:
        """The share of the committed GPU-hours that ran (1 when nothing was committed)."""
        if self.committed_gpu_hours <= 0:
            return 1.0
        return min(1.0, self.used_gpu_hours / self.committed_gpu_hours)


def commitments(
    book: PriceBook, start: float, end: float, used: Mapping[tuple[str, int], float]
) -> list[Commitment]:
    """The committed rates in effect in [``start``, ``end``), each with its GPU-hours used.

    ``used``: GPU-hours measured per (pool, first slot of the rate in effect), as the priced
    GPU rows group them (``priced_sql``'s rows summed by pool and the rate's ``from_slot``).
    Each committed rate counts the part of the month it was in effect: a commitment that starts
    mid-month pays for the rest of the month only. Prices are the book's (scaled when it is).
    """
    out = []
    for pool in book.order:
        rates = book.rates_of(pool)
        for i, rate in enumerate(rates):
            if rate.category != "committed" or not rate.committed_gpus:
                continue
            until = rates[i + 1].start if i + 1 < len(rates) else math.inf
            lo, hi = max(start, rate.start), min(end, until)
            if hi <= lo:
                continue
            hours = (hi - lo) / 3600.0 * rate.committed_gpus
            ran = used.get((pool, int(rate.start // _SLOT)), 0.0)
            factor = book.scale.get(pool, 1.0)
            out.append(Commitment(pool, lo, hi, hours, ran, rate.usd_per_gpu_hour * factor))
    return out


def categories(book: PriceBook, pools: Sequence[str], start: float, end: float) -> dict[str, str]:
    """Each pool's pricing categories in effect in [``start``, ``end``), joined by ``+`` in order."""
    out = {}
    for pool in pools:
        seen: list[str] = []
        rates = book.rates_of(pool)
        for i, rate in enumerate(rates):
            until = rates[i + 1].start if i + 1 < len(rates) else math.inf
            if rate.start < end and until > start and rate.category not in seen:
                seen.append(rate.category)
        out[pool] = "+".join(seen) or "on_demand"
    return out
