"""Fleet: replicas and instances, latency against the SLA, throughput and errors per model;
engines and GPUs per replica.

The Replicas table is billing's ``/v1/fleet``: per model the replica groups the configuration
lists, the instances live now (their lifetimes, as their sidecars announce them) and the
autoscaler's latest desired count with the change that set it and why; below it, every live
instance. The autoscaler's gauge on ``dashboard.metrics_urls`` stands in for a desired count
billing has no decision for. Each chart marks the events of its range (``dashboards.events``:
scaling decisions, alerts that fired, month closes; a dotted line and a symbol whose hover says
what and why), and draws the bucket still filling, shaded as partial
(``dashboards.data.drawn``), so it agrees with the range's totals from the first minute. Spare
GPUs are one series, "unassigned", on the GPU charts.

Fleet-wide telemetry (engines, GPUs, instances, decisions) spans every team, so billing answers
it to the admin only; a team sees its own charts and a sentence in place of the fleet's, never
empty plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]
import polars as pl
from dash import Dash, Input, Output, html

from dashboards import events, reconciliation
from dashboards.client import Answer, BillingError
from dashboards.components import frame_table, graph, note, page
from dashboards.context import Context
from dashboards.data import (
    Drawn,
    desired_replicas,
    drawn,
    fetch_answers,
    local_range,
    local_times,
)
from dashboards.figures import colours_for, empty_figure, line_figure
from dashboards.formatting import as_of

PATH = "/"
TITLE = "Fleet"
_FIGURES = ("fleet-ttft", "fleet-tokens", "fleet-requests", "fleet-errors")
_ADMIN_FIGURES = ("fleet-queue", "fleet-kv", "fleet-gpu-util", "fleet-gpu-power")
_HIDDEN = {"display": "none"}
# Per-second columns of the throughput query: in the bucket still filling, per second so far.
_RATES = ("requests_per_second", "output_tokens_per_second", "prompt_tokens_per_second")
_PARTIAL_SHADE = "#98a2b3"
_PARTIAL_NOTE = "partial: the last bucket so far"


def layout(ctx: Context) -> html.Div:
    """The fleet page's frame; ``register`` fills it."""
    return page(
        TITLE,
        html.Div(id="fleet-status"),
        html.H3("Replicas"),
        html.Div(id="fleet-replicas"),
        html.H3("Live instances"),
        html.Div(id="fleet-instances"),
        html.H3("Requests by model"),
        html.Div(id="fleet-events-note"),
        html.Div([graph(f) for f in _FIGURES], className="grid"),
        html.H3("Engines and GPUs"),
        html.Div(id="fleet-admin-note"),
        html.Div([graph(f) for f in _ADMIN_FIGURES], className="grid", id="fleet-admin-figures"),
        html.H3("Tokens: engines against the ledger"),
        html.Div(id="fleet-reconciliation"),
    )


def _series(answer: Answer, end: float, tz: str | None, rates: Sequence[str] = ()) -> Drawn:
    """The complete buckets and the one still filling, in the viewer's zone."""
    found = drawn(answer, end, rates)
    return Drawn(local_times(found.frame, tz), found.partial_from)


def _mark_partial(fig: go.Figure, series: Drawn, end: float, tz: str | None) -> go.Figure:
    """Shade the bucket still filling and ring its points, so they read as "so far".

    Its points stand at the bucket's start, like every other, a few seconds before the range's
    end; the words sit at the right edge, over the shade.
    """
    if series.partial_from is None or not fig.data:
        return fig
    x0, x1 = local_range(series.partial_from, end, tz)
    fig.add_vrect(x0=x0, x1=x1, fillcolor=_PARTIAL_SHADE, opacity=0.25, line_width=0)
    for trace in list(fig.data):
        xs, ys = list(trace.x or ()), list(trace.y or ())
        if xs and xs[-1] == x0:
            fig.add_trace(
                go.Scatter(
                    x=[x0],
                    y=[ys[-1]],
                    mode="markers",
                    showlegend=False,
                    marker={
                        "symbol": "circle-open",
                        "size": 11,
                        "line": {"width": 2},
                        "color": trace.line.color or _PARTIAL_SHADE,
                    },
                    hovertemplate=f"%{{y:,.3~f}} so far<extra>{trace.name} (partial)</extra>",
                )
            )
    fig.add_annotation(
        x=x1,
        y=1.0,
        xref="x",
        yref="paper",
        xanchor="right",
        yanchor="bottom",
        text=_PARTIAL_NOTE,
        showarrow=False,
        font={"size": 10, "color": "#475467"},
    )
    return fig


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
    fig = line_figure(
        long,
        "value",
        "series",
        title,
        "seconds",
        x_range,
        colours=colours,
        colour_of=owner,
        dash_by=dashes,
        subtitle=subtitle,
    )
    shown = set(frame["model"].to_list())
    for m in ctx.config.models:
        if m.name in shown:
            fig.add_hline(
                y=m.sla.ttft_p95_seconds,
                line_dash="dash",
                line_width=1,
                line_color=colours.get(m.name),
                annotation_text=f"{m.name} target",
                annotation_position="top left",
            )
    return fig


def _desired(model: dict[str, Any] | None, name: str, scraped: dict[str, float]) -> float | None:
    """Billing's latest decision; else the autoscaler's gauge; else None (shown as a dash)."""
    if model is not None and model.get("desired") is not None:
        return float(model["desired"])
    return scraped.get(name)


def _replicas(
    ctx: Context, fleet: dict[str, Any] | None, scraped: dict[str, float], tz: str | None
) -> html.Div:
    """Per model: groups, configured, live and desired replicas, and the last change with its why.

    ``fleet`` is billing's ``/v1/fleet`` (None for a team, which may not read it).
    """
    by_model = {m["model"]: m for m in (fleet or {}).get("models", [])}
    names = [m.name for m in ctx.config.models]
    names += [n for n in by_model if n not in names]
    rows = []
    for name in names:
        model = by_model.get(name)
        configured = sum(r.model == name for r in ctx.config.replicas)
        row: dict[str, Any] = {
            "model": name,
            "configured": configured,
            "live": "admin only",
            # The autoscaler's decision weighs every team's load: the admin's, as billing's
            # fleet view is (its gauge is not a way around that).
            "desired": "admin only" if fleet is None else _desired(model, name, scraped),
        }
        if fleet is not None:
            last = model.get("last_decision") if model else None
            row |= {
                "groups": ", ".join(model["groups"]) if model else "",
                "live": int(model["live"]) if model else 0,
                "last_change": (
                    f"{_when(last['decided_at'], fleet['as_of'], tz)}: "
                    f"{last['previous']} -> {last['desired']}"
                )
                if last
                else "none yet",
                "why": last["reasons"] if last else "",
            }
        rows.append(row)
    columns = ["model", "configured", "live", "desired"]
    if fleet is not None:
        columns = ["model", "groups", "configured", "live", "desired", "last_change", "why"]
    kinds = {"live": "count", "desired": "count"}
    return frame_table(pl.DataFrame(rows), "fleet-replicas-table", columns, kinds=kinds)  # type: ignore[arg-type]


def _when(t: float, now: float, tz: str | None) -> str:
    """A decision's time in the viewer's zone: the time of day within a day, else with its date."""
    if now - t < 86_400:
        return as_of(t, tz)
    day = local_times(pl.DataFrame({"t": [t]}), tz)["t"][0]
    return f"{day:%Y-%m-%d %H:%M}"


def _instances(fleet: dict[str, Any] | None, tz: str | None) -> html.Div | html.P:
    """Every live instance, group by group, oldest first: where it runs and since when."""
    if fleet is None:
        return note(
            "Instances span every team, so they are shown to the admin only.",
            note_id="fleet-instances-sentence",
        )
    rows = [
        {
            "replica_group": g["replica"],
            "instance": i["instance"],
            "node": i["node"],
            "gpu_ids": ", ".join(i["gpus"]) or f"{i['gpu_count']} ({i['gpu_model']})",
            "started": i["started_at"],
        }
        for g in fleet["groups"]
        for i in g["instances"]
    ]
    schema = {
        "replica_group": pl.String,
        "instance": pl.String,
        "node": pl.String,
        "gpu_ids": pl.String,
        "started": pl.Float64,
    }
    frame = local_times(pl.DataFrame(rows, schema=schema), tz, "started")
    return frame_table(
        frame,
        "fleet-instances-table",
        empty="No instance is live: billing has heard from none in the last three heartbeats.",
    )


UNASSIGNED = "unassigned"


def gpu_series(gpus: pl.DataFrame) -> pl.DataFrame:
    """Per step, one row per instance (named by its group, and by itself when the group runs
    several, then its node) and one for every spare GPU together, "unassigned", each the mean
    over its GPUs (weighted by the GPUs busy in the step)."""
    if gpus.height == 0:
        return gpus.with_columns(series=pl.lit(None, pl.String))
    replica = pl.col("replica").cast(pl.String).fill_null("")
    instance = pl.col("instance").cast(pl.String).fill_null("")
    named = pl.when((instance == "") | (instance == replica)).then(replica).otherwise(instance)
    series = (
        pl.when(replica == "")
        .then(pl.lit(UNASSIGNED))
        .otherwise(named + " " + pl.col("node").cast(pl.String))
    )
    weight = pl.col("gpus").cast(pl.Float64)
    return (
        gpus.with_columns(series=series, w=weight)
        .group_by("t", "series")
        .agg(
            ((pl.col("utilization") * pl.col("w")).sum() / pl.col("w").sum()).alias("utilization"),
            ((pl.col("power_watts") * pl.col("w")).sum() / pl.col("w").sum()).alias("power_watts"),
            pl.col("w").sum().alias("gpus"),
        )
        .sort("series", "t")
    )


def _admin_figures(engine: pl.DataFrame, gpus: pl.DataFrame, x_range: Any) -> list[go.Figure]:
    gpus = gpu_series(gpus)
    no_engine = "No engine samples in this range."
    no_gpu = "No GPU samples in this range."
    return [
        line_figure(
            engine,
            "requests_waiting",
            "replica",
            "Queue depth",
            "waiting requests",
            x_range,
            subtitle="mean requests waiting, per replica",
            empty=no_engine,
        ),
        line_figure(
            engine,
            "kv_cache_usage",
            "replica",
            "KV-cache use",
            "of the cache",
            x_range,
            kind="share",
            subtitle="mean, per replica",
            empty=no_engine,
        ),
        line_figure(
            gpus,
            "utilization",
            "series",
            "GPU utilization",
            "busy",
            x_range,
            kind="share",
            subtitle="mean, per instance and node; spare GPUs together",
            empty=no_gpu,
        ),
        line_figure(
            gpus,
            "power_watts",
            "series",
            "GPU power",
            "watts per GPU",
            x_range,
            subtitle="mean per GPU, per instance and node; spare GPUs together",
            empty=no_gpu,
        ),
    ]


def register(app: Dash, ctx: Context) -> None:
    """The fleet page's callbacks: every figure, refreshed on the interval; the reconciliation."""
    reconciliation.register(app, ctx)
    colours = colours_for([m.name for m in ctx.config.models])
    outputs = [
        Output("fleet-status", "children"),
        Output("fleet-replicas", "children"),
        Output("fleet-instances", "children"),
        Output("fleet-admin-note", "children"),
        Output("fleet-admin-figures", "style"),
        Output("fleet-events-note", "children"),
    ]
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
        session = ctx.session(auth)
        if session is None:
            return [note("Sign in to see the fleet."), None, None, None, _HIDDEN, None, *blank]
        token, picked = session.token, ctx.window(session, choice)
        start, end = picked.start, picked.end
        admin = session.is_admin
        names = ["ttft", "throughput", "team_usage"] + (["engine", "gpus"] if admin else [])
        # The scaling signal is scraped, the fleet and the events asked for, while billing
        # answers the rest.
        with ThreadPoolExecutor(max_workers=3) as pool:
            scrape = pool.submit(desired_replicas, ctx.config.dashboard.metrics_urls)
            asked = pool.submit(ctx.client.fleet, token, start, end) if admin else None
            happened = pool.submit(
                events.gather,
                ctx.client,
                token,
                admin,
                ctx.config.dashboard.prometheus_url,
                start,
                end,
            )
            try:
                answers = fetch_answers(ctx.client, token, names, start, end)
                fleet = asked.result() if asked is not None else None
            except BillingError as exc:
                return [note(str(exc), "error"), None, None, None, _HIDDEN, None, *blank]
            scraped = scrape.result()
            found, problem = happened.result()
        marks = events.events_frame(found, tz)
        legend = html.Div(
            [
                note(events.LEGEND, note_id="fleet-events-legend"),
                *([note(problem, "error")] if problem else []),
            ]
        )
        x_range = local_range(start, end, tz)
        ttft = _series(answers["ttft"], end, tz)
        thr = _series(answers["throughput"], end, tz, _RATES)
        usage = answers["team_usage"].frame
        requests = int(usage["requests"].sum()) if usage.height else 0
        status = html.P(f"{requests:,} requests in range", id="fleet-requests-total")
        idle = "No requests in this range."
        figures = [
            (_ttft_figure(ctx, ttft.frame, x_range, colours), ttft),
            (
                line_figure(
                    thr.frame,
                    "output_tokens_per_second",
                    "model",
                    "Output tokens per second",
                    "tokens/s",
                    x_range,
                    colours=colours,
                    empty=idle,
                ),
                thr,
            ),
            (
                line_figure(
                    thr.frame,
                    "requests_per_second",
                    "model",
                    "Requests per second",
                    "requests/s",
                    x_range,
                    colours=colours,
                    empty=idle,
                ),
                thr,
            ),
            (
                line_figure(
                    thr.frame,
                    "error_ratio",
                    "model",
                    "Error rate",
                    "of requests",
                    x_range,
                    kind="fraction",
                    colours=colours,
                    empty=idle,
                    subtitle="requests that failed upstream",
                ),
                thr,
            ),
        ]
        replicas, instances = _replicas(ctx, fleet, scraped, tz), _instances(fleet, tz)
        if not admin:
            admin_note = note(
                "Engine and GPU telemetry spans every team, so it is shown to the admin only.",
                note_id="fleet-admin-sentence",
            )
            shown = [
                events.mark(_mark_partial(f, series, end, tz), marks, colours)
                for f, series in figures
            ]
            return [
                status,
                replicas,
                instances,
                admin_note,
                _HIDDEN,
                legend,
                *shown,
                *blank[: len(_ADMIN_FIGURES)],
            ]
        engine, gpus = _series(answers["engine"], end, tz), _series(answers["gpus"], end, tz)
        admin_figures = _admin_figures(engine.frame, gpus.frame, x_range)
        figures += zip(admin_figures, (engine, engine, gpus, gpus), strict=True)
        shown = [
            events.mark(_mark_partial(f, series, end, tz), marks, colours) for f, series in figures
        ]
        return [status, replicas, instances, None, {}, legend, *shown]
