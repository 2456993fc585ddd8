"""The price book: node pools, dated prices, commitments, owned hardware, and the invoice basis.

Each worked example is small enough to check by hand; the expected cents are worked out in the
comments. Prices here are chosen so that money is whole cents where it can be.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from billing import invoice_store
from billing.allocation import (
    Allocation,
    Policy,
    allocation_sql,
    run_all,
    unused_commitment_model,
)
from billing.bases import INVOICED_UNMEASURED, pool_frame, scaled_policy, with_unmeasured
from billing.pricebook import default_pool, owned_rate, price_book
from billing.rounding import cents
from billing.statement import cents_lines, merged
from infermeter.config import PoolPrice, Prices

# 2026-11-01 00:00 UTC, and the month's [start, end): 30 days.
NOV = 1793491200
NOV_END = NOV + 30 * 86400
HOUR_SLOTS = 60


def _book(**prices: Any) -> Prices:
    return Prices.model_validate({"usd_per_gpu_hour": {"H100": 4.0}} | prices)


def _policy(prices: Prices, **kw: Any) -> Policy:
    base: dict[str, Any] = {
        "prices": price_book(prices),
        "replica_model": {"r1": "m", "r2": "m"},
    }
    return Policy(**(base | kw))


def _gpu(
    node: str,
    start_slot: int,
    minutes: int,
    replica: str = "r1",
    watts: float = 0.0,
    gpu_model: str = "H100",
) -> list[dict[str, Any]]:
    """One GPU of ``replica`` on ``node`` seen for ``minutes`` whole minutes from ``start_slot``."""
    return [
        {
            "replica": replica,
            "instance": replica,
            "node": node,
            "gpu_model": gpu_model,
            "slot": start_slot + i,
            "gpu_seconds": 60.0,
            "energy_joules": watts * 60.0,
        }
        for i in range(minutes)
    ]


def _busy(
    team: str, start_slot: int, minutes: int, replica: str = "r1", seconds: float = 60.0
) -> list[dict[str, Any]]:
    """``team`` with a request in flight on ``replica`` for ``seconds`` of each of ``minutes``."""
    return [
        {
            "replica": replica,
            "instance": replica,
            "team": team,
            "model": "m",
            "slot": start_slot + i,
            "inflight_seconds": seconds,
            "requests": 1 if i == 0 else 0,
            "prompt_tokens": 0,
            "cached_prompt_tokens": 0,
            "completion_tokens": 0,
        }
        for i in range(minutes)
    ]


def _run(usage: list[dict[str, Any]], gpus: list[dict[str, Any]], policy: Policy) -> Allocation:
    """``run_all`` over two in-memory frames, for November."""
    import duckdb

    con = duckdb.connect()
    try:
        usage_frame = pl.DataFrame(
            usage,
            schema={
                "replica": pl.String,
                "instance": pl.String,
                "team": pl.String,
                "model": pl.String,
                "slot": pl.Int64,
                "inflight_seconds": pl.Float64,
                "requests": pl.Int64,
                "prompt_tokens": pl.Int64,
                "cached_prompt_tokens": pl.Int64,
                "completion_tokens": pl.Int64,
            },
        )
        con.register("usage_in", usage_frame)
        con.register("gpus_in", pl.DataFrame(gpus))
        queries = allocation_sql(policy, "usage_in", "gpus_in", period=(NOV, NOV_END))
        return run_all(con, queries, policy)
    finally:
        con.close()


def _cents_by_team(result: Allocation) -> dict[str, int]:
    lines = cents_lines("2026-11", merged(result.lines))
    return {
        str(team): int(total)
        for team, total in lines.group_by("team").agg(pl.col("total_cents").sum()).iter_rows()
    }


def _slot(iso_day: int, hour: int = 0) -> int:
    """The slot of 2026-11-``iso_day`` at ``hour``:00 UTC."""
    return (NOV + (iso_day - 1) * 86400 + hour * 3600) // 60


def test_a_price_change_mid_month_splits_the_month_at_its_minute() -> None:
    """$2.00/GPU-hour until 16 Nov 00:00, then $3.00: an hour busy on each side costs 500 cents.

    search holds the GPU for an hour on 10 Nov (1 GPU-hour x $2.00 = 200 cents) and an hour on
    20 Nov (1 x $3.00 = 300 cents): 500 cents, no idle, no energy.
    """
    prices = _book(
        pools=[
            {
                "name": "a100",
                "nodes": ["n1"],
                "prices": [
                    {"from": "2026-11-01", "category": "on_demand", "usd_per_gpu_hour": 2.0},
                    {
                        "from": "2026-11-16T00:00:00Z",
                        "category": "on_demand",
                        "usd_per_gpu_hour": 3.0,
                    },
                ],
            }
        ]
    )
    gpus = _gpu("n1", _slot(10), 60) + _gpu("n1", _slot(20), 60)
    usage = _busy("search", _slot(10), 60) + _busy("search", _slot(20), 60)
    result = _run(usage, gpus, _policy(prices))
    assert _cents_by_team(result) == {"search": 500}
    assert cents(result.fleet_microcents) == 500
    # The minute before the change is at the old price, the minute of it at the new one.
    edge = _gpu("n1", _slot(16) - 1, 2)
    edge_cost = _run(_busy("search", _slot(16) - 1, 2), edge, _policy(prices))
    # $2.00/60 + $3.00/60 = $0.083333..., 8,333,333 micro-cents (10^-8 USD).
    assert edge_cost.fleet_microcents == 8_333_333


def test_a_node_in_no_pool_keeps_its_gpu_models_list_price() -> None:
    """Node n9 is in no pool: its H100 hour is at the list price, $4.00, in pool (default) H100."""
    prices = _book(
        pools=[
            {
                "name": "a100",
                "nodes": ["n1"],
                "prices": [{"from": "2026-11-01", "usd_per_gpu_hour": 2.0}],
            }
        ]
    )
    result = _run(_busy("search", _slot(3), 60), _gpu("n9", _slot(3), 60), _policy(prices))
    assert _cents_by_team(result) == {"search": 400}
    assert result.pools["pool"].to_list() == [default_pool("H100")]


def test_pools_match_by_name_pattern_first_listed_wins() -> None:
    """gke-spot-7 matches both the glob of pool spot and that of pool any: spot is listed first."""
    prices = _book(
        pools=[
            {
                "name": "spot",
                "node_pattern": "gke-spot-*",
                "prices": [{"from": "2026-11-01", "category": "spot", "usd_per_gpu_hour": 0.9}],
            },
            {
                "name": "any",
                "node_pattern": "gke-*",
                "prices": [{"from": "2026-11-01", "usd_per_gpu_hour": 5.0}],
            },
        ]
    )
    book = price_book(prices)
    assert book.pool_of("gke-spot-7") == "spot"
    assert book.pool_of("gke-ondemand-1") == "any"
    assert book.pool_of("bare-metal-1") is None


def test_a_spot_pool_two_gpu_hours_at_ninety_cents() -> None:
    """Two GPUs of the spot pool, each an hour busy: 2 x $0.90 = 180 cents, category spot."""
    prices = _book(
        pools=[
            {
                "name": "spot",
                "node_pattern": "spot-*",
                "prices": [{"from": "2026-11-01", "category": "spot", "usd_per_gpu_hour": 0.9}],
            }
        ]
    )
    gpus = _gpu("spot-1", _slot(5), 60) + _gpu("spot-2", _slot(5), 60, replica="r2")
    usage = _busy("search", _slot(5), 60) + _busy("search", _slot(5), 60, replica="r2")
    policy = _policy(prices)
    result = _run(usage, gpus, policy)
    assert _cents_by_team(result) == {"search": 180}
    pools = pool_frame(policy.prices, (NOV, NOV_END), result, None, {})
    assert pools.select("pool", "category", "list_cents").rows() == [("spot", "spot", 180)]


def test_owned_hardware_amortised_over_36_months() -> None:
    """$30,000 a GPU, $3,000 salvage, 36 months, $150/GPU-month hosting; 1 kW at $0.10 x PUE 1.2.

    Depreciation: (30,000 - 3,000) / 36 = $750 a month; plus hosting, $900 a GPU-month; over
    730 hours, $1.232876... a GPU-hour. One hour busy: 123.29 cents of GPU time; its 1 kWh
    costs $0.10 x 1.2 = 12 cents. The team pays 123.29 + 12 = 135.29, 135 cents.
    """
    entry = PoolPrice.model_validate(
        {
            "from": "2026-11-01",
            "category": "owned",
            "purchase_usd_per_gpu": 30000,
            "depreciation_months": 36,
            "salvage_usd_per_gpu": 3000,
            "hosting_usd_per_gpu_month": 150,
        }
    )
    assert owned_rate(entry) == pytest.approx(900 / 730)
    prices = _book(
        usd_per_kwh=0.10,
        pue=1.2,
        pools=[{"name": "rack", "nodes": ["r-1"], "prices": [entry.model_dump(by_alias=True)]}],
    )
    result = _run(
        _busy("search", _slot(7), 60), _gpu("r-1", _slot(7), 60, watts=1000.0), _policy(prices)
    )
    assert _cents_by_team(result) == {"search": 135}
    lines = result.lines.filter(pl.col("team") == "search")
    assert int(lines["compute_microcents"].sum()) == round(900 / 730 * 10**8)
    assert int(lines["energy_microcents"].sum()) == 12 * 10**6


def test_a_pool_energy_price_replaces_the_books() -> None:
    """A cloud pool whose rate includes power: usd_per_kwh 0 there, while the book says $0.20."""
    prices = _book(
        usd_per_kwh=0.20,
        pools=[
            {
                "name": "cloud",
                "nodes": ["c1"],
                "prices": [{"from": "2026-11-01", "usd_per_gpu_hour": 3.0, "usd_per_kwh": 0.0}],
            }
        ],
    )
    result = _run(
        _busy("search", _slot(2), 60), _gpu("c1", _slot(2), 60, watts=700.0), _policy(prices)
    )
    assert _cents_by_team(result) == {"search": 300}


def test_a_committed_pool_half_used_pays_the_unused_half_as_its_own_line() -> None:
    """2 GPUs committed at $1.50 from 30 Nov 22:00 to month end (2 hours): 4 GPU-hours, $6.00.

    One GPU ran those 2 hours, busy for search: 2 GPU-hours x $1.50 = 300 cents on search's
    line. The other 2 committed GPU-hours ran nowhere: 300 cents of unused commitment, the
    platform's, as its own line. Utilisation 50 %; the month's committed amount is paid whole.
    """
    prices = _book(
        pools=[
            {
                "name": "cud",
                "node_pattern": "cud-*",
                "prices": [
                    {
                        "from": "2026-11-30T22:00:00Z",
                        "category": "committed",
                        "usd_per_gpu_hour": 1.5,
                        "committed_gpus": 2,
                    }
                ],
            }
        ]
    )
    policy = _policy(prices)
    result = _run(_busy("search", _slot(30, 22), 120), _gpu("cud-1", _slot(30, 22), 120), policy)
    assert _cents_by_team(result) == {"search": 300, "platform": 300}
    unused = result.lines.filter(pl.col("model") == unused_commitment_model("cud"))
    assert unused["idle_microcents"].to_list() == [300 * 10**6]
    assert cents(result.fleet_microcents) == 600
    pool = pool_frame(policy.prices, (NOV, NOV_END), result, None, {}).row(0, named=True)
    assert (pool["committed_gpu_hours"], pool["committed_cents"]) == (4.0, 600)
    assert (pool["unused_commitment_cents"], pool["commitment_utilization"]) == (300, 0.5)
    assert pool["category"] == "committed"


def test_an_invoice_seven_percent_above_list_scales_the_pool_to_the_cent() -> None:
    """10 GPU-hours at $2.00 list ($20.00); the invoice says $21.40 (7 % above).

    search holds the GPU 6 of the 10 hours, assistant 2, and 2 hours are idle, spread 3:1 by
    what each paid. List: search 12.00 + 1.50 idle = 13.50... as a share of the pool: search
    0.75, assistant 0.25. Allocation basis: search 21.40 x 0.75 = 16.05 (1605 cents),
    assistant 21.40 x 0.25 = 5.35 (535 cents): 2140 cents, the invoice.
    """
    prices = _book(
        pools=[
            {
                "name": "a100",
                "nodes": ["n1"],
                "prices": [{"from": "2026-11-01", "usd_per_gpu_hour": 2.0}],
            }
        ]
    )
    policy = _policy(prices)
    usage = _busy("search", _slot(4), 360) + _busy("assistant", _slot(4) + 360, 120)
    gpus = _gpu("n1", _slot(4), 600)
    listed = _run(usage, gpus, policy)
    assert _cents_by_team(listed) == {"search": 1500, "assistant": 500}
    invoices = {"a100": 2140}
    scaled_p = scaled_policy(policy, listed.pools, listed.commitments, invoices)
    scaled = _run(usage, gpus, scaled_p)
    assert _cents_by_team(scaled) == {"search": 1605, "assistant": 535}
    pool = pool_frame(policy.prices, (NOV, NOV_END), listed, scaled, invoices).row(0, named=True)
    assert (pool["list_cents"], pool["invoice_cents"], pool["allocation_cents"]) == (
        2000,
        2140,
        2140,
    )
    assert pool["difference_cents"] == 140
    assert "7.00 %" in pool["explanation"]


def test_an_invoice_for_a_pool_that_measured_nothing_is_the_platforms_line() -> None:
    """The invoice bills pool idle-pool ($50.00) where no GPU was seen: a platform line of 5000."""
    prices = _book(
        pools=[
            {
                "name": "a100",
                "nodes": ["n1"],
                "prices": [{"from": "2026-11-01", "usd_per_gpu_hour": 2.0}],
            },
            {
                "name": "idle-pool",
                "nodes": ["n2"],
                "prices": [{"from": "2026-11-01", "usd_per_gpu_hour": 2.0}],
            },
        ]
    )
    policy = _policy(prices)
    usage, gpus = _busy("search", _slot(4), 60), _gpu("n1", _slot(4), 60)
    listed = _run(usage, gpus, policy)
    invoices = {"idle-pool": 5000}
    scaled = with_unmeasured(
        _run(usage, gpus, scaled_policy(policy, listed.pools, listed.commitments, invoices)),
        listed,
        invoices,
        "platform",
    )
    assert _cents_by_team(scaled) == {"search": 200, "platform": 5000}
    line = scaled.lines.filter(pl.col("team") == "platform").row(0, named=True)
    assert line["model"] == f"{INVOICED_UNMEASURED} idle-pool"


def test_the_commitment_is_scaled_with_its_pool_on_the_allocation_basis() -> None:
    """The committed example ($6.00 at list) invoiced at $5.40: search and the unused half 270 each."""
    prices = _book(
        pools=[
            {
                "name": "cud",
                "node_pattern": "cud-*",
                "prices": [
                    {
                        "from": "2026-11-30T22:00:00Z",
                        "category": "committed",
                        "usd_per_gpu_hour": 1.5,
                        "committed_gpus": 2,
                    }
                ],
            }
        ]
    )
    policy = _policy(prices)
    usage, gpus = _busy("search", _slot(30, 22), 120), _gpu("cud-1", _slot(30, 22), 120)
    listed = _run(usage, gpus, policy)
    scaled = _run(
        usage, gpus, scaled_policy(policy, listed.pools, listed.commitments, {"cud": 540})
    )
    assert _cents_by_team(scaled) == {"search": 270, "platform": 270}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    busy=st.lists(
        st.tuples(
            st.sampled_from(["search", "assistant", "research"]),
            st.integers(0, 3),
            st.integers(1, 90),
            st.floats(1.0, 60.0),
        ),
        min_size=1,
        max_size=6,
    ),
    rates=st.lists(st.floats(0.01, 9.0), min_size=3, max_size=3),
    committed=st.integers(1, 4),
    invoice=st.dictionaries(
        st.sampled_from(["a", "b", "cud", "ghost"]), st.integers(0, 500_000), max_size=4
    ),
)
def test_every_basis_adds_up_to_the_cent(
    busy: list[tuple[str, int, int, float]],
    rates: list[float],
    committed: int,
    invoice: dict[str, int],
) -> None:
    """Any usage, prices and invoices: each basis's lines add up to its fleet cost, and on the
    allocation basis each invoiced pool that measured a cost comes to its invoice, to the cent."""
    prices = _book(
        usd_per_kwh=0.13,
        pue=1.4,
        pools=[
            {
                "name": "a",
                "nodes": ["n0"],
                "prices": [
                    {"from": "2026-11-01", "usd_per_gpu_hour": rates[0]},
                    {"from": "2026-11-30T23:00:00Z", "usd_per_gpu_hour": rates[1]},
                ],
            },
            {
                "name": "b",
                "nodes": ["n1"],
                "prices": [
                    {"from": "2026-11-01", "category": "spot", "usd_per_gpu_hour": rates[2]}
                ],
            },
            {
                "name": "cud",
                "nodes": ["n2"],
                "prices": [
                    {
                        "from": "2026-11-30T22:00:00Z",
                        "category": "committed",
                        "usd_per_gpu_hour": rates[0],
                        "committed_gpus": committed,
                    }
                ],
            },
            {
                "name": "ghost",
                "nodes": ["n9"],
                "prices": [{"from": "2026-11-01", "usd_per_gpu_hour": 1.0}],
            },
        ],
    )
    policy = _policy(prices)
    start = _slot(30, 22)
    replicas = {0: "r1", 1: "r2", 2: "r3", 3: "r4"}
    nodes = {0: "n0", 1: "n1", 2: "n2", 3: "n7"}  # n7 is in no pool: the H100 list price
    gpus = [
        row
        for i in range(4)
        for row in _gpu(nodes[i], start, 120, replica=replicas[i], watts=300.0)
    ]
    usage = [
        row
        for team, i, minutes, secs in busy
        for row in _busy(team, start, minutes, replica=replicas[i], seconds=secs)
    ]
    policy = replace(policy, replica_model=dict.fromkeys(replicas.values(), "m"))
    listed = _run(usage, gpus, policy)
    scaled = with_unmeasured(
        _run(usage, gpus, scaled_policy(policy, listed.pools, listed.commitments, invoice)),
        listed,
        invoice,
        "platform",
    )
    for result in (listed, scaled):
        lines = cents_lines("2026-11", merged(result.lines))
        assert int(lines["total_cents"].sum()) == cents(result.fleet_microcents)
    pools = pool_frame(policy.prices, (NOV, NOV_END), listed, scaled, invoice)
    for row in pools.iter_rows(named=True):
        if row["invoice_cents"] is not None:
            assert row["allocation_cents"] == row["invoice_cents"]
    listed_total = sum(
        int(r["list_cents"]) for r in pools.iter_rows(named=True) if r["pool"] not in invoice
    )
    # Invoiced pools at their invoices, the rest at list: the allocation basis's total.
    expected = sum(invoice.values()) + listed_total
    assert abs(cents(scaled.fleet_microcents) - expected) <= len(pools)


# -- the statement, from a ledger ---------------------------------------------------------------

_INVOICE_HEADER = (
    "BillingAccountId,BillingCurrency,BillingPeriodStart,BillingPeriodEnd,ChargePeriodStart,"
    "ChargePeriodEnd,ChargeCategory,ChargeClass,ChargeDescription,BilledCost,EffectiveCost,"
    "ProviderName,PublisherName,InvoiceIssuerName,ResourceId,ServiceCategory,ServiceName,SkuId,Tags\n"
)


def _invoice(month_start: str, month_end: str, usd: str) -> bytes:
    """A FOCUS 1.0 file billing ``usd`` for instance i-lab over the month."""
    return (
        _INVOICE_HEADER + f"acct,USD,{month_start},{month_end},{month_start},{month_end},Usage,,"
        f"L40S hours,{usd},{usd},Cloud,Cloud,Cloud,i-lab,Compute,VMs,sku-l40s,\n"
    ).encode()


@pytest.fixture
def lab_config(config: Any) -> Any:
    """The demo configuration with node-b in pool lab: $2.00 a GPU-hour, power included."""
    prices = Prices.model_validate(
        config.prices.model_dump()
        | {
            "pools": [
                {
                    "name": "lab",
                    "nodes": ["node-b"],
                    "resource_ids": ["i-lab"],
                    "prices": [
                        {
                            "from": "2026-01-01",
                            "category": "on_demand",
                            "usd_per_gpu_hour": 2.0,
                            "usd_per_kwh": 0.0,
                        }
                    ],
                }
            ]
        }
    )
    return config.model_copy(update={"prices": prices})


def _import(ledger: Any, cfg: Any, data: bytes, now: float) -> None:
    from billing.invoices import parse_invoice

    invoice_store.import_invoice(
        ledger, parse_invoice(data, "invoice.csv", cfg.prices.pools, "csv"), now=now
    )


def test_the_statement_reconciles_to_the_invoice_and_keeps_the_usage_basis(
    ledger: Any, lab_config: Any
) -> None:
    """One L40S hour on node-b, pool lab, at $2.00: 200 cents at list. The invoice says $2.14.

    Without the invoice the statement is on list prices: 200 cents. With it: the basis is
    allocation, the lines add up to 214 cents (search and assistant each scaled by 1.07), the
    usage-basis lines still add up to 200, and pool lab's row says 214 against 200.
    """
    from billing.chargeback import Chargeback
    from tests.billing.conftest import OCT
    from tests.billing.test_months import AFTER_OCT, _fill

    _fill(ledger, OCT)
    cb = Chargeback(ledger, lab_config)
    before = cb.statement("2026-10")
    assert (before.basis, before.fleet_cents, before.usage_lines) == ("list", 200, None)
    assert before.pools.row(0, named=True)["explanation"] == "no invoice imported: on list prices"
    _import(
        ledger,
        lab_config,
        _invoice("2026-10-01T00:00:00Z", "2026-11-01T00:00:00Z", "2.14"),
        AFTER_OCT,
    )
    after = cb.statement("2026-10")
    assert (after.basis, after.fleet_cents, after.total_cents) == ("allocation", 214, 214)
    assert after.usage_lines is not None
    assert int(after.usage_lines["total_cents"].sum()) == 200
    pool = after.pools.row(0, named=True)
    assert (pool["pool"], pool["list_cents"], pool["invoice_cents"], pool["difference_cents"]) == (
        "lab",
        200,
        214,
        14,
    )
    # Each team's prompt-cache row comes with the statement (no hits in these records).
    assert sorted(after.cache.select("team", "cached_prompt_tokens").rows()) == [
        ("assistant", 0),
        ("search", 0),
    ]
    closed = cb.close("2026-10", now=AFTER_OCT)
    assert (closed.basis, closed.total_cents) == ("allocation", 214)
    assert closed.pools.row(0, named=True)["invoice_cents"] == 214


def test_a_closed_month_and_its_corrections_keep_their_list_cost_in_focus(
    ledger: Any, lab_config: Any
) -> None:
    """October on its invoice ($2.14 for $2.00 at list): its FOCUS file says BilledCost 2.14
    against ListCost 2.00, open and once closed (the usage basis is frozen with the month). A
    record for October that arrives after it closed moves the teams' shares on both bases:
    November's correction rows carry the billed difference and their list difference, the
    usage basis's adjustment, not zero."""
    from billing.chargeback import Chargeback
    from exporters.focus import focus_frame
    from tests.billing.conftest import NOV, OCT, batch, usage
    from tests.billing.test_months import AFTER_OCT, DEC, _fill

    def costs(frame: pl.DataFrame) -> tuple[float, float]:
        return float(frame["BilledCost"].sum()), float(frame["ListCost"].sum())

    _fill(ledger, OCT)
    cb = Chargeback(ledger, lab_config)
    _import(
        ledger,
        lab_config,
        _invoice("2026-10-01T00:00:00Z", "2026-11-01T00:00:00Z", "2.14"),
        AFTER_OCT,
    )
    opened = focus_frame(cb.statement("2026-10"), lab_config, "1.2")
    assert costs(opened) == (2.14, 2.00)
    closed = focus_frame(cb.close("2026-10", now=AFTER_OCT), lab_config, "1.2")
    assert costs(closed) == (2.14, 2.00)
    assert closed.sort("x_Team").select("x_Team", "BilledCost", "ListCost").rows() == (
        opened.sort("x_Team").select("x_Team", "BilledCost", "ListCost").rows()
    )

    ledger.ingest(batch("usage", [usage("research", OCT + 4000, 900)]), now=DEC)
    _fill(ledger, NOV)
    nov = cb.statement("2026-11")
    assert nov.usage_lines is not None
    listed = nov.usage_lines.filter(pl.col("for_month") == "2026-10")
    assert listed.height
    rows = focus_frame(nov, lab_config, "1.2").filter(pl.col("ChargeClass") == "Correction")
    by_team = dict(rows.group_by("x_Team").agg(pl.col("ListCost").sum()).iter_rows())
    expected = dict(listed.group_by("team").agg(pl.col("total_cents").sum()).iter_rows())
    assert {t: round(float(v) * 100) for t, v in by_team.items()} == {
        t: expected.get(t, 0) for t in by_team
    }
    assert any(by_team.values())


def test_an_invoice_reissued_after_close_becomes_an_adjustment(
    ledger: Any, lab_config: Any
) -> None:
    """October closed on list prices (200 cents); its invoice arrives later at $2.30: November
    carries October's 30 cents as adjustment lines, and October's own statement does not move."""
    from billing.chargeback import Chargeback
    from tests.billing.conftest import NOV, OCT
    from tests.billing.test_months import AFTER_OCT, _fill

    _fill(ledger, OCT)
    cb = Chargeback(ledger, lab_config)
    assert cb.close("2026-10", now=AFTER_OCT).total_cents == 200
    _import(
        ledger,
        lab_config,
        _invoice("2026-10-01T00:00:00Z", "2026-11-01T00:00:00Z", "2.30"),
        AFTER_OCT,
    )
    assert cb.statement("2026-10").total_cents == 200
    _fill(ledger, NOV)
    nov = cb.statement("2026-11")
    adjustments = nov.lines.filter(pl.col("for_month") == "2026-10")
    assert int(adjustments["total_cents"].sum()) == 30
    assert nov.reconciles


def test_an_imported_invoice_is_not_hidden_by_a_kept_statement(
    ledger: Any, lab_config: Any
) -> None:
    """Billing keeps statements for a TTL; an import drops them, so the next one is on the invoice."""
    from billing.statement_cache import CachedChargeback
    from tests.billing.conftest import OCT
    from tests.billing.test_months import AFTER_OCT, _fill

    _fill(ledger, OCT)
    kept = CachedChargeback(ledger, lab_config, ttl_seconds=3600)
    assert kept.statement("2026-10").basis == "list"
    _import(
        ledger,
        lab_config,
        _invoice("2026-10-01T00:00:00Z", "2026-11-01T00:00:00Z", "2.14"),
        AFTER_OCT,
    )
    assert kept.statement("2026-10").basis == "list"  # still the kept one
    kept.forget()
    assert (kept.statement("2026-10").basis, kept.statement("2026-10").total_cents) == (
        "allocation",
        214,
    )


def test_the_gpu_minute_cost_formula_is_written_once() -> None:
    """No billing module but billing/pricebook.py prices GPU-seconds or joules in SQL itself."""
    root = Path(__file__).parents[2] / "billing"
    formula = re.compile(r"/ 3600(\.0)? \*|/ 3\.6e6 \*")
    writers = {
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if formula.search(path.read_text())
    }
    assert writers == {"pricebook.py"}
