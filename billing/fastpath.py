"""The fast path of ingest: a whole batch parsed to typed columns at once, or not at all.

Checking each field's JSON type inside DuckDB costs a JSON parse per field per record: a batch
checked that way spends about 9x longer in its transaction than one that arrives as typed
columns (``python -m bench.billing_scale --breakdown``; docs/benchmarks.md). Building typed
columns cannot say *which* record has a wrong type: the parser fails or widens the column
instead. So a batch whose columns come out exactly as the record kind prescribes (every
shipper's batch) is taken as it is, and any other batch goes to the per-record path in
``billing.ingest_sql``, which names the bad records. Nothing is ever coerced here: a mismatch
only means the slower path.

Three bodies have a fast path (formats in ``infermeter.wire``):

- an Arrow IPC stream (what shippers send): typed already, only its schema is checked;
- NDJSON, one record per line: Arrow's JSON reader with the kind's schema, which refuses
  unknown keys and every type mismatch instead of converting, without holding the GIL, so a
  batch parses while another batch's transaction runs;
- a JSON object ``{"<kind>": [records]}``: orjson, then Polars columns.
"""

from __future__ import annotations

from typing import Any

import polars as pl
import pyarrow as pa

from billing.columns import COLUMN_TYPES
from infermeter.errors import BadRequest
from infermeter.records import Field, FieldType, RecordKind
from infermeter.wire import decode_arrow, read_ndjson

__all__ = ["arrow_frame", "ndjson_frame", "typed_frame"]


def ndjson_frame(kind: RecordKind, body: bytes, lines: int | None = None) -> pl.DataFrame | None:
    """An NDJSON batch (of ``lines`` lines, if counted) as typed columns, or None if any deviates."""
    table = read_ndjson(kind, body, lines)
    return None if table is None else _numbered(kind, _polars(table))


def arrow_frame(kind: RecordKind, body: bytes) -> pl.DataFrame:
    """An Arrow IPC batch (``infermeter.wire``) as columns; BadRequest when it is not the kind's."""
    try:
        table = decode_arrow(kind, body)
    except ValueError as exc:  # decode_arrow's way of saying the stream is not the kind's
        raise BadRequest(str(exc), code="invalid_value") from None
    return _numbered(kind, _polars(table))


def typed_frame(kind: RecordKind, rows: list[Any]) -> pl.DataFrame | None:
    """The batch's records as columns of the kind's types, or None if any record deviates.

    Besides the kind's columns: ``pos`` (1-based place in the batch) and ``dup`` (an id seen
    earlier in the batch).
    """
    if not rows or type(rows[0]) is not dict:
        return None
    keys = rows[0].keys()
    fields = {f.name: f for f in kind.fields}
    if not keys <= fields.keys() or not all(type(r) is dict and r.keys() == keys for r in rows):
        return None
    columns = {k: [r[k] for r in rows] for k in keys}
    # Python's bool is an int, and Polars would take True as 1: a boolean in a number field
    # must go to the per-record path to be refused.
    for name, values in columns.items():
        numeric = fields[name].type in (FieldType.INT, FieldType.NUMBER)
        if numeric and any(type(v) is bool for v in values):
            return None
    try:
        records = pl.DataFrame(columns, strict=True)
    except (pl.exceptions.PolarsError, TypeError, ValueError, OverflowError):
        return None
    out = []
    for f in kind.fields:
        if f.name not in records.columns:
            if not f.has_default:
                return None
            out.append(pl.lit(f.default).cast(COLUMN_TYPES[f.type].polars).alias(f.name))
            continue
        series = records[f.name]
        if not _fits(f, series):
            return None
        out.append(pl.col(f.name).cast(COLUMN_TYPES[f.type].polars))
    return _numbered(kind, records.select(out))


def _polars(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _numbered(kind: RecordKind, records: pl.DataFrame) -> pl.DataFrame:
    """``records`` with ``pos`` (1-based place in the batch) and ``dup`` (an id seen earlier)."""
    ident = pl.col(kind.id_field)
    return records.with_row_index("pos", offset=1).with_columns(
        pl.col("pos").cast(pl.Int64), dup=~ident.is_first_distinct()
    )


def _fits(field: Field, series: pl.Series) -> bool:
    if series.dtype == pl.Null:
        return field.nullable
    if not isinstance(series.dtype, COLUMN_TYPES[field.type].polars_exact):
        return False
    return field.nullable or series.null_count() == 0
