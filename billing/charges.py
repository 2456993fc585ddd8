"""From each instance's measured cost to exact charges: who pays which micro-cent.

Allocation's SQL (``billing.allocation``) measures, per instance, what its GPUs cost (GPU time
and energy, summed in floats from the samples) and what each team's requests used of that
(their shares). Here those floats become integers, once per instance (``billing.rounding``),
and are then only divided:

- the teams' shares of an instance are a split of what they used of it, never more than the
  instance cost;
- unattributed tokens (``billing.reconciliation``) claim a split of what the teams left, never
  more;
- what is left after both is the instance's idle capacity, charged by its group's idle policy
  as a split again.

So every instance's lines add up to its cost exactly, and the statement's lines to the fleet's
cost, whatever the inputs: shares computed from a ledger that moved between two reads, or float
sums a few units off, can only make a split smaller, never create money. The fleet's cost is the
sum of the instances' costs, by the same construction.

An instance whose measured cost is not a finite amount below ``MAX_INSTANCE_USD`` cannot be a
real bill (a sample beyond anything a board can draw, kept before ingest refused such samples):
it is left out of the fleet's cost and shown as an error line naming the instance and the
minute of its highest cost, so one bad row never stops a month.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

import polars as pl

from billing.pricebook import PriceBook
from billing.rounding import microcents, split
from billing.schema import SLOT_SECONDS

__all__ = [
    "CASH",
    "CHARGE_SCHEMA",
    "ERROR_PREFIX",
    "MAX_INSTANCE_USD",
    "UNALLOCATED",
    "Charges",
    "IdlePolicy",
    "Policy",
    "charge",
    "out_of_range_model",
]

UNALLOCATED: Final = "(unallocated)"
# The model of a line that could not be priced starts with this; the rest says why.
ERROR_PREFIX: Final = "(error) "
# The money columns of a line, in integer micro-cents.
CASH: Final = ("compute_microcents", "energy_microcents", "idle_microcents")
# No instance costs this much in a month: a measured cost above it is a bad sample, not a bill.
# Far below where integer sums of a fleet's instances could leave a 64-bit column.
MAX_INSTANCE_USD: Final = 1e9

IdlePolicy = Literal["spread", "platform", "owner"]

Key = tuple[str, str]  # (replica group, instance)
Line = tuple[str, str]  # (team, model)


@dataclass(frozen=True, slots=True)
class Policy:
    """Everything allocation needs besides the measurements: prices and rules.

    ``prices`` is the one price object of billing (``billing.pricebook.PriceBook``: node pools,
    dated rates, energy with its PUE), the same the efficiency figures and the rates are priced
    by; ``listed`` makes one of list prices by GPU model, as tests and worked examples state them.
    """

    prices: PriceBook
    allocation: Literal["in_flight", "tokens", "requests"] = "in_flight"
    prompt_weight: float = 1.0
    completion_weight: float = 1.0
    # What a prompt token served from vLLM's prefix cache weighs under ``tokens``; None: as much
    # as an uncached one (``prompt_weight``), so a policy built without it splits as before.
    cached_prompt_weight: float | None = None
    platform_account: str = "platform"
    # replica group -> (idle policy, owner team); a group not listed spreads its idle capacity.
    idle: Mapping[str, tuple[IdlePolicy, str | None]] = field(default_factory=dict)
    # replica group -> model, for idle lines of instances that served nothing in the month.
    replica_model: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def listed(
        cls,
        usd_per_gpu_hour: Mapping[str, float],
        usd_per_kwh: float = 0.0,
        pue: float = 1.0,
        **rules: Any,
    ) -> Policy:
        """A policy at list prices: ``usd_per_gpu_hour`` by GPU model on every node, energy at
        ``usd_per_kwh`` x ``pue``; ``rules``: the other fields."""
        book = PriceBook(dict(usd_per_gpu_hour), float(usd_per_kwh) * float(pue))
        return cls(book, **rules)


CHARGE_SCHEMA: Final = {
    "replica": pl.String,
    "instance": pl.String,
    "team": pl.String,
    "model": pl.String,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "gpu_hours": pl.Float64,
    "energy_kwh": pl.Float64,
    **dict.fromkeys(CASH, pl.Int64),
}


@dataclass(frozen=True, slots=True)
class Charges:
    """What every instance charges whom, in ``CHARGE_SCHEMA`` rows, and the fleet's cost.

    ``rows``: per instance, team and model, the tokens (of unattributed lines), GPU-hours and
    kWh, and the compute, energy and idle micro-cents. ``fleet_microcents``: the instances'
    costs summed, which the rows' cash adds up to exactly. ``errors``: a line per instance
    whose cost was out of range (team, model saying why, GPU-hours, kWh; no money).
    """

    rows: pl.DataFrame
    fleet_microcents: int
    errors: list[dict[str, Any]]


class _Book:
    """Charges accumulated per (replica, instance, team, model), in the order first charged."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str, str, str], list[Any]] = {}

    def add(
        self,
        at: Key,
        line: Line,
        *,
        tokens: tuple[int, int] = (0, 0),
        quantities: tuple[float, float] = (0.0, 0.0),
        compute: int = 0,
        energy: int = 0,
        idle: int = 0,
    ) -> None:
        row = self._rows.setdefault((*at, *line), [0, 0, 0.0, 0.0, 0, 0, 0])
        for i, v in enumerate((*tokens, *quantities, compute, energy, idle)):
            row[i] += v

    def frame(self) -> pl.DataFrame:
        rows = [(*k, *v) for k, v in self._rows.items()]
        return pl.DataFrame(rows, schema=CHARGE_SCHEMA, orient="row")


def _number(value: Any) -> float:
    """A float of a query's cell (None, a SQL NULL, is 0)."""
    return 0.0 if value is None else float(value)


def _paid(total: int, used: Sequence[float]) -> list[int]:
    """Parts of ``total`` for what each of ``used`` (USD) used of it; at most ``total`` in all."""
    weights = [u if math.isfinite(u) and u > 0 else 0.0 for u in used]
    wanted = math.fsum(weights)
    amount = min(total, microcents(wanted)) if math.isfinite(wanted) else total
    if amount <= 0:
        return [0] * len(weights)
    return split(amount, weights)


def _by_instance(frame: pl.DataFrame | None) -> dict[Key, list[dict[str, Any]]]:
    """``frame``'s rows by (replica, instance), each instance's in a fixed order."""
    out: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    if frame is None or frame.height == 0:
        return out
    for row in frame.sort("replica", "instance", "team", "model").iter_rows(named=True):
        out[(row["replica"], row["instance"])].append(row)
    return out


def out_of_range_model(
    replica: str, instance: str, amount_usd: float, peak_slot: int | None
) -> str:
    """The model column of the error line for an instance whose cost is out of range: the reason."""
    when = ""
    if peak_slot is not None:
        minute = datetime.fromtimestamp(peak_slot * SLOT_SECONDS, UTC)
        when = f", highest in the minute of {minute:%Y-%m-%dT%H:%MZ}"
    group = f"group {replica}" if replica else "no group"
    return (
        f"{ERROR_PREFIX}cost out of range: instance {instance or '(none)'} ({group}) measured "
        f"{amount_usd:.6g} USD{when}; its GPU samples are beyond what a board can draw"
    )


def _totals(
    instances: pl.DataFrame, platform: str
) -> tuple[dict[Key, tuple[int, int]], list[dict[str, Any]]]:
    """Each instance's compute and energy cost in micro-cents; error lines for the unbillable."""
    totals: dict[Key, tuple[int, int]] = {}
    errors: list[dict[str, Any]] = []
    for row in instances.sort("replica", "instance").iter_rows(named=True):
        key = (row["replica"], row["instance"])
        compute, energy = _number(row["compute_usd"]), _number(row["energy_usd"])
        amount = compute + energy
        if math.isfinite(amount) and compute >= 0 and energy >= 0 and amount <= MAX_INSTANCE_USD:
            totals[key] = (microcents(compute), microcents(energy))
            continue
        quantities = [_number(row.get(c)) for c in ("gpu_hours", "energy_kwh")]
        errors.append(
            {
                "team": platform,
                "model": out_of_range_model(*key, amount, row.get("peak_slot")),
                "requests": 0,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "gpu_hours": quantities[0] if math.isfinite(quantities[0]) else 0.0,
                "energy_kwh": quantities[1] if math.isfinite(quantities[1]) else 0.0,
                **dict.fromkeys(CASH, 0),
            }
        )
    return totals, errors


def charge(
    instances: pl.DataFrame,
    shares: pl.DataFrame,
    policy: Policy,
    claims: pl.DataFrame | None = None,
) -> Charges:
    """Every instance's cost as exact charges (``Charges``).

    ``instances``: replica, instance, compute_usd, energy_usd, gpu_hours, energy_kwh, peak_slot
    (``AllocationSql.instances``). ``shares``: replica, instance, team, model, gpu_hours,
    energy_kwh, compute_usd, energy_usd: what each team and model used of each instance.
    ``claims``: the same columns plus prompt_tokens and completion_tokens, for lines that take
    their money out of an instance's idle capacity (``billing.reconciliation.claim_rows``).
    """
    book = _Book()
    totals, errors = _totals(instances, policy.platform_account)
    used, claimed = _by_instance(shares), _by_instance(claims)
    idle: dict[Key, int] = {}
    paid: dict[Key, dict[Line, int]] = {}
    for key, (compute, energy) in totals.items():
        free = [compute, energy]
        for rows, tokens in ((used.get(key, []), False), (claimed.get(key, []), True)):
            parts = [
                _paid(free[0], [_number(r["compute_usd"]) for r in rows]),
                _paid(free[1], [_number(r["energy_usd"]) for r in rows]),
            ]
            for r, c, e in zip(rows, *parts, strict=True):
                line = (r["team"], r["model"])
                book.add(
                    key,
                    line,
                    tokens=_tokens(r) if tokens else (0, 0),
                    quantities=_quantities(r),
                    compute=c,
                    energy=e,
                )
                if not tokens:
                    mine = paid.setdefault(key, {})
                    mine[line] = mine.get(line, 0) + c + e
            free = [free[0] - sum(parts[0]), free[1] - sum(parts[1])]
        idle[key] = free[0] + free[1]
    # Unattributed tokens seen on an instance whose cost is out of range: their tokens, no money.
    for key in claimed.keys() - totals.keys():
        for r in claimed[key]:
            book.add(key, (r["team"], r["model"]), tokens=_tokens(r))
    _charge_idle(book, idle, paid, policy)
    fleet = sum(c + e for c, e in totals.values())
    return Charges(book.frame(), fleet, errors)


def _tokens(row: Mapping[str, Any]) -> tuple[int, int]:
    return int(row.get("prompt_tokens") or 0), int(row.get("completion_tokens") or 0)


def _quantities(row: Mapping[str, Any]) -> tuple[float, float]:
    return _number(row.get("gpu_hours")), _number(row.get("energy_kwh"))


def _charge_idle(
    book: _Book, idle: Mapping[Key, int], paid: Mapping[Key, Mapping[Line, int]], policy: Policy
) -> None:
    """Each instance's idle capacity, charged by its replica group's ``idle_policy``."""
    by_group: dict[str, dict[Line, int]] = defaultdict(dict)
    for (replica, _), lines in paid.items():
        group = by_group[replica]
        for line, amount in lines.items():
            group[line] = group.get(line, 0) + amount
    for key in sorted(idle):
        amount = idle[key]
        if amount <= 0:
            continue
        replica = key[0]
        rule, owner = policy.idle.get(replica, ("spread", None))
        model = policy.replica_model.get(replica, UNALLOCATED)
        if replica == "":
            book.add(key, (policy.platform_account, UNALLOCATED), idle=amount)
        elif rule == "owner" and owner:
            book.add(key, (owner, model), idle=amount)
        elif rule == "spread" and (
            payers := _payers(paid.get(key, {})) or _payers(by_group[replica])
        ):
            # Nobody used this instance (one the autoscaler just added, say): its idle follows
            # what the teams paid on its group.
            for line, part in zip(payers, split(amount, list(payers.values())), strict=True):
                book.add(key, line, idle=part)
        else:
            book.add(key, (policy.platform_account, model), idle=amount)


def _payers(lines: Mapping[Line, int]) -> dict[Line, int]:
    """The lines that paid something, in a fixed order."""
    return {line: lines[line] for line in sorted(lines) if lines[line] > 0}
