"""Ingest: every good record kept once, every bad one refused with its reason, the rest kept."""

from __future__ import annotations

import threading
import time
from typing import Any

import orjson
import pytest

from billing.ledger import BatchTooLargeError, Ledger
from infermeter.errors import BadRequest
from infermeter.records import USAGE
from infermeter.wire import encode_arrow
from tests.billing.conftest import OCT, batch, gpu_samples, ndjson, usage

NOW = OCT + 86400


def _count(ledger: Ledger, table: str) -> int:
    with ledger.reader() as cur:
        row = cur.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def test_good_records_are_kept_with_their_values(ledger):
    """A batch of valid usage records lands in the usage table, field for field."""
    records = [usage(), usage(team="assistant", completion_tokens=7)]
    result = ledger.ingest(batch("usage", records), now=NOW)
    assert (result.accepted, result.duplicates, result.rejected) == (2, 0, [])
    with ledger.reader() as cur:
        rows = cur.execute(
            "SELECT request_id, team, completion_tokens, stream FROM usage ORDER BY request_id"
        ).fetchall()
    assert sorted(rows) == sorted(
        (r["request_id"], r["team"], r["completion_tokens"], True) for r in records
    )


def test_a_resent_batch_counts_nothing_twice(ledger):
    """The same batch sent again is all duplicates: rows and rollups unchanged."""
    body = batch("usage", [usage(), usage()])
    ledger.ingest(body, now=NOW)
    with ledger.reader() as cur:
        before = cur.execute(
            "SELECT sum(requests), sum(inflight_seconds) FROM usage_slots"
        ).fetchone()
    again = ledger.ingest(body, now=NOW)
    assert (again.accepted, again.duplicates) == (0, 2)
    assert _count(ledger, "usage") == 2
    with ledger.reader() as cur:
        assert (
            cur.execute("SELECT sum(requests), sum(inflight_seconds) FROM usage_slots").fetchone()
            == before
        )


def test_a_repeated_id_inside_one_batch_is_kept_once(ledger):
    """Two records with the same id in one batch: the first is kept, the second is a duplicate."""
    first = usage()
    second = dict(first, completion_tokens=999)
    result = ledger.ingest(batch("usage", [first, second]), now=NOW)
    assert (result.accepted, result.duplicates) == (1, 1)
    with ledger.reader() as cur:
        assert cur.execute("SELECT completion_tokens FROM usage").fetchall() == [(50,)]


BAD: list[tuple[str, Any, str]] = [
    ("negative tokens", usage(completion_tokens=-5), "token counts must not be negative"),
    ("future timestamp", usage(start=NOW + 3600), "timestamp in the future: finished_at"),
    ("string for a number", usage(prompt_tokens="100"), "prompt_tokens: must be an integer"),
    ("float for an integer", usage(prompt_tokens=1.5), "prompt_tokens: must be an integer"),
    ("boolean for an integer", usage(prompt_tokens=True), "prompt_tokens: must be an integer"),
    ("number for a boolean", usage(stream=1), "stream: must be a boolean"),
    ("missing field", {k: v for k, v in usage().items() if k != "replica"}, "replica: missing"),
    ("unknown key", dict(usage(), colour="red"), "unknown key(s): colour"),
    ("not an object", 42, "not a JSON object"),
    ("null where not allowed", dict(usage(), team=None), "team: must be a string"),
    (
        "milliseconds",
        usage(start=OCT * 1000, finished_at=OCT * 1000 + 1),
        "timestamp in the future: finished_at",
    ),
    ("finish before start", usage(finished_at=OCT), "finished_at is before received_at"),
    ("unknown status", usage(status="great"), 'status: unknown value "great"'),
]


@pytest.mark.parametrize(("case", "record", "reason"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_record_is_refused_with_its_reason_and_the_rest_kept(ledger, case, record, reason):
    """One bad record among good ones: it alone is rejected, with a reason naming the problem."""
    good = [usage(), usage()]
    result = ledger.ingest(batch("usage", [good[0], record, good[1]]), now=NOW)
    assert result.accepted == 2
    assert [r.reason for r in result.rejected] == [reason]
    assert _count(ledger, "usage") == 2


def test_a_record_of_an_unknown_team_is_quarantined_whole_and_the_rest_kept(ledger):
    """A well-formed record for a team the configuration does not know is kept in quarantine
    with its reason, not billed and not handed back as rejected."""
    stranger = usage(team="nobody")
    result = ledger.ingest(batch("usage", [usage(), stranger, usage()]), now=NOW)
    assert (result.accepted, result.rejected) == (2, [])
    assert [(r.id, r.reason) for r in result.quarantined] == [
        (stranger["request_id"], 'unknown team "nobody"')
    ]
    assert _count(ledger, "usage") == 2
    with ledger.reader() as cur:
        kept = cur.execute("SELECT label, record FROM quarantine").fetchall()
    assert [(label, orjson.loads(record)["team"]) for label, record in kept] == [
        ("unknown_team", "nobody")
    ]


def test_a_batch_of_only_bad_types_is_refused_record_by_record(ledger):
    """Every record wrong in the same way (no good one to compare with) is still refused."""
    result = ledger.ingest(
        batch("usage", [usage(prompt_tokens="1"), usage(prompt_tokens="2")]), now=NOW
    )
    assert [r.reason for r in result.rejected] == ["prompt_tokens: must be an integer"] * 2


def test_optional_fields_may_be_left_out(ledger):
    """endpoint, finish_reason and usage_exact have defaults; records without them are kept."""
    record = {
        k: v for k, v in usage().items() if k not in ("endpoint", "finish_reason", "usage_exact")
    }
    assert ledger.ingest(batch("usage", [record]), now=NOW).accepted == 1
    with ledger.reader() as cur:
        assert cur.execute("SELECT endpoint, finish_reason, usage_exact FROM usage").fetchall() == [
            ("/v1/chat/completions", None, True)
        ]


def test_unauthorized_requests_are_kept_for_audit_but_not_billed(ledger):
    """A 401 has no team; it is stored, and no slot or charge comes from it."""
    record = usage(
        team="", status="unauthorized", http_status=401, prompt_tokens=0, completion_tokens=0
    )
    result = ledger.ingest(batch("usage", [record]), now=NOW)
    assert result.accepted == 1
    assert _count(ledger, "usage_slots") == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"usage": [], "gpu_samples": []}', "exactly one key"),
        (b'{"bills": []}', "exactly one key"),
        (b'{"usage": {"a": 1}}', "must be a JSON array"),
    ],
)
def test_a_malformed_batch_is_refused_whole(ledger, body, message):
    """A body that is not a batch raises BadRequest (the caller's fault) naming what is wrong."""
    with pytest.raises(BadRequest, match=message):
        ledger.ingest(body, now=NOW)


def test_a_batch_over_the_limit_is_refused(ledger):
    """More records than max_records: BatchTooLargeError, nothing kept."""
    with pytest.raises(BatchTooLargeError, match="3 records in one batch; at most 2"):
        ledger.ingest(batch("usage", [usage(), usage(), usage()]), now=NOW, max_records=2)
    assert _count(ledger, "usage") == 0


def test_inflight_seconds_are_spread_over_the_minutes_a_request_spans(ledger):
    """A request from 00:59:30 to 01:01:15 holds 30 s, 60 s and 15 s of three slots."""
    start = OCT + 3600 - 30
    ledger.ingest(batch("usage", [usage(start=start, seconds=105)]), now=NOW)
    with ledger.reader() as cur:
        rows = cur.execute(
            "SELECT slot * 60 - ?, inflight_seconds, requests FROM usage_slots ORDER BY slot", [OCT]
        ).fetchall()
    assert rows == [(3540.0, 30.0, 0), (3600.0, 60.0, 0), (3660.0, 15.0, 1)]


def test_gpu_samples_roll_up_to_gpu_seconds_and_energy(ledger):
    """An hour of 10 s samples at 200 W is 3600 GPU-seconds and 720 kJ."""
    result = ledger.ingest(batch("gpu_samples", gpu_samples()), now=NOW)
    assert result.accepted == 360
    with ledger.reader() as cur:
        row = cur.execute(
            "SELECT sum(gpu_seconds), sum(energy_joules), sum(power_watt_seconds) / sum(gpu_seconds) FROM gpu_slots"
        ).fetchone()
    assert row == pytest.approx((3600.0, 720_000.0, 200.0))


def test_gpu_samples_without_energy_count_as_unmeasured(ledger):
    """A gap sample (energy unknown) adds GPU time but no energy, and is marked unmeasured."""
    sample = gpu_samples(seconds=10)[0] | {"energy_joules": None, "gap": True}
    ledger.ingest(batch("gpu_samples", [sample]), now=NOW)
    with ledger.reader() as cur:
        assert cur.execute(
            "SELECT sum(gpu_seconds), sum(energy_joules), sum(unmeasured_seconds) FROM gpu_slots"
        ).fetchone() == (10.0, 0.0, 10.0)


def test_engine_samples_are_kept(ledger):
    """Engine samples from the collector land in engine_samples."""
    sample = {
        "sample_id": "e1",
        "replica": "small-0",
        "model": "chat-small",
        "timestamp": OCT + 5,
        "requests_running": 3.0,
        "requests_waiting": 1.0,
        "kv_cache_usage": 0.2,
        "prompt_tokens_total": 10.0,
        "generation_tokens_total": 20.0,
    }
    assert ledger.ingest(orjson.dumps({"engine_samples": [sample]}), now=NOW).accepted == 1
    assert _count(ledger, "engine_samples") == 1


def test_a_ledger_file_survives_reopening(tmp_path, config):
    """Records committed to a file are there after it is closed and opened again."""
    path = tmp_path / "ledger.duckdb"
    teams = [t.name for t in config.teams]
    first = Ledger.open(path, teams, {})
    first.ingest(batch("usage", [usage()]), now=NOW)
    first.close()
    second = Ledger.open(path, teams, {})
    try:
        assert _count(second, "usage") == 1
        assert second.ingest(batch("usage", []), now=NOW).accepted == 0
    finally:
        second.close()


def test_a_ledger_from_a_newer_version_is_refused(tmp_path, config):
    """A file whose schema version is ahead of this code is not opened."""
    import duckdb

    from billing.ledger import LedgerError

    path = tmp_path / "ledger.duckdb"
    Ledger.open(path, [], {}).close()
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO schema_version VALUES (99, 0)")
    con.close()
    with pytest.raises(LedgerError, match="schema version 99 is newer"):
        Ledger.open(path, [], {})


def test_an_older_ledger_is_migrated_with_its_data(tmp_path):
    """A version-1 file gains replica_slots, filled from its existing rollups."""
    import duckdb

    from billing.schema import LATEST_VERSION, MIGRATIONS

    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER, applied_at DOUBLE)")
    con.execute(MIGRATIONS[0])
    con.execute("INSERT INTO schema_version VALUES (1, 0)")
    con.execute(
        "INSERT INTO usage_slots VALUES ('small-0', 'search', 'chat-small', 100, 30, 1, 0, 1, 0, 1, 0.1, 1, 1, 1)"
    )
    con.execute(
        "INSERT INTO usage_slots VALUES ('small-0', 'assistant', 'chat-small', 100, 20, 1, 0, 1, 0, 1, 0.1, 1, 1, 1)"
    )
    con.close()
    ledger = Ledger.open(path, ["search", "assistant"], {})
    try:
        with ledger.reader() as cur:
            assert cur.execute("SELECT max(version) FROM schema_version").fetchall() == [
                (LATEST_VERSION,)
            ]
            assert cur.execute(
                "SELECT replica, slot, inflight_seconds FROM replica_slots"
            ).fetchall() == [("small-0", 100, 50.0)]
    finally:
        ledger.close()


def test_occupancy_is_the_sum_over_teams(ledger):
    """replica_slots holds every team's in-flight seconds of a replica's minute together."""
    ledger.ingest(
        batch("usage", [usage("search", OCT, 30), usage("assistant", OCT + 10, 40)]), now=NOW
    )
    with ledger.reader() as cur:
        assert cur.execute(
            "SELECT slot * 60 - ?, inflight_seconds FROM replica_slots", [OCT]
        ).fetchall() == [(0.0, 70.0)]


@pytest.mark.parametrize(("case", "record", "reason"), BAD, ids=[b[0] for b in BAD])
def test_ndjson_batches_refuse_the_same_records_for_the_same_reasons(ledger, case, record, reason):
    """The shippers' NDJSON route and the JSON route give one record the same verdict."""
    good = [usage(), usage()]
    result = ledger.ingest_lines("usage", ndjson([good[0], record, good[1]]), now=NOW)
    assert result.accepted == 2
    assert [r.reason for r in result.rejected] == [reason]
    assert _count(ledger, "usage") == 2


def test_an_ndjson_line_that_is_not_json_is_refused_alone(ledger):
    """A garbled line is one rejected record, named by its line; the lines around it are kept."""
    body = ndjson([usage()]) + b'{"request_id": "torn\n' + ndjson([usage()])
    result = ledger.ingest_lines("usage", body, now=NOW)
    assert result.accepted == 2
    assert [(r.id, r.reason) for r in result.rejected] == [("#2", "not valid JSON")]


def test_an_ndjson_batch_resent_as_json_counts_nothing_twice(ledger):
    """Idempotency is by record id, whichever route a batch took."""
    records = [usage() for _ in range(3)]
    assert ledger.ingest_lines("usage", ndjson(records), now=NOW).accepted == 3
    again = ledger.ingest(batch("usage", records), now=NOW)
    assert (again.accepted, again.duplicates) == (0, 3)
    assert _count(ledger, "usage") == 3


def test_ndjson_of_an_unknown_kind_or_over_the_limit_is_refused_whole(ledger):
    """An unknown kind names the known ones; too many lines is BatchTooLargeError."""
    with pytest.raises(BadRequest, match="unknown record kind 'bills'; one of: usage"):
        ledger.ingest_lines("bills", ndjson([usage()]), now=NOW)
    with pytest.raises(BatchTooLargeError):
        ledger.ingest_lines("usage", ndjson([usage(), usage(), usage()]), now=NOW, max_records=2)
    assert _count(ledger, "usage") == 0


def test_batches_waiting_for_the_writer_share_one_transaction(ledger):
    """Group commit: three callers, one transaction, and each caller gets its own answer.

    The writer lock is held while the callers queue, so their batches are committed together.
    An id in two batches is kept once (a duplicate for the later batch); a bad record is
    reported to the caller that sent it.
    """
    shared = usage()
    bodies = [
        ndjson([usage(), shared]),
        ndjson([shared, usage(), usage()]),
        ndjson([usage(), usage(team="nobody")]),
    ]
    results: dict[int, Any] = {}
    with ledger._write_lock:
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(
                    i, ledger.ingest_lines("usage", bodies[i], now=NOW)
                )
            )
            for i in range(3)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while ledger._group.waiting < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ledger._group.waiting == 3
    for t in threads:
        t.join(10)
    answers = {
        i: (r.accepted, r.duplicates, [x.reason for x in r.rejected + r.quarantined])
        for i, r in results.items()
    }
    # The shared id is fresh in whichever of the first two batches was queued first.
    assert {answers[0][:2], answers[1][:2]} in ({(2, 0), (2, 1)}, {(1, 1), (3, 0)})
    assert answers[2] == (1, 0, ['unknown team "nobody"'])
    assert sum(a[0] for a in answers.values()) == _count(ledger, "usage") == 5
    with ledger.reader() as cur:
        assert cur.execute("SELECT sum(requests) FROM usage_slots").fetchone() == (5,)


def test_an_arrow_batch_is_checked_and_kept_likendjson(ledger):
    """Typed columns skip the type checks, not the range checks: same verdicts, same rows."""
    records = [
        usage(),
        usage(team="nobody"),
        usage(completion_tokens=-5),
        usage(),
    ]
    encoded = encode_arrow(USAGE, ndjson(records))
    assert encoded is not None
    result = ledger.ingest_arrow("usage", encoded, now=NOW)
    assert (result.accepted, result.duplicates) == (2, 0)
    assert [(r.id, r.reason) for r in result.rejected] == [
        (records[2]["request_id"], "token counts must not be negative"),
    ]
    assert [(r.id, r.reason) for r in result.quarantined] == [
        (records[1]["request_id"], 'unknown team "nobody"'),
    ]
    again = ledger.ingest_lines("usage", ndjson(records), now=NOW)
    assert (again.accepted, again.duplicates, len(again.rejected)) == (0, 2, 1)
    assert len(again.quarantined) == 1
    with pytest.raises(BatchTooLargeError):
        ledger.ingest_arrow("usage", encoded, now=NOW, max_records=3)
