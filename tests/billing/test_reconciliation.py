"""Reconciliation: the ledger against the engines' counters, and the statement's unattributed line."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import duckdb
import polars as pl
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry

from billing import allocation_runs, reconciled
from billing.allocation import allocation_sql, run
from billing.api import create_app
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.metrics import ReconciliationCollector
from billing.reconciliation import (
    claim_rows,
    is_unattributed,
    unattributed_model,
    unattributed_sql,
)
from billing.rounding import cents, to_cents
from billing.statement import cents_lines
from exporters.chargeback_csv import chargeback_frame
from exporters.focus import focus_frame
from infermeter.config import Config
from tests.billing.conftest import OCT, batch, gpu_samples, usage
from tests.billing.test_allocation import CASH, REPLICAS, fleets, money, usd

HOUR = 3600.0
_ids = itertools.count()


def engine_samples(
    requests: list[dict[str, Any]],
    start: float,
    end: float,
    every: float = 60.0,
    replica: str = "small-0",
    instance: str | None = None,
    restart_at: float | None = None,
    extra: Sequence[tuple[float, int, int]] = (),
    running: Callable[[float], float] | None = None,
) -> list[dict[str, Any]]:
    """vLLM's counters read every ``every`` seconds: the tokens of ``requests`` processed so far.

    Prompt tokens count at the first token, once per choice, completion tokens evenly up to the
    end, as vLLM counts them; with ``restart_at`` (when nothing is in flight) they start again
    from zero. ``extra``: (time, prompt, completion) the engine counted at that time beyond the
    requests (a hang-up's tail, a request without a record). ``running(t)``: the requests the
    engine runs at each reading (default none).
    """

    def counted(t: float) -> tuple[float, float]:
        prompt = completion = 0.0
        for r in requests:
            tp, tf = r["first_token_at"], r["finished_at"]
            prompt += r["prompt_tokens"] * r.get("choices", 1) if t >= tp else 0
            done = min(max((t - tp) / (tf - tp), 0.0), 1.0) if tf > tp else float(t >= tf)
            completion += r["completion_tokens"] * done
        for at, p, c in extra:
            prompt, completion = prompt + (p if t >= at else 0), completion + (c if t >= at else 0)
        return prompt, completion

    out = []
    t = start + every
    while t <= end + 1e-9:
        prompt, completion = counted(t)
        if restart_at is not None and t >= restart_at:
            prompt, completion = (
                prompt - counted(restart_at)[0],
                completion - counted(restart_at)[1],
            )
        out.append(
            {
                "sample_id": f"eng-{next(_ids)}",
                "replica": replica,
                "model": "chat-small",
                "timestamp": t,
                "requests_running": running(t) if running else 0.0,
                "requests_waiting": 0.0,
                "kv_cache_usage": 0.0,
                "prompt_tokens_total": float(prompt),
                "generation_tokens_total": float(completion),
                "instance": instance,
            }
        )
        t += every
    return out


def requests(count: int, hour: int, **kw: Any) -> list[dict[str, Any]]:
    """``count`` 10-second requests of search in ``hour`` after OCT, 2 minutes apart (100 + 50 tokens)."""
    return [usage("search", OCT + hour * HOUR + 120 * i + 5, 10.0, **kw) for i in range(count)]


def fill(
    ledger: Ledger, kept: list[dict[str, Any]], engine: list[dict[str, Any]], hours: int = 3
) -> None:
    """``kept`` usage records, the engine's samples and small-0's GPU for ``hours`` hours."""
    now = OCT + 40 * 86400
    for kind, records in (
        ("usage", kept),
        ("engine_samples", engine),
        ("gpu_samples", gpu_samples(seconds=hours * HOUR)),
    ):
        if records:
            result = ledger.ingest(batch(kind, records), now=now)
            assert result.rejected == [], result.rejected
            assert result.accepted == len(records)


def row(frame: pl.DataFrame, hour: int) -> dict[str, Any]:
    rows = frame.filter(pl.col("t") == OCT + hour * HOUR).to_dicts()
    assert len(rows) == 1, rows
    return rows[0]


@pytest.fixture
def lossy(ledger: Ledger) -> Ledger:
    """20 requests in hour 1 and 10 in hour 2; the records of 4 of hour 1 never reach the ledger."""
    hour1, hour2 = requests(20, 1), requests(10, 2)
    withheld = {1, 5, 6, 17}
    kept = [r for i, r in enumerate(hour1) if i not in withheld] + hour2
    fill(ledger, kept, engine_samples(hour1 + hour2, OCT, OCT + 3 * HOUR))
    return ledger


def test_withheld_records_show_exactly_as_the_difference(lossy: Ledger) -> None:
    """Four records withheld while the counters moved: hour 1 differs by exactly their tokens."""
    frame = reconciled.reconciled(lossy, OCT, OCT + 3 * HOUR)
    one = row(frame, 1)
    assert (one["instance"], one["replica"], one["model"]) == ("small-0", "small-0", "chat-small")
    assert (one["engine_prompt_tokens"], one["engine_completion_tokens"]) == (2000, 1000)
    assert (one["ledger_prompt_tokens"], one["ledger_completion_tokens"]) == (1600, 800)
    assert (one["engine_tokens"], one["ledger_tokens"], one["difference_tokens"]) == (
        3000,
        2400,
        600,
    )
    assert one["share"] == pytest.approx(0.2)
    assert (one["unattributed_prompt_tokens"], one["unattributed_completion_tokens"]) == (400, 200)
    assert one["unattributed_share"] == pytest.approx(0.2)
    for hour in (0, 2):
        assert row(frame, hour)["difference_tokens"] == 0
    assert row(frame, 2)["engine_tokens"] == 1500


def test_the_unattributed_line_costs_the_induced_difference(lossy: Ledger, config: Config) -> None:
    """The platform's unattributed line carries the 600 tokens at hour 1's cost per weighted token."""
    chargeback = Chargeback(lossy, config)
    lines, fleet = allocation_runs.allocate(lossy, chargeback.policy, "2026-10")
    line = lines.filter(pl.col("model") == unattributed_model("chat-small")).to_dicts()
    assert len(line) == 1
    got = line[0]
    assert (got["team"], got["requests"], got["prompt_tokens"], got["completion_tokens"]) == (
        "platform",
        0,
        400,
        200,
    )
    # Weighted 1:3, the engine processed 2000 + 3 x 1000 and the lost requests 400 + 3 x 200:
    # a fifth of hour 1's GPU hour (L40S at $1.60) and of its 0.2 kWh (x $0.14 x PUE 1.35).
    assert usd(got["compute_microcents"]) == pytest.approx(0.2 * 1.60)
    assert usd(got["energy_microcents"]) == pytest.approx(0.2 * 0.2 * 0.14 * 1.35)
    assert got["gpu_hours"] == pytest.approx(0.2)
    assert got["idle_microcents"] == 0
    assert usd(fleet) == pytest.approx(3 * (1.60 + 0.2 * 0.14 * 1.35))
    statement = chargeback.statement("2026-10")
    assert statement.reconciles
    assert statement.total_cents == cents(fleet)
    unattributed = statement.lines.filter(pl.col("model") == unattributed_model("chat-small"))
    assert unattributed["total_cents"].to_list() == [to_cents(0.2 * (1.60 + 0.2 * 0.14 * 1.35))]


def test_the_line_reads_as_its_own_in_csv_and_focus(lossy: Ledger, config: Config) -> None:
    """The CSV and FOCUS rows of the unattributed line name it in the model and its description."""
    statement = Chargeback(lossy, config).statement("2026-10")
    csv = chargeback_frame(statement, {}).filter(pl.col("model") == "chat-small (unattributed)")
    assert csv.select(
        "team", "line_type", "requests", "prompt_tokens", "completion_tokens"
    ).rows() == [("platform", "usage", 0, 400, 200)]
    focus = focus_frame(statement, config).filter(pl.col("x_Model") == "chat-small (unattributed)")
    assert focus["ChargeDescription"].to_list() == [
        "GPU inference on chat-small (unattributed) for team platform (2026-10)"
    ]
    assert focus["SkuId"].to_list() == ["gpu-inference/chat-small (unattributed)"]


def test_teams_pay_their_measured_share_and_idle_pays_for_the_loss(
    ledger: Ledger, config: Config
) -> None:
    """The team's busy cost is what it is without the engine counters; only its idle share shrinks."""
    hour1 = requests(20, 1)
    kept = hour1[4:]
    fill(ledger, kept, [])
    policy = Chargeback(ledger, config).policy
    before, fleet_before = allocation_runs.allocate(ledger, policy, "2026-10")
    ledger.ingest(
        batch("engine_samples", engine_samples(hour1, OCT, OCT + 3 * HOUR)), now=OCT + 40 * 86400
    )
    after, fleet_after = allocation_runs.allocate(ledger, policy, "2026-10")
    search_before = before.filter(pl.col("team") == "search").to_dicts()[0]
    search_after = after.filter(pl.col("team") == "search").to_dicts()[0]
    assert fleet_after == fleet_before
    assert search_after["compute_microcents"] == search_before["compute_microcents"]
    claimed = after.filter(pl.col("model").map_elements(is_unattributed, return_dtype=pl.Boolean))
    cost = int((claimed["compute_microcents"] + claimed["energy_microcents"]).sum())
    # Exactly: the claim leaves the one payer's idle share, micro-cent for micro-cent.
    assert search_after["idle_microcents"] == search_before["idle_microcents"] - cost


def test_an_owned_group_charges_its_owner(ledger: Ledger, config: Config) -> None:
    """With idle_policy owner, the unattributed line is the owning team's."""
    data = config.model_dump(mode="json")
    for r in data["replicas"]:
        if r["id"] == "small-0":
            r.update(idle_policy="owner", owner_team="analytics")
    owned = Config.model_validate(data)
    hour1 = requests(5, 1)
    fill(ledger, hour1[1:], engine_samples(hour1, OCT, OCT + 3 * HOUR))
    lines = Chargeback(ledger, owned).statement("2026-10").lines
    line = lines.filter(pl.col("model") == unattributed_model("chat-small"))
    assert line.select("team", "prompt_tokens", "completion_tokens").rows() == [
        ("analytics", 100, 50)
    ]


def test_more_in_the_ledger_than_the_engine_is_reported_not_billed(
    ledger: Ledger, config: Config
) -> None:
    """A negative difference shows in the reconciliation and puts no line on the statement."""
    hour1 = requests(6, 1)
    fill(ledger, hour1, engine_samples(hour1[:4], OCT, OCT + 3 * HOUR))
    one = row(reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR), 1)
    assert (one["difference_tokens"], one["unattributed_tokens"]) == (-300, 0)
    assert one["share"] == pytest.approx(-0.5)
    models = Chargeback(ledger, config).statement("2026-10").lines["model"].to_list()
    assert not any(is_unattributed(m) for m in models)


def test_a_counter_reset_counts_from_the_new_value(ledger: Ledger) -> None:
    """An engine restart mid-hour: the delta after the drop is the new value, so nothing is lost."""
    hour1 = requests(20, 1)
    restart = OCT + HOUR + 1200.0
    engine = engine_samples(hour1, OCT, OCT + 3 * HOUR, restart_at=restart)
    assert engine[80]["prompt_tokens_total"] < engine[78]["prompt_tokens_total"]
    fill(ledger, hour1, engine)
    one = row(reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR), 1)
    assert (one["engine_tokens"], one["ledger_tokens"]) == (3000, 3000)


def test_a_request_across_the_hour_counts_on_both_sides(ledger: Ledger) -> None:
    """A stream running over the window's edge is split by time, as the engine counted it."""
    # Hour 0's window ends at its last sample (00:59:00); this request runs from 00:58:50 to 00:59:10.
    across = [usage("search", OCT + 3530 - 0.1, 20.1, completion_tokens=100)]
    fill(ledger, across, engine_samples(across, OCT, OCT + 3 * HOUR))
    frame = reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR)
    zero, one = row(frame, 0), row(frame, 1)
    assert (zero["ledger_prompt_tokens"], zero["ledger_completion_tokens"]) == (100, 50)
    assert (one["ledger_prompt_tokens"], one["ledger_completion_tokens"]) == (0, 50)
    assert zero["difference_tokens"] == one["difference_tokens"] == 0


def test_instances_of_a_group_reconcile_each_on_its_own(ledger: Ledger) -> None:
    """Two instances of one group: each row is one instance, and only the lossy one differs."""
    a, b = requests(3, 1, instance="small-0-a"), requests(3, 1, instance="small-0-b")
    engine = engine_samples(a, OCT, OCT + 2 * HOUR, instance="small-0-a")
    engine += engine_samples(b, OCT, OCT + 2 * HOUR, instance="small-0-b")
    fill(ledger, a + b[1:], engine, hours=2)
    frame = reconciled.reconciled(ledger, OCT + HOUR, OCT + 2 * HOUR)
    assert frame.select("instance", "replica", "difference_tokens").rows() == [
        ("small-0-a", "small-0", 0),
        ("small-0-b", "small-0", 150),
    ]


def test_a_prompt_of_several_choices_counts_once_per_choice(ledger: Ledger, config: Config) -> None:
    """n=2: vLLM counts each prompt twice, the record once with choices 2; nothing is unattributed
    and the team's line keeps the prompt tokens its usage objects said."""
    hour1 = requests(10, 1, choices=2)
    fill(ledger, hour1, engine_samples(hour1, OCT, OCT + 3 * HOUR))
    one = row(reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR), 1)
    assert (one["engine_prompt_tokens"], one["ledger_prompt_tokens"]) == (2000, 2000)
    assert (one["difference_tokens"], one["unattributed_tokens"]) == (0, 0)
    lines = Chargeback(ledger, config).statement("2026-10").lines
    assert lines.filter(pl.col("team") == "search").select(
        "model", "requests", "prompt_tokens", "completion_tokens"
    ).rows() == [("chat-small", 10, 1000, 500)]
    assert not any(is_unattributed(m) for m in lines["model"])


def test_a_record_from_an_older_sidecar_counts_its_prompt_once(ledger: Ledger) -> None:
    """A record without ``choices`` (a shipper that predates it) is one choice."""
    hour1 = requests(4, 1)
    for r in hour1:
        del r["choices"]
    fill(ledger, hour1, engine_samples(hour1, OCT, OCT + 3 * HOUR))
    one = row(reconciled.reconciled(ledger, OCT, OCT + 3 * HOUR), 1)
    assert (one["engine_prompt_tokens"], one["ledger_prompt_tokens"]) == (400, 400)


@pytest.mark.parametrize("choices", [0, -1, 1_000_001])
def test_choices_out_of_range_are_refused(ledger: Ledger, choices: int) -> None:
    """A record whose choices is not 1..1,000,000 is refused with the reason, the others kept."""
    good, bad = requests(2, 1), usage("search", OCT + HOUR, choices=choices)
    result = ledger.ingest(batch("usage", [*good, bad]), now=OCT + 40 * 86400)
    assert result.accepted == 2
    assert [(r.id, r.reason) for r in result.rejected] == [
        (bad["request_id"], "choices: not between 1 and 1,000,000")
    ]


@pytest.mark.parametrize(
    ("key", "status"),
    [
        ("im-demo-admin", 200),
        ("im-demo-metrics", 200),
        ("im-demo-search", 403),
        ("im-demo-ingest", 403),
    ],
)
def test_the_query_is_for_the_admin_and_monitoring_not_teams(
    lossy: Ledger, config: Config, key: str, status: int
) -> None:
    """GET /v1/query/reconciliation answers the admin and metrics credentials; 403 for the rest."""
    with TestClient(create_app(config, lossy)) as client:
        response = client.get(
            "/v1/query/reconciliation",
            params={"from": OCT + HOUR, "to": OCT + 2 * HOUR},
            headers={"authorization": f"Bearer {key}"},
        )
    assert response.status_code == status, response.text
    if status == 200:
        body = response.json()
        rows = [dict(zip(body["columns"], r, strict=True)) for r in body["rows"]]
        assert [
            (r["instance"], r["difference_tokens"], r["unattributed_tokens"]) for r in rows
        ] == [("small-0", 600, 600)]


def test_metrics_show_the_last_whole_hour(lossy: Ledger) -> None:
    """The gauges describe the hour before the current one, per replica group."""
    registry = CollectorRegistry()
    registry.register(ReconciliationCollector(lossy, clock=lambda: OCT + 2 * HOUR + 1800))
    group = {"replica": "small-0", "model": "chat-small"}
    assert registry.get_sample_value("infermeter_reconciliation_unattributed_tokens", group) == 600
    assert registry.get_sample_value("infermeter_reconciliation_engine_tokens", group) == 3000
    assert registry.get_sample_value("infermeter_reconciliation_difference_tokens", group) == 600
    assert registry.get_sample_value("infermeter_reconciliation_unattributed_share", group) == 0.2
    assert registry.get_sample_value("infermeter_reconciliation_hour_start_seconds") == OCT + HOUR
    later = CollectorRegistry()
    later.register(ReconciliationCollector(lossy, clock=lambda: OCT + 3 * HOUR + 1800))
    assert later.get_sample_value("infermeter_reconciliation_unattributed_share", group) == 0.0


def test_late_records_lower_the_gauges_at_the_next_read(ledger: Ledger) -> None:
    """Records that arrive after the hour lower the share once the cached read is a minute old."""
    hour1 = requests(10, 1)
    fill(ledger, hour1[2:], engine_samples(hour1, OCT, OCT + 3 * HOUR))
    now = [OCT + 2 * HOUR + 60]
    registry = CollectorRegistry()
    registry.register(ReconciliationCollector(ledger, clock=lambda: now[0]))
    group = {"replica": "small-0", "model": "chat-small"}
    assert registry.get_sample_value("infermeter_reconciliation_unattributed_tokens", group) == 300
    ledger.ingest(batch("usage", hour1[:2]), now=OCT + 40 * 86400)
    now[0] += 30
    assert registry.get_sample_value("infermeter_reconciliation_unattributed_tokens", group) == 300
    now[0] += 31
    assert registry.get_sample_value("infermeter_reconciliation_unattributed_tokens", group) == 0


@st.composite
def lossy_fleets(draw):
    """Random fleets (as the allocation tests draw them) with random unattributed tokens in hour 0."""
    usage_slots, gpus, policy = draw(fleets())
    rows = []
    for replica in draw(st.lists(st.sampled_from(REPLICAS), unique=True)):
        engine = draw(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))
        lost = (draw(st.integers(0, engine[0])), draw(st.integers(0, engine[1])))
        rows.append(
            {
                "t": 0,
                "replica": replica,
                "model": "m1",
                "engine_prompt_tokens": engine[0],
                "engine_completion_tokens": engine[1],
                "unattributed_prompt_tokens": lost[0],
                "unattributed_completion_tokens": lost[1],
            }
        )
    counts = (
        "engine_prompt_tokens",
        "engine_completion_tokens",
        "unattributed_prompt_tokens",
        "unattributed_completion_tokens",
    )
    schema = {"t": pl.Int64, "replica": pl.String, "model": pl.String} | dict.fromkeys(
        counts, pl.Int64
    )
    # A fleet of fixed replicas: each replica is its one instance.
    recon = pl.DataFrame(rows, schema=schema).with_columns(instance=pl.col("replica"))
    usage_slots, gpus = (f.with_columns(instance=pl.col("replica")) for f in (usage_slots, gpus))
    gpus = gpus.with_columns(node=pl.lit("n1"))
    # The rollup keeps prompt-cache hits beside prompt tokens: none in these fleets.
    usage_slots = usage_slots.with_columns(cached_prompt_tokens=pl.lit(0, pl.Int64))
    return usage_slots, gpus, policy, recon


@settings(max_examples=100, deadline=None)
@given(lossy_fleets())
def test_teams_idle_and_unattributed_add_up_to_the_fleet_cost_to_the_cent(fleet: Any) -> None:
    """For random losses, every line together still sums to the fleet cost, to the cent."""
    usage_slots, gpus, policy, recon = fleet
    con = duckdb.connect()
    con.register("usage_in", usage_slots)
    con.register("gpus_in", gpus)
    con.register("recon_in", recon)

    def claims(c: duckdb.DuckDBPyConnection) -> tuple[pl.DataFrame, pl.DataFrame]:
        hourly = c.sql(unattributed_sql(policy, "recon_in")).pl()
        return claim_rows(hourly, policy), pl.DataFrame()

    lines, fleet = run(con, allocation_sql(policy, "usage_in", "gpus_in"), policy, claims)
    assert int(money(lines).sum()) == fleet
    assert all(c >= 0 for row in lines.select(*CASH).iter_rows() for c in row)
    rounded = cents_lines("2026-10", lines)
    assert int(rounded["total_cents"].sum() if rounded.height else 0) == cents(fleet)
