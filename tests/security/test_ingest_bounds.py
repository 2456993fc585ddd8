"""Ingest against the holder of the ingest token: no double counting, no unbounded record, no NaN."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pytest

from billing.chargeback import Chargeback
from billing.ingest_sql import MAX_REQUEST_SECONDS, MAX_TOKENS
from billing.ledger import Ledger
from infermeter.errors import BadRequest
from infermeter.ids import request_id, sample_id
from infermeter.records import GPU, USAGE
from infermeter.wire import arrow_schema, encode_arrow
from tests.billing.conftest import NOV, OCT, gpu_samples, ndjson, usage

NOW = NOV + 86_400.0


def _count(ledger: Ledger, table: str) -> int:
    with ledger.reader() as con:
        row = con.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def test_an_id_resent_with_a_shifted_time_is_kept_once(ledger):
    """Dedup is by id for ever, not only within the batch's time range."""
    first = usage(request_id=request_id(OCT + 3600), start=OCT + 3600)
    shifted = first | {
        "received_at": OCT + 20 * 86_400,
        "first_token_at": OCT + 20 * 86_400 + 0.1,
        "finished_at": OCT + 20 * 86_400 + 10,
    }
    assert ledger.ingest_lines("usage", ndjson([first]), now=NOW).accepted == 1
    again = ledger.ingest_lines("usage", ndjson([shifted]), now=NOW)
    assert (again.accepted, again.duplicates) == (0, 1)
    assert _count(ledger, "usage") == 1


def test_ids_sort_by_time():
    """Request and sample ids sort as their times do, which keeps the id lookup cheap."""
    times = [OCT + 86_400 * 400, OCT + 1, OCT, OCT + 0.001, OCT + 99.5]
    ids = {t: request_id(t) for t in times}
    assert sorted(ids.values()) == [ids[t] for t in sorted(times)]
    samples = {(t, node): sample_id(t, node, "GPU-1") for t in times for node in ("b", "a")}
    by_time = [samples[k] for k in sorted(samples)]
    assert sorted(samples.values()) == by_time


@pytest.mark.parametrize(
    ("odd", "reason"),
    [
        (
            {"received_at": NOV - MAX_REQUEST_SECONDS - 60.0, "first_token_at": None},
            f"finished_at is more than {MAX_REQUEST_SECONDS} s after received_at",
        ),
        ({"prompt_tokens": MAX_TOKENS + 1}, f"token counts above {MAX_TOKENS:,}"),
        ({"completion_tokens": 10**15}, f"token counts above {MAX_TOKENS:,}"),
    ],
)
def test_a_record_out_of_bounds_is_rejected(ledger, odd, reason):
    """A record spanning days, or with absurd token counts, is refused with its reason."""
    record = usage(start=NOV, seconds=10) | odd
    result = ledger.ingest_lines("usage", ndjson([record]), now=NOW)
    assert [r.reason for r in result.rejected] == [reason]
    assert _count(ledger, "usage_slots") == 0


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_sample_that_is_not_a_finite_number_is_rejected_and_the_month_still_computes(
    ledger, config, value
):
    """Arrow can carry NaN and infinity (JSON cannot): such a sample is refused, chargeback works."""
    samples = gpu_samples(start=OCT, seconds=60)
    for s in samples:
        s.update(xid_errors=0, mig_profile=None, gap=False, share=1.0)
    samples[1]["energy_joules"] = value
    table = pa.Table.from_pylist(samples, schema=arrow_schema(GPU))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    result = ledger.ingest_arrow("gpu_samples", sink.getvalue().to_pybytes(), now=NOW)
    assert [r.reason for r in result.rejected] == ["energy_joules: not a finite number"]
    assert result.accepted == len(samples) - 1
    statement = Chargeback(ledger, config).statement("2026-10")
    assert statement.fleet_cents > 0
    assert statement.reconciles


def test_a_json_batch_with_a_duplicate_key_is_refused_whole(ledger):
    """orjson keeps the last of two keys and DuckDB the first: such a batch is never read."""
    small, large = [usage()], [usage() for _ in range(5)]
    body = b'{"usage": ' + orjson.dumps(small) + b', "usage": ' + orjson.dumps(large) + b"}"
    with pytest.raises(BadRequest, match="duplicate key 'usage'"):
        ledger.ingest(body, now=NOW, max_records=2)
    body = b'{"usage": ' + orjson.dumps(large) + b', "usage": ' + orjson.dumps(small) + b"}"
    with pytest.raises(BadRequest, match="duplicate key 'usage'"):
        ledger.ingest(body, now=NOW, max_records=2)
    assert _count(ledger, "usage") == 0


def test_an_ndjson_line_with_a_duplicate_key_is_rejected_by_name(ledger):
    """The line is refused naming the key; its neighbours are kept."""
    good = usage()
    dup = orjson.dumps(usage())[:-1] + b', "team": "chat"}'
    body = ndjson([good]) + dup + b"\n"
    result = ledger.ingest_lines("usage", body, now=NOW)
    assert result.accepted == 1
    assert [r.reason for r in result.rejected] == ["duplicate key(s): team"]


def test_the_shippers_arrow_conversion_refuses_a_duplicate_key():
    """A spooled line with a duplicate key is not turned into Arrow (it goes as NDJSON)."""
    dup = orjson.dumps(usage())[:-1] + b', "team": "chat"}\n'
    assert encode_arrow(USAGE, ndjson([usage()])) is not None
    assert encode_arrow(USAGE, dup) is None
