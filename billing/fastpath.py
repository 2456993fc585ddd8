"""The fast path of ingest: a whole batch parsed to typed columns at once, or not at all.

Checking each field's JSON type inside DuckDB costs a JSON parse per field per record: a batch
checked that way spends about 5x longer in its transaction than one that arrives as typed
columns (``python -m bench.billing_scale --breakdown``; docs/benchmarks.md). Building typed
columns cannot say *which* record has a wrong type: the parser fails or widens the column
instead. So a batch whose columns come out exactly as the record kind prescribes (every
shipper's batch) is taken as it is, and any other batch goes to the per-record path in
``billing.ingest_sql``, which names the bad records. Nothing is ever coerced here: a mismatch
only means the slower path.

Two bodies have a fast path:

- NDJSON, one record per line (what shippers send): Arrow's JSON reader with the kind's schema
  as an explicit one. It refuses unknown keys and every type mismatch (a string or boolean
  for a number, a fraction for an integer) instead of converting, and it parses in C++ threads
  without holding the GIL, so a batch parses while another batch's transaction runs.
- A JSON object ``{"<kind>": [records]}``: orjson, then Polars columns.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Final

import polars as pl
import pyarrow as pa
import pyarrow.json as pa_json

from billing.ingest_sql import Field, Kind

__all__ = ["line_count", "ndjson_frame", "typed_frame"]

_EXACT: Final[dict[str, tuple[type[pl.DataType], ...]]] = {
    "string": (pl.String,),
    "int": (pl.Int64,),
    "number": (pl.Float64, pl.Int64),
    "bool": (pl.Boolean,),
}
_TARGET: Final[dict[str, type[pl.DataType]]] = {
    "string": pl.String, "int": pl.Int64, "number": pl.Float64, "bool": pl.Boolean,
}  # fmt: skip
_ARROW: Final = {
    "string": pa.string(),
    "int": pa.int64(),
    "number": pa.float64(),
    "bool": pa.bool_(),
}


def line_count(body: bytes) -> int:
    """Records in an NDJSON body: its lines, the last one with or without a newline."""
    if not body:
        return 0
    return body.count(b"\n") + (0 if body.endswith(b"\n") else 1)


# One thread per batch: concurrent requests already keep both cores busy, and Arrow's own
# threads cost about 30% more CPU for the same batch (bench.billing_scale --breakdown).
_READ: Final = pa_json.ReadOptions(use_threads=False, block_size=4 << 20)


@cache
def _parse_options(kind: Kind) -> pa_json.ParseOptions:
    schema = pa.schema([pa.field(f.name, _ARROW[f.type]) for f in kind.fields])
    return pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")


def ndjson_frame(kind: Kind, body: bytes) -> pl.DataFrame | None:
    """An NDJSON batch as columns of the kind's types, or None if any record deviates.

    None also when the records are not exactly one per line (Arrow's reader would take an
    object spread over lines, or two on one line, and skips blank lines: those go to the
    per-record path, which refuses them by line), and when a field that may not be null is
    null or absent in any record: the per-record path tells "missing" from "null" and fills
    defaults for absent fields only.
    """
    lines = line_count(body)
    if not lines:
        return None
    try:
        table = pa_json.read_json(
            pa.py_buffer(body), read_options=_READ, parse_options=_parse_options(kind)
        )
    except (pa.ArrowException, ValueError):
        return None
    if table.num_rows != lines:
        return None
    records = pl.from_arrow(table)
    assert isinstance(records, pl.DataFrame)
    if any(not f.nullable and records[f.name].null_count() for f in kind.fields):
        return None
    return _numbered(kind, records)


def typed_frame(kind: Kind, rows: list[Any]) -> pl.DataFrame | None:
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
        if fields[name].type in ("int", "number") and any(type(v) is bool for v in values):
            return None
    try:
        records = pl.DataFrame(columns, strict=True)
    except (pl.exceptions.PolarsError, TypeError, ValueError, OverflowError):
        return None
    out = []
    for f in kind.fields:
        if f.name not in records.columns:
            if f.default is None:
                return None
            out.append(
                pl.lit(None if f.default == "NULL" else _literal(f))
                .cast(_TARGET[f.type])
                .alias(f.name)
            )
            continue
        series = records[f.name]
        if not _fits(f, series):
            return None
        out.append(pl.col(f.name).cast(_TARGET[f.type]))
    return _numbered(kind, records.select(out))


def _numbered(kind: Kind, records: pl.DataFrame) -> pl.DataFrame:
    """``records`` with ``pos`` (1-based place in the batch) and ``dup`` (an id seen earlier)."""
    ident = pl.col(kind.id_field)
    return records.with_row_index("pos", offset=1).with_columns(
        pl.col("pos").cast(pl.Int64), dup=~ident.is_first_distinct()
    )


def _fits(field: Field, series: pl.Series) -> bool:
    if series.dtype == pl.Null:
        return field.nullable
    if not isinstance(series.dtype, _EXACT[field.type]):
        return False
    return field.nullable or series.null_count() == 0


def _literal(field: Field) -> object:
    value = field.default
    assert value is not None
    if field.type == "bool":
        return value == "true"
    if field.type in ("int", "number"):
        return float(value) if field.type == "number" else int(value)
    return value.strip("'")
