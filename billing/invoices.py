"""A cloud invoice in FinOps FOCUS form, read and summed per month and node pool (no ledger, no HTTP).

Finance checks the chargeback against what the cloud provider billed. Its billing export (FOCUS
1.0 to 1.3, CSV or Parquet) lists line items; each one a node pool claims (``NodePool``:
its ``ResourceId`` is one of the pool's ``resource_ids``, or its ``Tags`` hold every pair of the
pool's ``invoice_tags``; the first pool in the configuration's order that claims it) adds its
``BilledCost`` to that pool's month. What counts:

- ``Usage`` and ``Purchase`` (commitments and reservations bought) count; ``Credit`` and
  ``Adjustment`` count with their sign (FOCUS gives credits and refunds negative), so they
  reduce the total; ``Tax`` is left out unless asked for (``include_tax``), since the price
  book's rates are before tax. ``BilledCost`` is what was invoiced: usage a commitment covers
  is billed 0 there and its purchase is the charge, so nothing is counted twice.
- The month is the UTC month of ``ChargePeriodStart`` (a correction of an earlier month lands on
  that month). An item whose charge period crosses into another month is split by the period's
  seconds in each month, exactly: in units of the item's own last decimal place (a cent when it
  has two places), by largest remainder (ties to the earlier month), so the parts add up to
  the item.
- Sums are exact (``Decimal``, never a float) and rounded to whole cents once, at the end, half
  to even, per (month, pool); the items no pool claims are summed the same way and reported.

A file is read whole before anything is returned: a malformed one is an ``InvoiceError`` naming
the file, the row (1-based, the header not counted) and the column, so nothing of it is half
imported. A currency other than USD is refused (the price book is in USD).
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import (
    ROUND_HALF_EVEN,
    Context,
    Decimal,
    Inexact,
    InvalidOperation,
    Overflow,
    localcontext,
)
from pathlib import Path
from typing import Any, Final, Literal

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from infermeter.config import NodePool
from infermeter.errors import BadRequest

__all__ = [
    "MAX_BYTES",
    "MAX_ROWS",
    "Format",
    "Invoice",
    "InvoiceError",
    "PoolMonth",
    "Summary",
    "format_for",
    "parse_invoice",
    "read_invoice",
]

Format = Literal["csv", "parquet"]
# The largest file read and the most line items in it, by default: a month of a large fleet's
# line items fits several times over; past it the file is refused rather than read into memory.
MAX_BYTES: Final = 256 << 20
MAX_ROWS: Final = 2_000_000
# The columns read, by their FOCUS names; every other column is ignored.
REQUIRED: Final = (
    "BilledCost",
    "BillingCurrency",
    "ChargeCategory",
    "ChargePeriodStart",
    "ChargePeriodEnd",
)
OPTIONAL: Final = ("ResourceId", "Tags", "ServiceCategory")
# Names the same columns had before FOCUS 1.0 (0.5 and the 1.0 preview). A file that has both
# names is read by the FOCUS 1.0 one. Names are matched without regard to case.
_OLD_NAMES: Final = {
    "billedcurrency": "BillingCurrency",
    "chargetype": "ChargeCategory",
    "resourceid": "ResourceId",
}
# The most service categories a summary lists.
_SERVICES: Final = 30
_COUNTED: Final = frozenset({"Usage", "Purchase", "Credit", "Adjustment"})
_CATEGORIES: Final = {c.lower(): c for c in (*_COUNTED, "Tax")}
# Exact: a sum that would need rounding raises instead (no invoice comes near 100 digits).
_EXACT: Final = Context(prec=100, traps=[Inexact, InvalidOperation, Overflow])
# The same, for the one step that rounds on purpose (to whole cents).
_ROUNDING: Final = Context(prec=100, traps=[InvalidOperation, Overflow])
# Bounds on one line item's cost, so that every sum stays exact within ``_EXACT``.
_MAX_COST: Final = Decimal(10) ** 15
_MAX_PLACES: Final = 20
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO: Final = timedelta(microseconds=1)


class InvoiceError(BadRequest):
    """A file that cannot be imported: the message names the file and, for a bad value, the row and column."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_invoice")


@dataclass(frozen=True, slots=True)
class PoolMonth:
    """What a pool was billed for a month: whole cents, from ``line_items`` items (or parts of them)."""

    month: str
    pool: str
    billed_cents: int
    line_items: int


@dataclass(frozen=True, slots=True)
class Summary:
    """Items left out of the pools' totals (unclaimed, or tax), their cost in whole cents."""

    line_items: int
    billed_cents: int
    # The same, per ServiceCategory ("" when the file has none), largest cost first; at most
    # ``_SERVICES`` of them (FOCUS names about 20 categories; a file may write anything there).
    by_service: tuple[tuple[str, int, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The summary in an API answer."""
        return {
            "line_items": self.line_items,
            "billed_cents": self.billed_cents,
            "by_service_category": [
                {"service_category": s, "line_items": n, "billed_cents": c}
                for s, n, c in self.by_service
            ],
        }


@dataclass(frozen=True, slots=True)
class Invoice:
    """One file's totals per (month, pool), sorted, and what no pool claimed."""

    source: str
    sha256: str
    rows: int
    totals: tuple[PoolMonth, ...]
    unmatched: Summary
    # Tax, when it is not counted.
    excluded: Summary

    def to_json(self) -> dict[str, Any]:
        """The import's answer: totals, unmatched and excluded items."""
        return {
            "source": self.source,
            "sha256": self.sha256,
            "rows": self.rows,
            "totals": [
                {
                    "month": t.month,
                    "pool": t.pool,
                    "billed_cents": t.billed_cents,
                    "line_items": t.line_items,
                }
                for t in self.totals
            ],
            "unmatched": self.unmatched.to_json(),
            "excluded": self.excluded.to_json(),
        }


def format_for(name: str, explicit: str | None = None) -> Format:
    """The file's format: ``explicit`` when given, else by the name's suffix (.csv, .parquet)."""
    found = explicit or {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}.get(
        Path(name).suffix.lower()
    )
    if found == "csv":
        return "csv"
    if found == "parquet":
        return "parquet"
    raise InvoiceError(
        f"{name}: cannot tell the format from the name; say csv or parquet (--format)"
    )


def read_invoice(
    path: str | Path,
    pools: Sequence[NodePool],
    fmt: str | None = None,
    *,
    max_bytes: int = MAX_BYTES,
    max_rows: int = MAX_ROWS,
    include_tax: bool = False,
) -> Invoice:
    """The invoice in the file at ``path``; its size is checked before it is read."""
    source = str(path)
    try:
        size = Path(path).stat().st_size
        if size > max_bytes:
            raise InvoiceError(f"{source}: {size} bytes, over the limit of {max_bytes}")
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvoiceError(f"{source}: cannot read it: {exc.strerror or exc}") from None
    return parse_invoice(
        data,
        source,
        pools,
        format_for(source, fmt),
        max_bytes=max_bytes,
        max_rows=max_rows,
        include_tax=include_tax,
    )


def parse_invoice(
    data: bytes,
    source: str,
    pools: Sequence[NodePool],
    fmt: Format,
    *,
    max_bytes: int = MAX_BYTES,
    max_rows: int = MAX_ROWS,
    include_tax: bool = False,
) -> Invoice:
    """The invoice ``data`` holds (``source`` names it in errors and in the ledger)."""
    if len(data) > max_bytes:
        raise InvoiceError(f"{source}: {len(data)} bytes, over the limit of {max_bytes}")
    frame = _frame(data, source, fmt, max_rows)
    sums = _Sums(pools, include_tax)
    for item in _items(frame, source):
        sums.add(item)
    totals = sums.totals()
    for total in totals:
        if total.billed_cents < 0:
            # An imported file replaces its pools' months whole: a credit-only file would stand
            # for the month's invoice, and a negative invoice would scale every team's cost
            # below zero.
            raise InvoiceError(
                f"{source}: node pool {total.pool}'s total for {total.month} is "
                f"{total.billed_cents / 100:.2f} USD, below zero: import a credit in the file of the "
                "invoice it reduces (a file replaces its pools' months whole)"
            )
    return Invoice(
        source=source,
        sha256=hashlib.sha256(data).hexdigest(),
        rows=frame.height,
        totals=totals,
        unmatched=_summary(sums.unmatched),
        excluded=_summary(sums.excluded),
    )


# -- reading ----------------------------------------------------------------------------------


def _frame(data: bytes, source: str, fmt: Format, max_rows: int) -> pl.DataFrame:
    """The file's columns we read, under their FOCUS 1.0 names (optional ones may be absent)."""
    frame = _csv(data, source) if fmt == "csv" else _parquet(data, source, max_rows)
    if frame.height > max_rows:
        raise InvoiceError(f"{source}: {frame.height} line items, over the limit of {max_rows}")
    names = _columns(frame.columns)
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise InvoiceError(
            f"{source}: no column {', '.join(missing)} (not a FOCUS file, or not FOCUS 1.0 or later)"
        )
    return frame.select([pl.col(original).alias(name) for name, original in names.items()])


def _csv(data: bytes, source: str) -> pl.DataFrame:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvoiceError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    try:
        # Every column as text: amounts are read as exact decimals here, not guessed as floats.
        return pl.read_csv(io.StringIO(text), infer_schema=False)
    except (pl.exceptions.PolarsError, ValueError) as exc:
        raise InvoiceError(
            f"{source}: {_ragged_row(text) or 'not a CSV file polars can read'}: {_first_line(exc)}"
        ) from None


def _ragged_row(text: str) -> str | None:
    """Where a CSV file polars refused has a row of the wrong width ("row 3: 22 fields, the
    header 21"), read again by the standard library to name it; None if none is."""
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, [])
        for row, fields in enumerate(reader, start=1):
            if fields and len(fields) != len(header):
                return f"row {row}: {len(fields)} fields, the header {len(header)}"
    except csv.Error as exc:
        # What the standard library cannot read either (a field past its size limit, a quote
        # left open before a NUL): said as it says it, for the refusal.
        return f"line {reader.line_num}: {exc}"
    return None


def _parquet(data: bytes, source: str, max_rows: int) -> pl.DataFrame:
    try:
        # The row count is in the footer: a file over the limit is refused before it is decoded.
        rows = pq.ParquetFile(io.BytesIO(data)).metadata.num_rows
        if rows > max_rows:
            raise InvoiceError(f"{source}: {rows} line items, over the limit of {max_rows}")
        return pl.read_parquet(io.BytesIO(data))
    except (pa.ArrowException, OSError, ValueError, pl.exceptions.PolarsError) as exc:
        raise InvoiceError(f"{source}: not a Parquet file: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _columns(columns: Sequence[str]) -> dict[str, str]:
    """Our name -> the file's, for the columns we read: by the FOCUS name, else an older one."""
    wanted = {c.lower(): c for c in (*REQUIRED, *OPTIONAL)}
    found: dict[str, str] = {}
    for original in columns:
        name = wanted.get(original.strip().lower())
        if name is not None:
            found.setdefault(name, original)
    for original in columns:
        name = _OLD_NAMES.get(original.strip().lower())
        if name is not None and name not in found:
            found[name] = original
    return found


@dataclass(frozen=True, slots=True)
class _Item:
    cost: Decimal
    category: str
    start_us: int
    end_us: int
    resource_id: str | None
    tags: Mapping[str, str]
    service: str


def _items(frame: pl.DataFrame, source: str) -> Iterator[_Item]:
    """Each row as an item; InvoiceError naming the row and column of the first bad value."""
    for row, values in enumerate(frame.iter_rows(named=True), start=1):
        cell = _Cell(source, row)
        currency = cell.text("BillingCurrency", values["BillingCurrency"])
        if currency != "USD":
            raise InvoiceError(
                f"{source}: row {row}, column BillingCurrency: {currency!r}; only USD invoices "
                "can be compared with the price book, which is in USD"
            )
        start = cell.time("ChargePeriodStart", values["ChargePeriodStart"])
        end = cell.time("ChargePeriodEnd", values["ChargePeriodEnd"])
        if end < start:
            raise cell.bad(
                "ChargePeriodEnd", values["ChargePeriodEnd"], "is before ChargePeriodStart"
            )
        rid = values.get("ResourceId")
        yield _Item(
            cost=cell.cost(values["BilledCost"]),
            category=cell.category(values["ChargeCategory"]),
            start_us=start,
            end_us=end,
            resource_id=str(rid).strip() or None if rid is not None else None,
            tags=cell.tags(values.get("Tags")),
            service=str(values.get("ServiceCategory") or ""),
        )


@dataclass(frozen=True, slots=True)
class _Cell:
    """Reads one row's values, each error naming the file, row and column."""

    source: str
    row: int

    def bad(self, column: str, value: Any, why: str) -> InvoiceError:
        shown = (
            repr(value)
            if not isinstance(value, str) or len(value) <= 80
            else repr(value[:80]) + "..."
        )
        return InvoiceError(f"{self.source}: row {self.row}, column {column}: {shown} {why}")

    def text(self, column: str, value: Any) -> str:
        if value is None or not str(value).strip():
            raise self.bad(column, value, "is empty")
        return str(value).strip()

    def cost(self, value: Any) -> Decimal:
        if isinstance(value, Decimal | int):
            found = Decimal(value)
        elif isinstance(value, float):
            found = Decimal(repr(value))  # the shortest text that reads back as the float
        else:
            try:
                found = Decimal(self.text("BilledCost", value))
            except InvalidOperation:
                raise self.bad("BilledCost", value, "is not a decimal number") from None
        if not found.is_finite() or abs(found) >= _MAX_COST:
            raise self.bad("BilledCost", value, f"is not a finite number under {_MAX_COST:,}")
        if int(found.as_tuple().exponent) < -_MAX_PLACES:
            raise self.bad("BilledCost", value, f"has more than {_MAX_PLACES} decimal places")
        return found

    def category(self, value: Any) -> str:
        found = _CATEGORIES.get(self.text("ChargeCategory", value).lower())
        if found is None:
            raise self.bad(
                "ChargeCategory",
                value,
                "is not a FOCUS charge category (Usage, Purchase, Credit, Adjustment, Tax)",
            )
        return found

    def time(self, column: str, value: Any) -> int:
        """Microseconds since the epoch; a time without a zone is UTC, as FOCUS requires."""
        if isinstance(value, datetime):
            moment = value
        else:
            try:
                moment = datetime.fromisoformat(self.text(column, value))
            except ValueError:
                raise self.bad(column, value, "is not an ISO 8601 date-time") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return (moment - _EPOCH) // _MICRO

    def tags(self, value: Any) -> dict[str, str]:
        """Tags as a JSON object in text (CSV), a struct, or a map (key/value pairs)."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return {}
        found = value
        if isinstance(value, str):
            try:
                found = orjson.loads(value)
            except orjson.JSONDecodeError:
                raise self.bad("Tags", value, "is not JSON") from None
        if isinstance(found, list) and all(isinstance(p, dict) and "key" in p for p in found):
            found = {p["key"]: p.get("value") for p in found}
        if not isinstance(found, dict):
            raise self.bad("Tags", value, "is not a JSON object")
        return {str(k): _tag_text(v) for k, v in found.items() if v is not None}


def _tag_text(value: Any) -> str:
    """A tag's value as text: a string as it is, anything else as its JSON (true, 3)."""
    return value if isinstance(value, str) else orjson.dumps(value).decode()


# -- summing ----------------------------------------------------------------------------------


class _Sums:
    """Exact sums per (month, pool), and of the items left out."""

    def __init__(self, pools: Sequence[NodePool], include_tax: bool) -> None:
        self._pools = [
            (p.name, frozenset(p.resource_ids), tuple(p.invoice_tags.items())) for p in pools
        ]
        self._include_tax = include_tax
        self._sums: dict[tuple[str, str], Decimal] = {}
        self._items: dict[tuple[str, str], int] = {}
        self.unmatched: dict[str, tuple[int, Decimal]] = {}
        self.excluded: dict[str, tuple[int, Decimal]] = {}

    def add(self, item: _Item) -> None:
        if item.category == "Tax" and not self._include_tax:
            _tally(self.excluded, item.service, item.cost)
            return
        pool = self._pool(item)
        if pool is None:
            _tally(self.unmatched, item.service, item.cost)
            return
        with localcontext(_EXACT):
            for month, part in split_by_month(item.cost, item.start_us, item.end_us):
                key = (month, pool)
                self._sums[key] = self._sums.get(key, Decimal(0)) + part
                self._items[key] = self._items.get(key, 0) + 1

    def _pool(self, item: _Item) -> str | None:
        """The first pool claiming ``item``: by its resource id, or by all of the pool's tags."""
        for name, ids, tags in self._pools:
            if item.resource_id is not None and item.resource_id in ids:
                return name
            if tags and all(item.tags.get(k) == v for k, v in tags):
                return name
        return None

    def totals(self) -> tuple[PoolMonth, ...]:
        return tuple(
            PoolMonth(month, pool, cents(total), self._items[(month, pool)])
            for (month, pool), total in sorted(self._sums.items())
        )


def _tally(into: dict[str, tuple[int, Decimal]], service: str, cost: Decimal) -> None:
    n, total = into.get(service, (0, Decimal(0)))
    with localcontext(_EXACT):
        into[service] = (n + 1, total + cost)


def _summary(groups: Mapping[str, tuple[int, Decimal]]) -> Summary:
    with localcontext(_EXACT):
        total = sum((t for _, t in groups.values()), Decimal(0))
    by_service = sorted(
        ((s, n, cents(t)) for s, (n, t) in groups.items()), key=lambda g: (-abs(g[2]), g[0])
    )
    return Summary(sum(n for n, _ in groups.values()), cents(total), tuple(by_service[:_SERVICES]))


def cents(usd: Decimal) -> int:
    """``usd`` in whole cents, half to even (the one rounding of a sum)."""
    with localcontext(_ROUNDING):
        return int((usd * 100).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))


def split_by_month(cost: Decimal, start_us: int, end_us: int) -> list[tuple[str, Decimal]]:
    """``cost`` per UTC month of the period ``start_us``..``end_us`` (microseconds), by its time in each.

    Exact: in units of the cost's last decimal place (at least cents), by largest remainder, ties
    to the earlier month, so the parts add up to ``cost``. A period within one month (or empty)
    is all that month's.
    """
    spans = list(_month_spans(start_us, end_us))
    if len(spans) == 1:
        return [(spans[0][0], cost)]
    exponent = min(int(cost.as_tuple().exponent), -2)
    unit = Decimal(1).scaleb(exponent)
    with localcontext(_EXACT):
        units = int(cost.scaleb(-exponent))
    whole = end_us - start_us
    sign, units = (-1 if units < 0 else 1), abs(units)
    floors = [units * span // whole for _, span in spans]
    remainders = [units * span % whole for _, span in spans]
    order = sorted(range(len(spans)), key=lambda i: (-remainders[i], i))
    for i in order[: units - sum(floors)]:
        floors[i] += 1
    with localcontext(_EXACT):
        return [(month, sign * n * unit) for (month, _), n in zip(spans, floors, strict=True)]


def _month_spans(start_us: int, end_us: int) -> Iterator[tuple[str, int]]:
    """(month, microseconds of the period in it), for each UTC month the period touches."""
    moment = _EPOCH + start_us * _MICRO
    month_start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    if end_us <= start_us:
        yield month_start.strftime("%Y-%m"), 0
        return
    at = start_us
    while at < end_us:
        following = (month_start + timedelta(days=32)).replace(day=1)
        edge = min(end_us, (following - _EPOCH) // _MICRO)
        yield month_start.strftime("%Y-%m"), edge - at
        at, month_start = edge, following
