"""How a record field (``infermeter.records.FieldType``) is held in the ledger and checked at ingest.

One table, so that the SQL column type, the JSON types a value may arrive as, and the Polars
column types of the fast path cannot drift apart; the Arrow wire types are the shipper's side of
the same mapping (``infermeter.wire``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import polars as pl

from infermeter.records import Field, FieldType

__all__ = ["COLUMN_TYPES", "ColumnType", "column_ddl", "sql_default"]


@dataclass(frozen=True, slots=True)
class ColumnType:
    """A field type in the ledger: its SQL type, DuckDB's JSON type names, and Polars types."""

    sql: str
    json: tuple[str, ...]  # what json_type() may say of a value of this type
    polars: type[pl.DataType]  # the column type the fast path casts to
    polars_exact: tuple[type[pl.DataType], ...]  # column types taken as they are, never coerced
    noun: str  # for the reason a record is rejected: "must be <noun>"


COLUMN_TYPES: Final[Mapping[FieldType, ColumnType]] = {
    FieldType.STRING: ColumnType("VARCHAR", ("VARCHAR",), pl.String, (pl.String,), "a string"),
    FieldType.INT: ColumnType("BIGINT", ("UBIGINT", "BIGINT"), pl.Int64, (pl.Int64,), "an integer"),
    FieldType.NUMBER: ColumnType(
        "DOUBLE", ("UBIGINT", "BIGINT", "DOUBLE"), pl.Float64, (pl.Float64, pl.Int64), "a number"
    ),
    FieldType.BOOL: ColumnType("BOOLEAN", ("BOOLEAN",), pl.Boolean, (pl.Boolean,), "a boolean"),
}


def sql_default(field: Field) -> str:
    """The field's default as an SQL literal (the Python value declared on the record)."""
    value = field.default
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return "'" + value.replace("'", "''") + "'"


def column_ddl(field: Field) -> str:
    """The column definition of ``field`` in its ledger table, with its default if it has one."""
    ddl = f'"{field.name}" {COLUMN_TYPES[field.type].sql}'
    if not field.nullable:
        ddl += " NOT NULL"
    if field.has_default:
        ddl += f" DEFAULT {sql_default(field)}"
    return ddl
