"""Allocation: the worked example of docs/billing.md, the idle policies, and exactness."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings, strategies as st

from billing.allocation import UNALLOCATED, Policy
from billing.frames import allocate
from billing.rounding import MICROCENTS_PER_USD, cents
from billing.statement import cents_lines

CASH = ("compute_microcents", "energy_microcents", "idle_microcents")

# The worked example: one GPU at $6.00 per GPU-hour drawing 600 W, energy at $0.20/kWh, PUE 1.5.
# Each minute costs $0.10 of GPU time and 0.01 kWh x 0.20 x 1.5 = $0.003 of energy.
PRICES = {"H100": 6.0}
EXAMPLE_GPUS = pl.DataFrame(
    {
        "replica": ["r1"] * 3,
        "gpu_model": ["H100"] * 3,
        "slot": [0, 1, 2],
        "gpu_seconds": [60.0] * 3,
        "energy_joules": [36_000.0] * 3,
    }
)
# Minute 0: search and assistant each have a request in flight all minute.
# Minute 1: search has one request in flight for 30 s. Minute 2: nothing in flight.
EXAMPLE_USAGE = pl.DataFrame(
    {
        "replica": ["r1", "r1", "r1"],
        "team": ["search", "assistant", "search"],
        "model": ["m", "m", "m"],
        "slot": [0, 0, 1],
        "inflight_seconds": [60.0, 60.0, 30.0],
        "requests": [0, 1, 2],
        "prompt_tokens": [0, 100, 300],
        "completion_tokens": [0, 10, 30],
    }
)


def policy(**kw: Any) -> Policy:
    base: dict[str, Any] = {
        "usd_per_gpu_hour": PRICES,
        "usd_per_kwh": 0.20,
        "pue": 1.5,
        "replica_model": {"r1": "m"},
    }
    return Policy.listed(**(base | kw))


def line(frame: pl.DataFrame, team: str) -> dict[str, Any]:
    rows = frame.filter(pl.col("team") == team).to_dicts()
    assert len(rows) == 1, rows
    return rows[0]


def usd(microcents: int) -> float:
    """Micro-cents as USD (10^8 to the dollar), to compare with amounts worked out by hand."""
    return microcents / MICROCENTS_PER_USD


def money(frame: pl.DataFrame) -> pl.Series:
    """Each line's compute, energy and idle micro-cents together."""
    return frame.select(pl.sum_horizontal(*CASH)).to_series()


def test_worked_example_in_flight_share_with_idle_spread():
    """search pays 1.5 minutes' busy share... as docs/billing.md works out by hand."""
    lines, fleet = allocate(EXAMPLE_USAGE, EXAMPLE_GPUS, policy())
    search, assistant = line(lines, "search"), line(lines, "assistant")
    # Busy: minute 0 split in half, minute 1 half busy (search), so search 1.0 and assistant
    # 0.5 minute; the idle 1.5 minutes are spread 2:1 by what each paid. Exact, in micro-cents
    # (10^-8 USD): $0.10 is 10,000,000.
    assert (search["compute_microcents"], search["energy_microcents"]) == (10_000_000, 300_000)
    assert search["idle_microcents"] == 10_300_000
    assert (assistant["compute_microcents"], assistant["energy_microcents"]) == (5_000_000, 150_000)
    assert assistant["idle_microcents"] == 5_150_000
    assert search["gpu_hours"] == pytest.approx(1 / 60)
    assert search["energy_kwh"] == pytest.approx(0.01)
    assert (search["requests"], search["prompt_tokens"], assistant["completion_tokens"]) == (
        2,
        300,
        10,
    )
    assert fleet == 30_900_000  # $0.309
    # $0.309 is 31 cents (half up); the one cent the floors miss goes to the largest remainder:
    # search's energy, 0.30 of a cent, tied with search's idle and won by the earlier cell.
    rounded = cents_lines("2026-10", lines)
    assert line(rounded, "search")["energy_cents"] == 1
    assert dict(zip(rounded["team"], rounded["total_cents"], strict=True)) == {
        "search": 21,
        "assistant": 10,
    }


def test_idle_capacity_charged_to_the_platform():
    """idle_policy platform: the 1.5 idle minutes become a platform line for the model."""
    lines, _ = allocate(EXAMPLE_USAGE, EXAMPLE_GPUS, policy(idle={"r1": ("platform", None)}))
    assert line(lines, "platform")["idle_microcents"] == 15_450_000
    assert line(lines, "search")["idle_microcents"] == 0


def test_idle_capacity_charged_to_the_owner_of_a_dedicated_replica():
    """idle_policy owner: the owning team pays the idle minutes, even if it ran nothing."""
    lines, _ = allocate(EXAMPLE_USAGE, EXAMPLE_GPUS, policy(idle={"r1": ("owner", "research")}))
    assert line(lines, "research")["idle_microcents"] == 15_450_000
    assert line(lines, "research")["compute_microcents"] == 0


def test_ten_requests_sharing_a_batch_each_pay_a_tenth():
    """Ten teams' requests in flight together for the whole minute pay 1/10 of it each."""
    usage = pl.DataFrame(
        {
            "replica": ["r1"] * 10,
            "team": [f"t{i}" for i in range(10)],
            "model": ["m"] * 10,
            "slot": [0] * 10,
            "inflight_seconds": [60.0] * 10,
            "requests": [1] * 10,
            "prompt_tokens": [1] * 10,
            "completion_tokens": [1] * 10,
        }
    )
    lines, _ = allocate(usage, EXAMPLE_GPUS.head(1), policy())
    assert lines["compute_microcents"].to_list() == [1_000_000] * 10
    assert lines["idle_microcents"].sum() == 0


def test_a_request_alone_pays_exactly_the_time_it_held_the_gpu():
    """One request in flight for 15 s of a minute pays 15/60 of it; the rest is idle."""
    usage = EXAMPLE_USAGE.head(1).with_columns(inflight_seconds=pl.lit(15.0))
    lines, _ = allocate(usage, EXAMPLE_GPUS.head(1), policy(idle={"r1": ("platform", None)}))
    assert line(lines, "search")["compute_microcents"] == 2_500_000
    assert line(lines, "platform")["idle_microcents"] == 7_725_000  # 0.103 x 0.75


@pytest.mark.parametrize(("mode", "search_share"), [("tokens", 330 / 440), ("requests", 2 / 3)])
def test_token_and_request_splits_share_the_busy_cost(mode, search_share):
    """tokens: by prompt + 3 x completion tokens; requests: by count."""
    p = policy(
        allocation=mode, prompt_weight=1.0, completion_weight=1.0, idle={"r1": ("platform", None)}
    )
    lines, _ = allocate(EXAMPLE_USAGE, EXAMPLE_GPUS, p)
    busy = 1.5 * 0.103  # minute 0 and half of minute 1
    search = line(lines, "search")
    paid = usd(search["compute_microcents"] + search["energy_microcents"])
    assert paid == pytest.approx(busy * search_share, abs=2e-8)


def test_gpus_no_replica_runs_on_are_the_platforms():
    """A GPU seen with no replica is charged to the platform as (unallocated)."""
    spare = EXAMPLE_GPUS.head(1).with_columns(replica=pl.lit(""))
    lines, _ = allocate(EXAMPLE_USAGE.head(0), spare, policy())
    assert lines.to_dicts()[0]["team"] == "platform"
    assert lines.to_dicts()[0]["model"] == UNALLOCATED
    assert lines["idle_microcents"].sum() == 10_300_000


def test_an_unpriced_gpu_model_is_an_error_naming_it():
    """GPU time of a model with no price is never silently free: an error line names it."""
    gpus = EXAMPLE_GPUS.with_columns(gpu_model=pl.lit("B200"))
    lines, fleet = allocate(EXAMPLE_USAGE, gpus, policy())
    error = line(lines, "platform")
    assert error["model"] == "(error) no price for GPU model B200 in prices.usd_per_gpu_hour"
    assert error["gpu_hours"] == pytest.approx(3 / 60)
    assert (*(error[c] for c in CASH), fleet) == (0, 0, 0, 0)


REPLICAS = ["r1", "r2", "r3"]
TEAMS = ["a", "b", "c", "d"]


@st.composite
def fleets(draw):
    """Random GPU and usage slots over a few replicas, teams and minutes."""
    n_gpu = draw(st.integers(1, 30))
    gpus = pl.DataFrame(
        {
            "replica": draw(
                st.lists(st.sampled_from([*REPLICAS, ""]), min_size=n_gpu, max_size=n_gpu)
            ),
            "gpu_model": draw(
                st.lists(st.sampled_from(["H100", "L40S"]), min_size=n_gpu, max_size=n_gpu)
            ),
            "slot": draw(st.lists(st.integers(0, 20), min_size=n_gpu, max_size=n_gpu)),
            "gpu_seconds": draw(st.lists(st.floats(0, 120), min_size=n_gpu, max_size=n_gpu)),
            "energy_joules": draw(st.lists(st.floats(0, 100_000), min_size=n_gpu, max_size=n_gpu)),
        }
    )
    n_use = draw(st.integers(0, 40))
    usage = pl.DataFrame(
        {
            "replica": draw(st.lists(st.sampled_from(REPLICAS), min_size=n_use, max_size=n_use)),
            "team": draw(st.lists(st.sampled_from(TEAMS), min_size=n_use, max_size=n_use)),
            "model": draw(st.lists(st.sampled_from(["m1", "m2"]), min_size=n_use, max_size=n_use)),
            "slot": draw(st.lists(st.integers(0, 20), min_size=n_use, max_size=n_use)),
            "inflight_seconds": draw(st.lists(st.floats(0, 600), min_size=n_use, max_size=n_use)),
            "requests": draw(st.lists(st.integers(0, 50), min_size=n_use, max_size=n_use)),
            "prompt_tokens": draw(st.lists(st.integers(0, 10**6), min_size=n_use, max_size=n_use)),
            "completion_tokens": draw(
                st.lists(st.integers(0, 10**6), min_size=n_use, max_size=n_use)
            ),
        },
        schema_overrides={
            "replica": pl.String,
            "team": pl.String,
            "model": pl.String,
            "slot": pl.Int64,
            "inflight_seconds": pl.Float64,
            "requests": pl.Int64,
            "prompt_tokens": pl.Int64,
            "completion_tokens": pl.Int64,
        },
    )
    mode = draw(st.sampled_from(["in_flight", "tokens", "requests"]))
    idle = {
        r: draw(st.sampled_from([("spread", None), ("platform", None), ("owner", "d")]))
        for r in REPLICAS
    }
    p = Policy.listed(
        usd_per_gpu_hour={"H100": draw(st.floats(0, 50)), "L40S": 1.6},
        usd_per_kwh=draw(st.floats(0, 1)),
        pue=draw(st.floats(1, 3)),
        allocation=mode,
        completion_weight=3.0,
        idle=idle,
        replica_model={"r1": "m1", "r2": "m2", "r3": "m1"},
    )
    return usage, gpus, p


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_every_split_adds_up_to_the_fleet_cost_to_the_cent(fleet):
    """For random usage, the lines' cents sum to the fleet cost in cents, and none is negative."""
    usage, gpus, p = fleet
    lines, fleet_microcents = allocate(usage, gpus, p)
    # Exact in micro-cents: no tolerance.
    assert int(money(lines).sum()) == fleet_microcents
    assert all(c >= 0 for row in lines.select(*CASH).iter_rows() for c in row)
    rounded = cents_lines("2026-10", lines)
    assert int(rounded["total_cents"].sum() if rounded.height else 0) == cents(fleet_microcents)
    if rounded.height:
        assert all(
            c >= 0
            for row in rounded.select("compute_cents", "energy_cents", "idle_cents").iter_rows()
            for c in row
        )
        # Each line is within one cent per cell of its exact amount.
        assert ((rounded["total_cents"] * 10**6 - money(lines)).abs() <= 3 * 10**6).all()


@settings(max_examples=50, deadline=None)
@given(fleets())
def test_the_same_usage_gives_the_same_statement(fleet):
    """Allocation is deterministic: row order of the input does not change any line."""
    usage, gpus, p = fleet
    a = cents_lines("2026-10", allocate(usage, gpus, p)[0])
    b = cents_lines("2026-10", allocate(usage.reverse(), gpus.reverse(), p)[0])
    assert a.equals(b)
