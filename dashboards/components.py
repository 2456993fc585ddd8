"""Small layout pieces shared by the pages: tables from frames, line charts, notes."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]
import polars as pl
from dash import dcc, html

__all__ = ["csv_table", "frame_table", "graph", "line_figure", "note", "page", "usd"]


def usd(value: float | None) -> str:
    """Money as the tables show it."""
    return "-" if value is None else f"${value:,.2f}"


def note(text: str, kind: str = "info") -> html.P:
    """A one-line message (``info`` or ``error``) where data would be."""
    return html.P(text, className=f"note note-{kind}")


def page(title: str, *children: Any) -> html.Div:
    """A page's frame: its title and its content."""
    return html.Div([html.H2(title), *children], className="page")


def _column(name: str) -> Any:
    """The ``data-column`` attribute (not a Python identifier, so passed as a mapping)."""
    return {"data-column": name}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.4f}".rstrip("0").rstrip(".") if abs(value) >= 1e-4 else f"{value:.3g}"
    return str(value)


def csv_table(text: str, table_id: str) -> html.Table:
    """CSV text as an HTML table, cell for cell as the file has it."""
    header, *rows = list(csv.reader(io.StringIO(text)))
    head = html.Thead(html.Tr([html.Th(c) for c in header]))
    body = html.Tbody([
        html.Tr([html.Td(v, **_column(c)) for c, v in zip(header, row, strict=True)])
        for row in rows
    ])  # fmt: skip
    return html.Table([head, body], id=table_id, className="frame-table")


def frame_table(
    frame: pl.DataFrame, table_id: str, columns: Sequence[str] | None = None
) -> html.Table:
    """``frame`` as an HTML table; every cell carries its column name for readers and tests."""
    columns = list(columns or frame.columns)
    head = html.Thead(html.Tr([html.Th(c) for c in columns]))
    body = html.Tbody([
        html.Tr([html.Td(_cell(row[c]), **_column(c)) for c in columns])
        for row in frame.select(columns).iter_rows(named=True)
    ])  # fmt: skip
    return html.Table([head, body], id=table_id, className="frame-table")


def line_figure(frame: pl.DataFrame, y: str, series: str, title: str, y_title: str,
                dash_by: dict[str, str] | None = None) -> go.Figure:  # fmt: skip
    """One line per value of ``series`` over ``t`` (already in the viewer's time zone)."""
    fig = go.Figure()
    if frame.height:
        for key, part in frame.sort(series, "t").group_by(series, maintain_order=True):
            name = str(key[0])
            fig.add_trace(go.Scatter(x=part["t"].to_list(), y=part[y].to_list(), mode="lines",
                                     name=name, line={"dash": (dash_by or {}).get(name, "solid")}))  # fmt: skip
    fig.update_layout(title=title, yaxis_title=y_title, height=300, margin={"l": 50, "r": 10, "t": 40, "b": 30},
                      legend={"orientation": "h"}, uirevision=title)  # fmt: skip
    return fig


def graph(figure_id: str) -> dcc.Graph:
    """An empty graph that a callback fills."""
    return dcc.Graph(id=figure_id, config={"displaylogo": False}, figure=go.Figure())
