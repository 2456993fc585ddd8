"""Lifetimes kept at ingest: compaction, resends and order, migration, and a killed pod's end."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest

from billing import allocation_runs, registry
from billing.allocation import UNALLOCATED, Policy
from billing.ledger import Ledger
from billing.lifetimes import HEARTBEAT_RETENTION_SECONDS, ended_sql
from billing.schema import MIGRATIONS, new_field_sql
from infermeter.records import KINDS, EngineSample
from tests.billing.conftest import OCT, batch, gpu_samples, instance_event

T0 = OCT + 3600  # on a minute boundary
DAY = 86_400.0
TEAMS = ["search", "assistant"]
_ids = itertools.count()


def event(instance: str, kind: str, t: float, started_at: float, **kw: Any) -> dict[str, Any]:
    """An instance event of group g, as the sidecar writes it (ids sort by time, as its do)."""
    record = instance_event(
        instance,
        kind,
        t,
        started_at,
        event_id=f"{round(t * 1000):013d}/{instance}/{kind}/{next(_ids)}",
        replica="g",
        node="node-a",
        gpus=f"GPU-{instance}",
    )
    record.update(kw)
    return record


def beats(instance: str, start: float, last: float, every: float = 30.0) -> list[dict[str, Any]]:
    """Heartbeats of the lifetime started at ``start``, every ``every`` s up to ``last``."""
    count = int((last - start) // every)
    return [event(instance, "heartbeat", start + every * k, start) for k in range(1, count + 1)]


def gpu(instance: str, start: float, seconds: float, every: float = 10.0) -> list[dict[str, Any]]:
    """The one GPU of ``instance``, reported under its name every ``every`` s after ``start``."""
    samples = gpu_samples("g", start, seconds, every=every, node="node-a", gpu=instance)
    return [{**s, "instance": instance} for s in samples]


def engine(instance: str, t: float) -> dict[str, Any]:
    """One reading of ``instance``'s engine at ``t``."""
    return EngineSample(
        sample_id=f"{round(t * 1000):013d}/eng/{instance}/{next(_ids)}",
        replica="g",
        model="chat-small",
        timestamp=t,
        requests_running=0.0,
        requests_waiting=0.0,
        kv_cache_usage=0.0,
        prompt_tokens_total=0.0,
        generation_tokens_total=0.0,
        prefix_cache_queries_total=0.0,
        prefix_cache_hits_total=0.0,
        preemptions_total=0.0,
        instance=instance,
    ).to_json()


def keep(ledger: Ledger, kind: str, records: list[dict[str, Any]], now: float = T0 + DAY) -> int:
    """Ingest ``records`` (none refused); how many were new."""
    result = ledger.ingest(batch(kind, records), now=now)
    assert result.rejected == [], result.rejected
    return result.accepted


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    """An empty ledger in a DuckDB file."""
    led = Ledger.open(tmp_path / "ledger.duckdb", TEAMS, {})
    yield led
    led.close()


def rows(ledger: Ledger, sql: str) -> list[tuple[Any, ...]]:
    with ledger.reader() as cur:
        return cur.execute(sql).fetchall()


def table(ledger: Ledger) -> list[tuple[Any, ...]]:
    """Every column of every lifetime kept."""
    return rows(ledger, "SELECT * FROM lifetimes ORDER BY instance, started_at")


def ends(ledger: Ledger) -> dict[str, float]:
    """Each lifetime's end (instance, or instance@start when a name has several), by the rule."""
    found = rows(
        ledger,
        f"SELECT instance, started_at, {ended_sql(ledger.heartbeat_seconds)} "
        "FROM lifetimes ORDER BY ALL",
    )
    names = [i for i, _, _ in found]
    return {(i if names.count(i) == 1 else f"{i}@{s - T0:g}"): e - T0 for i, s, e in found}


# -- compaction ---------------------------------------------------------------------------


def test_a_day_of_heartbeats_is_one_row_per_lifetime_and_a_week_later_only_start_and_stop(ledger):
    """2,881 events of one pod make one lifetime row; heartbeats leave the raw table after a week."""
    sent = [
        event("g-a", "start", T0, T0),
        *beats("g-a", T0, T0 + DAY - 1),
        event("g-a", "stop", T0 + DAY, T0),
    ]
    for chunk in range(0, len(sent), 500):  # as a shipper sends them: batch after batch
        keep(ledger, "instances", sent[chunk : chunk + 500], now=T0 + DAY)
    assert len(sent) == 2_881
    assert rows(ledger, "SELECT count(*), sum(events), sum(heartbeats) FROM lifetimes") == [
        (1, 2_881, 2_879)
    ]
    assert rows(ledger, "SELECT count(*) FROM instance_events") == [(2_881,)]  # audit, for now

    # A week on, another pod's heartbeat arrives: the old heartbeats are pruned at once.
    later = T0 + DAY + HEARTBEAT_RETENTION_SECONDS + 3600
    keep(ledger, "instances", [event("g-b", "heartbeat", later, later - 30)], now=later)
    assert rows(
        ledger, "SELECT event, count(*) FROM instance_events GROUP BY ALL ORDER BY ALL"
    ) == [
        ("heartbeat", 1),
        ("start", 1),
        ("stop", 1),
    ]
    assert [
        (r["instance"], r["started_at"], r["last_seen"], r["stopped_at"], r["state"])
        for r in registry.lifetimes(ledger, now=later)
    ] == [
        ("g-a", T0, T0 + DAY, T0 + DAY, "stopped"),
        ("g-b", later - 30, later, None, "live"),
    ]
    assert rows(ledger, "SELECT heartbeats FROM lifetimes WHERE instance = 'g-a'") == [(2_879,)]


def test_a_heartbeat_already_past_its_retention_is_folded_but_not_kept_raw(ledger):
    """A spool shipped after a long outage: its old heartbeats still move the lifetime's end."""
    now = T0 + HEARTBEAT_RETENTION_SECONDS + DAY
    keep(ledger, "instances", [event("g-a", "start", T0, T0), *beats("g-a", T0, T0 + 90)], now=now)
    assert rows(ledger, "SELECT event FROM instance_events") == [("start",)]
    assert rows(ledger, "SELECT first_seen, last_seen, events, heartbeats FROM lifetimes") == [
        (T0, T0 + 90, 1, 0)
    ]


# -- resends and order --------------------------------------------------------------------


def test_a_resent_batch_changes_nothing(ledger):
    """The same events again, before and after their heartbeats are pruned: the same table."""
    sent = [
        event("g-a", "start", T0, T0),
        *beats("g-a", T0, T0 + 600),
        event("g-b", "start", T0 + 60, T0 + 60),
        *beats("g-b", T0 + 60, T0 + 300),
    ]
    keep(ledger, "instances", sent)
    kept = table(ledger)
    again = ledger.ingest(batch("instances", sent), now=T0 + DAY)
    assert (again.accepted, again.duplicates) == (0, len(sent))
    assert table(ledger) == kept
    # After the retention the raw heartbeats are gone; a resend must still count nothing.
    later = T0 + HEARTBEAT_RETENTION_SECONDS + DAY
    keep(ledger, "instances", [event("h", "heartbeat", later, later)], now=later)
    ledger.ingest(batch("instances", sent), now=later)
    assert [r for r in table(ledger) if r[0] != "h"] == kept


def shuffled_in_batches(records: list[dict[str, Any]], seed: int) -> list[list[dict[str, Any]]]:
    """``records`` in a random order, cut into random batches, some sent twice."""
    rng = random.Random(seed)
    order = records[:]
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), min(5, len(order) - 1)))
    parts = [order[a:b] for a, b in itertools.pairwise([0, *cuts, len(order)])]
    return [*parts, rng.choice(parts)]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_events_and_samples_in_any_order_and_batches_give_the_same_lifetimes(tmp_path, seed):
    """Late, reordered and repeated events and samples: the table of the in-order ingest."""
    url = "http://10.0.0.9:19000/engine/metrics"
    events = [
        event("g-a", "start", T0, T0),
        *beats("g-a", T0, T0 + 150),
        # It learned its metrics URL late: the latest event's word is kept.
        event("g-a", "heartbeat", T0 + 180, T0, engine_metrics_url=url, namespace="llm"),
        event("g-b", "start", T0 + 60, T0 + 60),
        *beats("g-b", T0 + 60, T0 + 240),
        event("g-b", "stop", T0 + 250, T0 + 60),
        # g-a's pod name comes back later: a second lifetime
        event("g-a", "start", T0 + 400, T0 + 400),
        *beats("g-a", T0 + 400, T0 + 460),
    ]
    samples = [*gpu("g-a", T0, 500), *gpu("g-b", T0 + 60, 200)]
    engines = [engine("g-a", T0 + 170), engine("g-a", T0 + 300)]

    def ingest(path: Path, batches: list[tuple[str, list[dict[str, Any]]]]) -> list[Any]:
        led = Ledger.open(path, TEAMS, {})
        try:
            for kind, records in batches:
                led.ingest(batch(kind, records), now=T0 + DAY)
            return table(led)
        finally:
            led.close()

    in_order = ingest(
        tmp_path / "in-order.duckdb",
        [("instances", events), ("gpu_samples", samples), ("engine_samples", engines)],
    )
    mixed = [
        (k, part)
        for k, records in (
            ("instances", events),
            ("gpu_samples", samples),
            ("engine_samples", engines),
        )
        for part in shuffled_in_batches(records, seed)
    ]
    random.Random(seed).shuffle(mixed)  # samples before the events they belong to, too
    assert ingest(tmp_path / "mixed.duckdb", mixed) == in_order
    first = next(r for r in in_order if r[0] == "g-a")
    assert (first[10], first[8]) == (url, "llm")  # engine_metrics_url, namespace


# The registry's answer as it was computed before ``lifetimes`` was kept: aggregated from the raw
# events at every request.
_BEFORE = """
SELECT instance, started_at, arg_max(replica, "timestamp"), arg_max(node, "timestamp"),
    arg_max(engine_metrics_url, "timestamp"), max("timestamp") AS last_seen,
    min("timestamp") FILTER (WHERE event = 'stop') AS stopped_at
FROM instance_events GROUP BY instance, started_at ORDER BY 1, 2"""


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_the_registry_answers_what_the_raw_events_said(ledger, seed):
    """Random pods, restarts, stops and silences: the lifetimes the old aggregate gave, live or not."""
    rng = random.Random(seed)
    events = []
    for pod in range(12):
        start = T0 + rng.uniform(0, 600)
        for _ in range(rng.randint(1, 3)):  # lifetimes of one pod name, one after the other
            last = start + rng.uniform(30, 900)
            url = f"http://10.0.0.{pod}:{rng.randint(1000, 9999)}/engine/metrics"
            beats_ = [
                {**b, "timestamp": b["timestamp"] + rng.uniform(0, 1)}
                for b in beats(f"g-{pod}", start, last)
            ]
            if beats_ and rng.random() < 0.5:
                beats_[-1]["engine_metrics_url"] = url  # learned late
            events += [event(f"g-{pod}", "start", start, start), *beats_]
            if rng.random() < 0.6:
                events.append(event(f"g-{pod}", "stop", last + 1, start))
            start = last + rng.uniform(5, 120)
    for part in shuffled_in_batches(events, seed):
        ledger.ingest(batch("instances", part), now=T0 + DAY)
    now = T0 + rng.uniform(300, 3000)
    answer = [
        (
            r["instance"],
            r["started_at"],
            r["replica"],
            r["node"],
            r["engine_metrics_url"],
            r["last_seen"],
            r["stopped_at"],
        )
        for r in registry.lifetimes(ledger, now=now)
    ]
    assert sorted(answer) == rows(ledger, _BEFORE)
    live = {
        (r["instance"], r["started_at"]) for r in registry.lifetimes(ledger, now=now, state="live")
    }
    assert live == {
        (i, s) for i, s, *_, last, stop in rows(ledger, _BEFORE) if stop is None and last > now - 90
    }


# -- where a lifetime that never stopped ends ------------------------------------------------


def test_a_killed_pod_ends_at_its_last_gpu_sample_not_its_last_heartbeat(ledger):
    """Heartbeats to 1:30, its GPU read to 1:50: it ran until 1:50, not 1:30."""
    keep(ledger, "instances", [event("g-k", "start", T0, T0), *beats("g-k", T0, T0 + 90)])
    keep(ledger, "gpu_samples", gpu("g-k", T0, 110))
    assert ends(ledger) == {"g-k": 110}


def test_a_gpu_reported_under_a_gone_pods_name_counts_only_to_the_heartbeat_that_never_came(ledger):
    """The board is reported under g-k's name for minutes: g-k ends at 1:30 + 30 s, not later."""
    keep(ledger, "instances", [event("g-k", "start", T0, T0), *beats("g-k", T0, T0 + 90)])
    keep(ledger, "gpu_samples", gpu("g-k", T0, 600))
    assert ends(ledger) == {"g-k": 120}


def test_its_engine_answering_proves_it_ran_longer(ledger):
    """An engine reading at 5:00 is the pod itself answering: the lifetime runs to 5:00."""
    keep(ledger, "instances", [event("g-k", "start", T0, T0), *beats("g-k", T0, T0 + 90)])
    keep(ledger, "gpu_samples", gpu("g-k", T0, 600))
    keep(ledger, "engine_samples", [engine("g-k", T0 + 60), engine("g-k", T0 + 300)])
    assert ends(ledger) == {"g-k": 300}


def test_a_stop_is_the_end_whatever_the_samples_say(ledger):
    """A stopped lifetime ends at its stop, samples after it (a stale label) or not."""
    keep(ledger, "gpu_samples", gpu("g-a", T0, 600))
    keep(ledger, "engine_samples", [engine("g-a", T0 + 300)])
    keep(
        ledger,
        "instances",
        [
            event("g-a", "start", T0, T0),
            *beats("g-a", T0, T0 + 90),
            event("g-a", "stop", T0 + 100, T0),
        ],
    )
    assert ends(ledger) == {"g-a": 100}


def test_samples_that_came_before_the_lifetimes_events_still_count(ledger):
    """The collector's batch arrived first: the lifetime is read from the samples when it opens."""
    keep(ledger, "gpu_samples", gpu("g-k", T0, 110))
    keep(ledger, "engine_samples", [engine("g-k", T0 + 100)])
    keep(ledger, "instances", [event("g-k", "heartbeat", T0 + 90, T0)])
    assert ends(ledger) == {"g-k": 110}
    assert rows(ledger, "SELECT engine_seen_until - started_at FROM lifetimes") == [(100,)]


def test_a_pod_name_that_comes_back_does_not_lengthen_its_earlier_lifetime(ledger):
    """vllm-0 killed at 1:30 and back at 1:40: the new pod's samples are the new lifetime's."""
    keep(ledger, "instances", [event("g-0", "start", T0, T0), *beats("g-0", T0, T0 + 90)])
    # The new pod's GPU samples and engine readings arrive before its own start event.
    keep(ledger, "gpu_samples", gpu("g-0", T0, 95) + gpu("g-0", T0 + 100, 200))
    keep(ledger, "engine_samples", [engine("g-0", T0 + 200)])
    assert ends(ledger) == {"g-0": 200}  # one lifetime known so far: the readings are its
    keep(ledger, "instances", [event("g-0", "start", T0 + 100, T0 + 100)])
    assert ends(ledger) == {"g-0@0": 90, "g-0@100": 200}


def test_allocation_gives_a_killed_pod_the_minute_it_still_held_its_gpu(ledger):
    """Last heartbeat at 1:50, GPU read to 2:10: minute 2 is the pod's idle, not unallocated."""
    keep(
        ledger,
        "instances",
        [event("g-k", "start", T0 + 20, T0 + 20), *beats("g-k", T0 + 20, T0 + 110)],
    )
    # Its board is read every 10 s until 2:10, then reported under its name until 7:00.
    keep(ledger, "gpu_samples", gpu("g-k", T0, 420))
    policy = Policy.listed(
        usd_per_gpu_hour={"L40S": 6.0},
        idle={"g": ("platform", None)},
        replica_model={"g": "chat-small"},
    )
    lines, _ = allocation_runs.allocate(ledger, policy, "2026-10")
    idle = {m: uc / 10**8 for m, uc in lines.select("model", "idle_microcents").iter_rows()}
    # $0.10 a GPU-minute. The pod ended at 2:10 (the cap, 1:50 + 30 s, is not reached): minutes
    # 0, 1 and 2 are its idle; before, it ended at 1:50 and minute 2 was unallocated.
    assert idle == {"chat-small": 0.30, UNALLOCATED: 0.40}


# -- migration -------------------------------------------------------------------------------


def old_ledger(path: Path) -> None:
    """A ledger of schema version 6 holding a month's start of raw events and samples."""
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER, applied_at DOUBLE)")
    for version, migration in enumerate(MIGRATIONS[:6], start=1):
        con.execute(migration)
        con.execute("INSERT INTO schema_version VALUES (?, 0)", [version])
    for kind in KINDS.values():  # the fields version 6 had by the time it was opened
        columns = [
            r[0]
            for r in con.execute(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [kind.table]
            ).fetchall()
        ]
        for statement in new_field_sql(kind, columns):
            con.execute(statement)
    events = [
        event("g-a", "start", T0, T0),
        *beats("g-a", T0, T0 + 600),
        event("g-a", "stop", T0 + 610, T0),
        *beats("g-k", T0 + 60, T0 + 300),  # killed: heartbeats only
        event("g-k", "heartbeat", T0 + 330, T0 + 60, engine_metrics_url="http://k/engine/metrics"),
    ]
    samples = [{**s, "gap": False, "xid_errors": 0} for s in gpu("g-k", T0 + 60, 290)]
    for table_name, records in (
        ("instance_events", events),
        ("gpu_samples", samples),
        ("engine_samples", [engine("g-k", T0 + 400)]),
    ):
        frame = pl.DataFrame(records).with_columns(ingested_at=pl.lit(T0 + DAY))
        con.register("_rows", frame)
        con.execute(f"INSERT INTO {table_name} BY NAME SELECT * FROM _rows")
        con.unregister("_rows")
    con.close()


def test_an_old_ledgers_raw_heartbeats_become_lifetimes(tmp_path):
    """Version 6 with raw events: the registry answers as before, and the killed pod's end is read."""
    path = tmp_path / "v6.duckdb"
    old_ledger(path)
    ledger = Ledger.open(path, TEAMS, {})
    try:
        lives = registry.lifetimes(ledger, now=T0 + DAY)
        assert [
            (
                r["instance"],
                r["started_at"],
                r["last_seen"],
                r["stopped_at"],
                r["state"],
                r["engine_metrics_url"],
            )
            for r in lives
        ] == [
            ("g-a", T0, T0 + 610, T0 + 610, "stopped", None),
            ("g-k", T0 + 60, T0 + 330, None, "lost", "http://k/engine/metrics"),
        ]
        assert rows(ledger, "SELECT instance, events, heartbeats FROM lifetimes ORDER BY 1") == [
            ("g-a", 22, 20),
            ("g-k", 9, 9),
        ]
        assert ends(ledger) == {"g-a": 610, "g-k": 400}  # its engine answered at 6:40
    finally:
        ledger.close()
