"""Small layout pieces shared by the pages: finance tables, graphs, notes and the page frame.

Every table reads the same way: headers in words, money with its currency sign, counts with
thousands separators, numbers right-aligned in tabular figures (a column is numeric when its
kind is, or when any of its cells reads as a number), one notation for a missing value
(``MISSING``), yes/no in words, and a total row where a column adds up. Each cell keeps its
column's name (``data-column``) for screen readers and tests.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl
from dash import dcc, html

from dashboards.figures import empty_figure
from dashboards.formatting import MISSING, Kind, format_cell, kind_of, label, parse_number, usd

__all__ = ["csv_table", "frame_table", "graph", "note", "page", "usd"]

_NUMERIC = {"count", "usd", "percent", "share", "hours", "kwh", "seconds", "gb", "number"}


def note(text: str, kind: str = "info", note_id: str | None = None) -> html.P:
    """A one-line message (``info`` or ``error``) where data would be."""
    if note_id is None:
        return html.P(text, className=f"note note-{kind}")
    return html.P(text, className=f"note note-{kind}", id=note_id)


def page(title: str, *children: Any) -> html.Div:
    """A page's frame: its title and its content."""
    return html.Div([html.H2(title), *children], className="page")


def _column(name: str) -> Any:
    """The ``data-column`` attribute (not a Python identifier, so passed as a mapping)."""
    return {"data-column": name}


def _td(value: Any, column: str, kind: Kind, numeric: bool) -> html.Td:
    return html.Td(
        format_cell(value, kind), className="num" if numeric else None, **_column(column)
    )


def _numeric(
    columns: Sequence[str], kinds: Mapping[str, Kind], rows: Sequence[Mapping[str, Any]]
) -> dict[str, bool]:
    """Which columns are right-aligned: numeric kinds, and any column a number shows in."""
    found = {c: kinds[c] in _NUMERIC for c in columns}
    for c in columns:
        if not found[c]:
            shown = (format_cell(r[c], kinds[c]) for r in rows)
            found[c] = any(t != MISSING and parse_number(t) is not None for t in shown)
    return found


def _head(columns: Sequence[str], numeric: Mapping[str, bool]) -> html.Thead:
    return html.Thead(
        html.Tr(
            [
                html.Th(
                    label(c),
                    className="num" if numeric[c] else None,
                    scope="col",
                    **_column(c),
                )
                for c in columns
            ]
        )
    )


def frame_table(
    frame: pl.DataFrame,
    table_id: str,
    columns: Sequence[str] | None = None,
    *,
    kinds: Mapping[str, Kind] | None = None,
    total: Sequence[str] = (),
    total_values: Mapping[str, Any] | None = None,
    empty: str = "Nothing to show yet.",
    row_id: str | None = None,
) -> html.Div:
    """``frame`` as a finance table; ``total`` names the columns summed in a last row.

    ``total_values`` gives a total that is not a sum (a percentage of the summed budgets). A
    frame without rows is the sentence ``empty`` rather than a table of headers only. With
    ``row_id``, each body row is clickable: its id is ``{"type": row_id, "index": i}``.
    """
    if frame.height == 0:
        return html.Div(note(empty), id=table_id, className="table-wrap")
    columns = list(columns or frame.columns)
    kind = {c: (kinds or {}).get(c) or kind_of(c) for c in columns}
    rows = list(frame.select(columns).iter_rows(named=True))
    numeric = _numeric(columns, kind, rows)

    def tr(i: int, row: Mapping[str, Any]) -> html.Tr:
        cells = [_td(row[c], c, kind[c], numeric[c]) for c in columns]
        if row_id is None:
            return html.Tr(cells)
        return html.Tr(
            cells,
            id={"type": row_id, "index": i},
            n_clicks=0,
            className="clickable",
            title="Click to drill into this row",
        )

    parts: list[Any] = [_head(columns, numeric), html.Tbody([tr(i, r) for i, r in enumerate(rows)])]
    if (total or total_values) and frame.height > 1:  # one row is its own total
        sums = {c: frame[c].sum() for c in total} | dict(total_values or {})
        cells = [
            _td(sums[c], c, kind[c], numeric[c])
            if c in sums
            else html.Td("Total" if i == 0 else "", **_column(c))
            for i, c in enumerate(columns)
        ]
        parts.append(html.Tfoot(html.Tr(cells, className="total")))
    return html.Div(html.Table(parts, id=table_id, className="frame-table"), className="table-wrap")


def csv_table(
    text: str,
    table_id: str,
    hidden: Sequence[str] = (),
    empty: str = "No charges for this month yet.",
) -> html.Div:
    """Billing's CSV as a finance table: its rows as the file has them, formatted for reading.

    The file's own total row (``line_type`` = ``total``) becomes the table's footer. An empty
    cell in a numeric column is missing (``MISSING``).
    """
    header, *rows = list(csv.reader(io.StringIO(text)))
    columns = [c for c in header if c not in hidden]
    kind = {c: kind_of(c) for c in columns}
    kind["line_type"] = "text"
    numeric = {c: kind[c] != "text" for c in columns}

    def cells(row: list[str]) -> list[html.Td]:
        values = dict(zip(header, row, strict=True))
        out = []
        for c in columns:
            raw = values[c]
            # A numeric cell shows its number, or MISSING when the file has none.
            shown = raw if kind[c] == "text" else _number(raw)
            out.append(_td(raw if shown is None and raw != "" else shown, c, kind[c], numeric[c]))
        return out

    body = [r for r in rows if dict(zip(header, r, strict=True)).get("line_type") != "total"]
    totals = [r for r in rows if dict(zip(header, r, strict=True)).get("line_type") == "total"]
    if not body:
        return html.Div(note(empty), id=table_id, className="table-wrap")
    parts: list[Any] = [_head(columns, numeric), html.Tbody([html.Tr(cells(r)) for r in body])]
    if totals:
        foot = cells(totals[0])
        foot[0] = html.Td("Total", **_column(columns[0]))
        if "line_type" in columns:  # "total" would only repeat the row's label
            at = columns.index("line_type")
            foot[at] = html.Td("", **_column("line_type"))
        parts.append(html.Tfoot(html.Tr(foot, className="total")))
    return html.Div(html.Table(parts, id=table_id, className="frame-table"), className="table-wrap")


def _number(text: str) -> float | int | None:
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None


def graph(figure_id: str) -> dcc.Graph:
    """A graph that a callback fills; its toolbar shows only while the pointer is over it."""
    return dcc.Graph(
        id=figure_id,
        config={"displaylogo": False, "displayModeBar": "hover"},
        figure=empty_figure("", "Loading..."),
    )
