"""The record kinds are declared once: every form billing and the shippers use is derived from them."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import duckdb
import orjson
import pyarrow as pa
import pytest

from billing import ingest_sql
from billing.columns import COLUMN_TYPES
from billing.ledger import Ledger
from infermeter.records import (
    BILLABLE_STATUSES,
    ENGINE,
    GPU,
    KINDS,
    USAGE,
    FieldType,
    RecordKind,
    RequestStatus,
    UsageRecord,
    record_kind,
)
from infermeter.wire import arrow_schema, encode_arrow
from tests.billing.conftest import OCT, ndjson, usage


@dataclass(frozen=True, slots=True)
class UsageWithTier(UsageRecord):
    """The usage record with one field more, declared the way a maintainer would add it."""

    service_tier: str = "standard"


TIERED: RecordKind = record_kind(
    UsageWithTier, key="usage", table="usage", id_field="request_id", time_field="received_at"
)
TIERED_KINDS = {**KINDS, "usage": TIERED}


def _open(path: Path, kinds: dict[str, RecordKind]) -> Ledger:
    return Ledger.open(path, ["search", "chat"], {"chat-small": 1.0}, kinds=kinds)


def test_a_field_added_to_the_declaration_reaches_wire_ledger_and_ingest(tmp_path: Path) -> None:
    """One new dataclass field: Arrow schema, ledger column (old rows get the default), and ingest."""
    path = tmp_path / "ledger.duckdb"
    old = _open(path, KINDS)
    assert old.ingest_lines("usage", ndjson([usage(request_id="before")])).accepted == 1
    old.close()

    assert arrow_schema(TIERED).field("service_tier").type == pa.string()
    ledger = _open(path, TIERED_KINDS)
    try:
        new = usage(request_id="after", start=OCT + 7200) | {"service_tier": "priority"}
        absent = usage(request_id="absent", start=OCT + 7300)
        arrow = encode_arrow(TIERED, ndjson([new]))
        assert arrow is not None
        assert ledger.ingest_arrow("usage", arrow).accepted == 1
        assert ledger.ingest_lines("usage", ndjson([absent])).accepted == 1
        with ledger.reader() as con:
            rows = con.execute(
                "SELECT request_id, service_tier FROM usage ORDER BY request_id"
            ).fetchall()
    finally:
        ledger.close()
    assert rows == [("absent", "standard"), ("after", "priority"), ("before", "standard")]


def test_a_new_field_without_a_default_is_refused_for_an_existing_ledger(tmp_path: Path) -> None:
    """A required field cannot be added to a table that holds records without it."""

    hints = typing.get_type_hints(UsageRecord)
    declared = dataclasses.fields(UsageRecord)
    required = [(f.name, hints[f.name]) for f in declared if f.default is dataclasses.MISSING]
    optional = [
        (f.name, hints[f.name], dataclasses.field(default=f.default))
        for f in declared
        if f.default is not dataclasses.MISSING
    ]
    with_region = dataclasses.make_dataclass(
        "UsageWithRegion", [*required, ("region", str), *optional], frozen=True
    )
    kind = record_kind(
        with_region, key="usage", table="usage", id_field="request_id", time_field="received_at"
    )
    assert kind.field("region").required
    _open(tmp_path / "l.duckdb", KINDS).close()
    with pytest.raises(ValueError, match="region: a field added to a record kind needs a default"):
        _open(tmp_path / "l.duckdb", {**KINDS, "usage": kind})


@pytest.mark.parametrize("kind", [USAGE, GPU, ENGINE], ids=lambda k: k.key)
def test_the_ledger_tables_have_exactly_the_declared_fields(kind: RecordKind) -> None:
    """A fresh ledger's raw table holds each declared field with its SQL type, plus ingested_at."""
    ledger = Ledger.open(":memory:", ["search"], {})
    try:
        with ledger.reader() as con:
            columns = con.execute(
                "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = ?",
                [kind.table],
            ).fetchall()
    finally:
        ledger.close()
    expected = {(f.name, COLUMN_TYPES[f.type].sql) for f in kind.fields}
    # The first schema declared http_status INTEGER; the record only says int.
    got = {(n, "BIGINT" if t == "INTEGER" else t) for n, t in columns if n != "ingested_at"}
    assert got == expected


def test_field_types_and_defaults_come_from_the_dataclass() -> None:
    """Types, nullability and defaults of a kind are read from its record's annotations."""
    assert USAGE.field("first_token_at").type is FieldType.NUMBER
    assert USAGE.field("first_token_at").nullable
    assert USAGE.field("prompt_tokens").type is FieldType.INT
    assert USAGE.field("stream").type is FieldType.BOOL
    assert USAGE.field("endpoint").default == "/v1/chat/completions"
    assert USAGE.field("request_id").required
    assert USAGE.names == tuple(f.name for f in dataclasses.fields(UsageRecord))


def test_a_field_type_with_no_wire_form_is_refused() -> None:
    """A list (no one column type in JSON, Arrow and SQL) cannot be declared."""

    @dataclass(frozen=True, slots=True)
    class Bad(UsageRecord):
        tags: list[str] = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match=r"Bad\.tags"):
        record_kind(
            Bad, key="usage", table="usage", id_field="request_id", time_field="received_at"
        )


def test_a_default_made_by_a_factory_is_refused() -> None:
    """A default must be a value that can be written into the ledger's column definition."""

    @dataclass(frozen=True, slots=True)
    class Factory(UsageRecord):
        region: str = dataclasses.field(default_factory=str)

    with pytest.raises(TypeError, match=r"Factory\.region: a default must be a plain value"):
        record_kind(
            Factory, key="usage", table="usage", id_field="request_id", time_field="received_at"
        )


def test_statuses_in_sql_are_the_declared_ones() -> None:
    """Ingest accepts exactly RequestStatus's values and bills exactly the billable ones."""
    assert set(ingest_sql.STATUSES) == {s.value for s in RequestStatus}
    con = duckdb.connect()
    billable = {
        r[0] for r in con.execute(f"SELECT unnest([{ingest_sql.BILLABLE[1:-1]}])").fetchall()
    }
    assert billable == {s.value for s in BILLABLE_STATUSES}


def test_to_json_is_the_dataclass_fields() -> None:
    """A record's JSON form is its fields by name, and reads back to the same record."""
    record = UsageRecord.from_json(orjson.loads(orjson.dumps(usage())))
    assert record.to_json() == dataclasses.asdict(record)
