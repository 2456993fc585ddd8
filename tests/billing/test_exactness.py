"""Exact money: a statement adds up to the fleet's cost in every state of an open month.

The lines are integer micro-cents split from each instance's cost (``billing.charges``), read in
one snapshot of the ledger (``Ledger.snapshot``). These tests feed a dynamic fleet's records in
any order (engine samples before usage, usage before GPU samples, hang-ups, n = 2 requests),
stop at any point, and read the statement while batches are still committing.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Iterator
from typing import Any

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from billing import allocation_runs
from billing.allocation import Policy
from billing.chargeback import Chargeback
from billing.charges import ERROR_PREFIX, charge, out_of_range_model
from billing.ledger import Ledger
from billing.statement import cents_lines
from infermeter.config import Config
from tests.billing.conftest import OCT, batch, gpu_samples, instance_event, usage
from tests.billing.test_allocation import CASH, money
from tests.billing.test_reconciliation import engine_samples

T0 = OCT + 3600
NOW = OCT + 40 * 86_400
MONTH = "2026-10"
_ids = itertools.count()


def event(instance: str, kind: str, t: float, started_at: float, gpu: str) -> dict[str, Any]:
    """An instance event of small-0 (node-b, one L40S), as its sidecar writes it."""
    event_id = f"{round(t * 1000):013d}/{instance}/{kind}/{next(_ids)}"
    return instance_event(instance, kind, t, started_at, event_id=event_id, gpus=gpu)


def fleet_pieces(seed: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """Six minutes of two small-0 instances, in small batches as shippers would send them.

    The first instance stops after four minutes (its board then reported under its name for
    another minute, past its lifetime); the second starts a minute in. Requests of several
    teams, some with two choices, some hung up; the engines read every 15 s, the boards every
    10 s; a spare board no instance holds.
    """
    rnd = random.Random(seed)
    pieces: list[tuple[str, list[dict[str, Any]]]] = []

    def batches(kind: str, records: list[dict[str, Any]], size: int) -> None:
        pieces.extend((kind, records[i : i + size]) for i in range(0, len(records), size))

    for name, gpu, start, stop in (
        ("small-0-a", "0", T0, T0 + 240),
        ("small-0-b", "1", T0 + 60, None),
    ):
        end = stop or T0 + 360
        events = [event(name, "start", start + 1, start, gpu)]
        events += [
            event(name, "heartbeat", t, start, gpu) for t in range(int(start) + 30, int(end), 30)
        ]
        if stop:
            events.append(event(name, "stop", stop, start, gpu))
        batches("instances", events, 3)
        boards = gpu_samples("small-0", start, end + 60 - start, 10.0, gpu=gpu)
        batches("gpu_samples", [{**s, "instance": name} for s in boards], 6)
        requests, t = [], start + 5
        while t < end - 30:
            kw: dict[str, Any] = {"instance": name}
            if rnd.random() < 0.2:
                kw["choices"] = 2
            if rnd.random() < 0.2:
                kw.update(status="client_aborted", finish_reason=None)
            team = rnd.choice(["search", "assistant", "analytics"])
            requests.append(usage(team, t, rnd.uniform(1, 50), **kw))
            t += rnd.uniform(5, 30)
        batches("usage", requests, 2)
        batches("engine_samples", engine_samples(requests, start, end, 15.0, instance=name), 4)
    spare = gpu_samples("", T0, 180, 10.0, gpu_model="H100", node="node-a", gpu="1")
    batches("gpu_samples", spare, 6)
    return pieces


def keep(ledger: Ledger, kind: str, records: list[dict[str, Any]]) -> None:
    result = ledger.ingest(batch(kind, records), now=NOW)
    assert result.rejected == [], result.rejected


def assert_adds_up(ledger: Ledger, chargeback: Chargeback) -> None:
    """The unrounded lines are the fleet's cost to the micro-cent, and the statement to the cent."""
    lines, fleet = allocation_runs.allocate(ledger, chargeback.policy, MONTH)
    assert int(money(lines).sum()) == fleet
    assert all(c >= 0 for row in lines.select(*CASH).iter_rows() for c in row)
    statement = chargeback.statement(MONTH)
    assert statement.reconciles, (statement.total_cents, statement.fleet_cents)


@pytest.fixture
def open_ledger(config: Config) -> Iterator[tuple[Ledger, Chargeback]]:
    ledger = Ledger.open(":memory:", [t.name for t in config.teams], {})
    yield ledger, Chargeback(ledger, config)
    ledger.close()


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 3),
    order=st.randoms(use_true_random=False),
    cuts=st.lists(st.floats(0, 1), min_size=1, max_size=3),
)
def test_any_prefix_of_an_ingest_sequence_reconciles_to_the_cent(
    config: Config, seed: int, order: random.Random, cuts: list[float]
) -> None:
    """Records in any order, stopped anywhere: the statement adds up to the fleet's cost."""
    pieces = fleet_pieces(seed)
    order.shuffle(pieces)
    stops = sorted({round(c * len(pieces)) for c in cuts} | {len(pieces)})
    ledger = Ledger.open(":memory:", [t.name for t in config.teams], {})
    try:
        chargeback, done = Chargeback(ledger, config), 0
        for stop in stops:
            for kind, records in pieces[done:stop]:
                keep(ledger, kind, records)
            done = stop
            assert_adds_up(ledger, chargeback)
    finally:
        ledger.close()


def test_a_statement_read_while_batches_commit_adds_up(
    open_ledger: tuple[Ledger, Chargeback],
) -> None:
    """Statements computed while GPU samples and usage keep committing all reconcile.

    Read query by query, a statement once applied the in-flight seconds of one state to the GPU
    costs of another, and its lines came to more than the fleet cost ("cannot round 27 amounts").
    """
    ledger, chargeback = open_ledger
    stop = threading.Event()
    written = [0]

    def write() -> None:
        rnd, t = random.Random(7), T0
        while not stop.is_set():
            keep(ledger, "gpu_samples", gpu_samples("small-0", t, 10.0, 10.0))
            keep(
                ledger,
                "usage",
                [
                    usage(
                        rnd.choice(["search", "assistant"]),
                        t - rnd.uniform(0, 50),
                        rnd.uniform(1, 50),
                    )
                ],
            )
            t += 10
            written[0] += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(25):
            assert_adds_up(ledger, chargeback)
    finally:
        stop.set()
        writer.join()
    assert written[0] > 25  # the statements were read while the ledger moved


POLICY = Policy.listed(
    usd_per_gpu_hour={"L40S": 1.6}, idle={"g": ("spread", None)}, replica_model={"g": "chat-small"}
)


def instances(*rows: tuple[str, float, float]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "replica": "g",
                "instance": i,
                "compute_usd": c,
                "energy_usd": e,
                "gpu_hours": 1.0,
                "energy_kwh": 0.5,
                "peak_slot": 29_846_940,
            }
            for i, c, e in rows
        ]
    )


def shares(*rows: tuple[str, str, float, float]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "replica": "g",
                "instance": i,
                "team": t,
                "model": "chat-small",
                "gpu_hours": 0.1,
                "energy_kwh": 0.0,
                "compute_usd": c,
                "energy_usd": e,
            }
            for i, t, c, e in rows
        ]
    )


def test_shares_beyond_the_instance_cost_are_scaled_into_it() -> None:
    """Shares that add up to more than the instance cost (read from two states) create no money."""
    charged = charge(
        instances(("g-a", 1.0, 0.0)),
        shares(("g-a", "search", 0.9, 0.0), ("g-a", "assistant", 0.6, 0.0)),
        POLICY,
    )
    by_team = dict(charged.rows.select("team", "compute_microcents").iter_rows())
    assert by_team == {"search": 60_000_000, "assistant": 40_000_000}  # $1.00 split 0.9 : 0.6
    assert charged.fleet_microcents == 100_000_000
    assert int(charged.rows["idle_microcents"].sum()) == 0


def test_claims_never_take_more_than_the_idle_left() -> None:
    """Unattributed claims beyond what the teams left are capped at it; idle is never negative."""
    claims = shares(("g-a", "platform", 0.5, 0.0)).with_columns(
        model=pl.lit("chat-small (unattributed)"),
        prompt_tokens=pl.lit(10),
        completion_tokens=pl.lit(5),
    )
    charged = charge(
        instances(("g-a", 1.0, 0.0)), shares(("g-a", "search", 0.7, 0.0)), POLICY, claims
    )
    rows = {r["team"]: r for r in charged.rows.iter_rows(named=True)}
    assert rows["platform"]["compute_microcents"] == 30_000_000  # $0.30 left, not the $0.50 asked
    assert (rows["platform"]["prompt_tokens"], rows["platform"]["completion_tokens"]) == (10, 5)
    assert rows["search"]["idle_microcents"] == 0
    assert int(money(charged.rows).sum()) == charged.fleet_microcents == 100_000_000


@pytest.mark.parametrize("absurd", [5.2e14, float("inf"), float("nan")])
def test_an_instance_whose_cost_is_out_of_range_is_an_error_line_naming_it(absurd: float) -> None:
    """One instance's absurd cost leaves the fleet; its line says which instance and when."""
    charged = charge(
        instances(("g-a", 1.0, 0.0), ("g-b", 0.5, absurd)),
        shares(("g-a", "search", 0.5, 0.0), ("g-b", "search", 0.1, absurd)),
        POLICY,
    )
    assert charged.fleet_microcents == 100_000_000  # g-a alone
    assert int(money(charged.rows).sum()) == 100_000_000
    (error,) = charged.errors
    assert error["model"] == out_of_range_model("g", "g-b", 0.5 + absurd, 29_846_940)
    assert error["model"].startswith(f"{ERROR_PREFIX}cost out of range: instance g-b (group g)")
    assert "2026-10-01T01:00Z" in error["model"]
    assert all(error[c] == 0 for c in CASH)


def test_a_line_that_cannot_be_rounded_is_an_error_line_and_the_rest_still_rounds() -> None:
    """A negative amount names its line as an error; the other lines keep their exact cents."""
    lines = pl.DataFrame(
        [
            {
                "team": t,
                "model": "chat-small",
                "requests": 1,
                "prompt_tokens": 1,
                "completion_tokens": 1,
                "gpu_hours": 0.1,
                "energy_kwh": 0.0,
                "compute_microcents": c,
                "energy_microcents": 0,
                "idle_microcents": 0,
            }
            for t, c in (("analytics", -5), ("search", 1_500_000), ("assistant", 2_500_000))
        ]
    )
    rounded = cents_lines(MONTH, lines)
    totals = dict(rounded.select("team", "total_cents").iter_rows())
    assert totals == {"analytics": 0, "search": 2, "assistant": 2}  # 4 cents: 1.5 + 2.5
    bad = rounded.filter(pl.col("team") == "analytics")["model"].item()
    assert bad == f"{ERROR_PREFIX}cannot round the line of chat-small: a negative amount"
