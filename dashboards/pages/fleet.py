"""Fleet: latency against the SLA, throughput and errors per model; engines and GPUs per replica."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]
import polars as pl
from dash import Dash, Input, Output, html

from dashboards import reconciliation
from dashboards.client import BillingError
from dashboards.components import frame_table, graph, line_figure, note, page
from dashboards.context import Context, signed_in
from dashboards.data import desired_replicas, fetch_queries, local_times, time_range

PATH = "/"
TITLE = "Fleet"
_FIGURES = ("fleet-ttft", "fleet-tokens", "fleet-requests", "fleet-errors")
_ADMIN_FIGURES = ("fleet-queue", "fleet-kv", "fleet-gpu-util", "fleet-gpu-power")


def layout(ctx: Context) -> html.Div:
    """The fleet page's frame; ``register`` fills it."""
    return page(
        TITLE,
        html.Div(id="fleet-status"),
        html.H3("Replicas"),
        html.Div(id="fleet-replicas"),
        html.Div([graph(f) for f in _FIGURES], className="grid"),
        html.H3("Engines and GPUs"),
        html.Div(id="fleet-admin-note"),
        html.Div([graph(f) for f in _ADMIN_FIGURES], className="grid"),
        html.H3("Tokens: engines against the ledger"),
        html.Div(id="fleet-reconciliation"),
    )


def _ttft_figure(ctx: Context, frame: pl.DataFrame) -> go.Figure:
    title = "TTFT p50 (dotted) and p95, SLA p95 targets dashed"
    if frame.height == 0:
        fig = line_figure(frame, "p95_seconds", "model", title, "seconds")
    else:
        long = frame.unpivot(index=["t", "model"], on=["p50_seconds", "p95_seconds"])
        long = long.with_columns(
            series=pl.col("model") + " " + pl.col("variable").str.replace("_seconds", "")
        )
        dashes = {f"{m.name} p50": "dot" for m in ctx.config.models}
        fig = line_figure(long, "value", "series", title, "seconds", dashes)
    for m in ctx.config.models:
        fig.add_hline(y=m.sla.ttft_p95_seconds, line_dash="dash", annotation_text=f"{m.name} SLA")
    return fig


def _replicas(
    ctx: Context, reporting: pl.DataFrame | None, desired: dict[str, float]
) -> html.Table:
    live = (
        dict(reporting.select("model", "replicas").rows())
        if reporting is not None and reporting.height
        else {}
    )
    rows = []
    for m in ctx.config.models:
        configured = sum(r.model == m.name for r in ctx.config.replicas)
        rows.append({
            "model": m.name, "configured": configured,
            "reporting": str(live.get(m.name, 0)) if reporting is not None else "admin only",
            "desired": f"{desired[m.name]:g}" if m.name in desired else "n/a",
        })  # fmt: skip
    return frame_table(pl.DataFrame(rows), "fleet-replicas-table")


def register(app: Dash, ctx: Context) -> None:
    """The fleet page's callbacks: every figure, refreshed on the interval; the reconciliation."""
    reconciliation.register(app, ctx)
    outputs = [Output("fleet-status", "children"), Output("fleet-replicas", "children"),
               Output("fleet-admin-note", "children")]  # fmt: skip
    outputs += [Output(f, "figure") for f in (*_FIGURES, *_ADMIN_FIGURES)]
    inputs = [
        Input("tick", "n_intervals"),
        Input("range", "value"),
        Input("auth", "data"),
        Input("tz", "data"),
    ]

    @app.callback(*outputs, *inputs)
    def refresh(_: int, choice: str | None, auth: Any, tz: str | None) -> list[Any]:
        empty = [go.Figure()] * (len(_FIGURES) + len(_ADMIN_FIGURES))
        if not signed_in(auth):
            return [note("Sign in to see the fleet."), None, None, *empty]
        token, start, end = auth["token"], *time_range(choice)
        admin = bool(auth.get("is_admin"))
        names = ["ttft", "throughput", "team_usage"] + (
            ["engine", "gpus", "replicas"] if admin else []
        )
        # The scaling signal is scraped while billing answers, not after.
        with ThreadPoolExecutor(max_workers=1) as pool:
            scrape = pool.submit(desired_replicas, ctx.config.dashboard.metrics_urls)
            try:
                frames = fetch_queries(ctx.client, token, names, start, end)
            except BillingError as exc:
                return [note(str(exc), "error"), None, None, *empty]
            desired = scrape.result()
        ttft, thr = local_times(frames["ttft"], tz), local_times(frames["throughput"], tz)
        usage = frames["team_usage"]
        engine = local_times(frames["engine"], tz) if admin else None
        gpus = local_times(frames["gpus"], tz) if admin else None
        reporting = frames.get("replicas")
        requests = int(usage["requests"].sum()) if usage.height else 0
        status = html.P(f"{requests} requests in range", id="fleet-requests-total")
        figures = [
            _ttft_figure(ctx, ttft),
            line_figure(thr, "output_tokens_per_second", "model", "Output tokens/s", "tokens/s"),
            line_figure(thr, "requests_per_second", "model", "Requests/s", "requests/s"),
            line_figure(thr, "error_ratio", "model", "Error rate", "share of requests"),
        ]
        if engine is None or gpus is None:
            admin_note = note(
                "Engine and GPU telemetry spans every team: shown to the admin credential."
            )
            return [
                status,
                _replicas(ctx, None, desired),
                admin_note,
                *figures,
                *empty[: len(_ADMIN_FIGURES)],
            ]
        gpus = gpus.with_columns(
            series=pl.col("replica").replace("", "(no replica)") + " " + pl.col("node")
        )
        figures += [
            line_figure(
                engine, "requests_waiting", "replica", "Queue depth (waiting requests)", "requests"
            ),
            line_figure(engine, "kv_cache_usage", "replica", "KV-cache use", "share"),
            line_figure(gpus, "utilization", "series", "GPU utilization (mean)", "share"),
            line_figure(gpus, "power_watts", "series", "GPU power per GPU (mean)", "watts"),
        ]
        return [status, _replicas(ctx, reporting, desired), None, *figures]
