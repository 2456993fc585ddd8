"""Fleet: latency against the SLA, throughput and errors per model; engines and GPUs per replica.

Fleet-wide telemetry (engines, GPUs) spans every team, so billing answers it to the admin only;
a team sees its own charts and a sentence in place of the fleet's, never empty plots.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]
import polars as pl
from dash import Dash, Input, Output, html

from dashboards import reconciliation
from dashboards.client import Answer, BillingError
from dashboards.components import frame_table, graph, note, page
from dashboards.context import Context, signed_in
from dashboards.data import desired_replicas, fetch_answers, local_range, local_times, time_range
from dashboards.figures import colours_for, complete_buckets, empty_figure, line_figure

PATH = "/"
TITLE = "Fleet"
_FIGURES = ("fleet-ttft", "fleet-tokens", "fleet-requests", "fleet-errors")
_ADMIN_FIGURES = ("fleet-queue", "fleet-kv", "fleet-gpu-util", "fleet-gpu-power")
_HIDDEN = {"display": "none"}


def layout(ctx: Context) -> html.Div:
    """The fleet page's frame; ``register`` fills it."""
    return page(
        TITLE,
        html.Div(id="fleet-status"),
        html.H3("Replicas"),
        html.Div(id="fleet-replicas"),
        html.H3("Requests by model"),
        html.Div([graph(f) for f in _FIGURES], className="grid"),
        html.H3("Engines and GPUs"),
        html.Div(id="fleet-admin-note"),
        html.Div([graph(f) for f in _ADMIN_FIGURES], className="grid", id="fleet-admin-figures"),
        html.H3("Tokens: engines against the ledger"),
        html.Div(id="fleet-reconciliation"),
    )


def _series(answer: Answer, end: float, tz: str | None) -> pl.DataFrame:
    """Complete buckets only, in the viewer's zone."""
    return local_times(complete_buckets(answer.frame, answer.step, end), tz)


def _ttft_figure(
    ctx: Context, frame: pl.DataFrame, x_range: Any, colours: dict[str, str]
) -> go.Figure:
    title = "Time to first token"
    subtitle = "p95 solid, p50 dotted; SLA p95 target dashed"
    if frame.height == 0:
        return empty_figure(title, "No requests in this range.")
    long = frame.unpivot(index=["t", "model"], on=["p50_seconds", "p95_seconds"]).with_columns(
        series=pl.col("model") + " " + pl.col("variable").str.replace("_seconds", "")
    )
    series = long["series"].unique().to_list()
    owner = {s: s.rsplit(" ", 1)[0] for s in series}
    dashes = {s: "dot" for s in series if s.endswith(" p50")}
    fig = line_figure(long, "value", "series", title, "seconds", x_range, colours=colours,
                      colour_of=owner, dash_by=dashes, subtitle=subtitle)  # fmt: skip
    shown = set(frame["model"].to_list())
    for m in ctx.config.models:
        if m.name in shown:
            fig.add_hline(y=m.sla.ttft_p95_seconds, line_dash="dash", line_width=1,
                          line_color=colours.get(m.name), annotation_text=f"{m.name} target",
                          annotation_position="top left")  # fmt: skip
    return fig


def _replicas(ctx: Context, reporting: pl.DataFrame | None, desired: dict[str, float]) -> html.Div:
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
    kinds = {"reporting": "text", "desired": "text"}
    return frame_table(pl.DataFrame(rows), "fleet-replicas-table", kinds=kinds)  # type: ignore[arg-type]


def _admin_figures(engine: pl.DataFrame, gpus: pl.DataFrame, x_range: Any) -> list[go.Figure]:
    if gpus.height:
        gpus = gpus.with_columns(
            series=pl.col("replica").cast(pl.String).fill_null("").replace("", "(no replica)")
            + " "
            + pl.col("node").cast(pl.String)
        )
    no_engine = "No engine samples in this range."
    no_gpu = "No GPU samples in this range."
    return [
        line_figure(engine, "requests_waiting", "replica", "Queue depth", "waiting requests",
                    x_range, subtitle="mean requests waiting, per replica", empty=no_engine),
        line_figure(engine, "kv_cache_usage", "replica", "KV-cache use", "of the cache", x_range,
                    kind="share", subtitle="mean, per replica", empty=no_engine),
        line_figure(gpus, "utilization", "series", "GPU utilization", "busy", x_range,
                    kind="share", subtitle="mean, per replica and node", empty=no_gpu),
        line_figure(gpus, "power_watts", "series", "GPU power", "watts per GPU", x_range,
                    subtitle="mean per GPU, per replica and node", empty=no_gpu),
    ]  # fmt: skip


def register(app: Dash, ctx: Context) -> None:
    """The fleet page's callbacks: every figure, refreshed on the interval; the reconciliation."""
    reconciliation.register(app, ctx)
    colours = colours_for([m.name for m in ctx.config.models])
    outputs = [Output("fleet-status", "children"), Output("fleet-replicas", "children"),
               Output("fleet-admin-note", "children"), Output("fleet-admin-figures", "style")]  # fmt: skip
    outputs += [Output(f, "figure") for f in (*_FIGURES, *_ADMIN_FIGURES)]
    inputs = [
        Input("tick", "n_intervals"),
        Input("range", "value"),
        Input("auth", "data"),
        Input("tz", "data"),
    ]

    @app.callback(*outputs, *inputs)
    def refresh(_: int, choice: str | None, auth: Any, tz: str | None) -> list[Any]:
        blank = [empty_figure("", "")] * (len(_FIGURES) + len(_ADMIN_FIGURES))
        if not signed_in(auth):
            return [note("Sign in to see the fleet."), None, None, _HIDDEN, *blank]
        token, (start, end) = auth["token"], time_range(choice)
        admin = bool(auth.get("is_admin"))
        names = ["ttft", "throughput", "team_usage"] + (
            ["engine", "gpus", "replicas"] if admin else []
        )
        # The scaling signal is scraped while billing answers, not after.
        with ThreadPoolExecutor(max_workers=1) as pool:
            scrape = pool.submit(desired_replicas, ctx.config.dashboard.metrics_urls)
            try:
                answers = fetch_answers(ctx.client, token, names, start, end)
            except BillingError as exc:
                return [note(str(exc), "error"), None, None, _HIDDEN, *blank]
            desired = scrape.result()
        x_range = local_range(start, end, tz)
        ttft, thr = _series(answers["ttft"], end, tz), _series(answers["throughput"], end, tz)
        usage = answers["team_usage"].frame
        requests = int(usage["requests"].sum()) if usage.height else 0
        status = html.P(f"{requests:,} requests in range", id="fleet-requests-total")
        idle = "No requests in this range."
        figures = [
            _ttft_figure(ctx, ttft, x_range, colours),
            line_figure(thr, "output_tokens_per_second", "model", "Output tokens per second",
                        "tokens/s", x_range, colours=colours, empty=idle),
            line_figure(thr, "requests_per_second", "model", "Requests per second",
                        "requests/s", x_range, colours=colours, empty=idle),
            line_figure(thr, "error_ratio", "model", "Error rate", "of requests", x_range,
                        kind="fraction", colours=colours, empty=idle,
                        subtitle="requests that failed upstream"),
        ]  # fmt: skip
        if not admin:
            admin_note = note(
                "Engine and GPU telemetry spans every team, so it is shown to the admin only.",
                note_id="fleet-admin-sentence",
            )
            return [status, _replicas(ctx, None, desired), admin_note, _HIDDEN, *figures,
                    *blank[: len(_ADMIN_FIGURES)]]  # fmt: skip
        engine, gpus = _series(answers["engine"], end, tz), _series(answers["gpus"], end, tz)
        figures += _admin_figures(engine, gpus, x_range)
        reporting = answers["replicas"].frame
        return [status, _replicas(ctx, reporting, desired), None, {}, *figures]
