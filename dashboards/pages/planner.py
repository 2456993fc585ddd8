"""Capacity planner: memory of one replica and the GPUs it fits, priced from the price book."""

from __future__ import annotations

from typing import Any

import polars as pl
from dash import Dash, Input, Output, State, dcc, html

from dashboards.components import frame_table, note, page
from dashboards.context import Context
from dashboards.formatting import MISSING
from infermeter.planner import (
    ACTIVATION_SHARE,
    BYTES_PER_PARAM,
    FIXED_GB_PER_GPU,
    GPU_MEMORY_UTILIZATION,
    PRESETS,
    ModelShape,
    plan,
)

PATH = "/planner"
TITLE = "Capacity planner"
_FIELDS = ("params", "context", "concurrency", "layers", "kv-heads", "head-dim")


def _number(field: str, label: str, value: float, step: float = 1) -> html.Div:
    return html.Div(
        [
            html.Label(label, htmlFor=f"plan-{field}"),
            dcc.Input(
                id=f"plan-{field}", type="number", value=value, min=0, step=step, debounce=True
            ),
        ],
        className="field",
    )


def layout(ctx: Context) -> html.Div:
    """The planner's inputs (preset Llama-3.1-70B, fp8, 8k context, 16 sequences) and result."""
    p = PRESETS["Llama-3.1-70B"]
    precisions = list(BYTES_PER_PARAM)
    return page(
        TITLE,
        html.Div(
            [
                html.Div(
                    [
                        html.Label("Preset", htmlFor="plan-preset"),
                        dcc.Dropdown(
                            id="plan-preset",
                            options=list(PRESETS),
                            value="Llama-3.1-70B",
                            clearable=False,
                        ),
                    ],
                    className="field",
                ),
                _number("params", "Parameters (billions)", p.params_billions, 0.1),
                html.Div(
                    [
                        html.Label("Precision", htmlFor="plan-precision"),
                        dcc.Dropdown(
                            id="plan-precision", options=precisions, value="fp8", clearable=False
                        ),
                    ],
                    className="field",
                ),
                html.Div(
                    [
                        html.Label("KV cache precision", htmlFor="plan-kv-precision"),
                        dcc.Dropdown(
                            id="plan-kv-precision",
                            options=precisions,
                            value="fp16",
                            clearable=False,
                        ),
                    ],
                    className="field",
                ),
                _number("context", "Context length (tokens)", 8192),
                _number("concurrency", "Concurrent sequences", 16),
                _number("layers", "Layers", p.layers),
                _number("kv-heads", "KV heads", p.kv_heads),
                _number("head-dim", "Head dimension", p.head_dim),
            ],
            className="form",
        ),
        html.Div(id="plan-summary"),
        html.Div(id="plan-table"),
        html.P(
            f"Assumptions: KV cache = 2 x layers x KV heads x head dim x bytes x tokens; runtime overhead "
            f"{ACTIVATION_SHARE:.0%} of weights and KV cache (activations, CUDA graphs) plus "
            f"{FIXED_GB_PER_GPU:g} GB per GPU; vLLM gpu_memory_utilization {GPU_MEMORY_UTILIZATION}; "
            "tensor parallelism a power of two up to 8 that divides the KV heads. GB = 10^9 bytes.",
            className="note",
        ),
    )


def register(app: Dash, ctx: Context) -> None:
    """Preset -> shape fields; any field -> the plan."""
    prices = ctx.config.prices.usd_per_gpu_hour

    @app.callback(
        Output("plan-params", "value"),
        Output("plan-layers", "value"),
        Output("plan-kv-heads", "value"),
        Output("plan-head-dim", "value"),
        Input("plan-preset", "value"),
        prevent_initial_call=True,
    )
    def preset(name: str) -> tuple[float, int, int, int]:
        p = PRESETS[name]
        return p.params_billions, p.layers, p.kv_heads, p.head_dim

    @app.callback(
        Output("plan-summary", "children"),
        Output("plan-table", "children"),
        Input("plan-precision", "value"),
        Input("plan-kv-precision", "value"),
        *(Input(f"plan-{f}", "value") for f in _FIELDS),
        State("auth", "data"),
    )
    def compute(precision: str, kv_precision: str, *fields: Any) -> tuple[Any, Any]:
        *values, auth = fields
        if ctx.session(auth) is None:
            # The price book is the platform's: signed out, no figures (as every page).
            return note("Sign in to plan."), None
        if any(v is None for v in values):
            return note("Fill in every field."), None
        params, context, concurrency, layers, kv_heads, head_dim = values
        try:
            shape = ModelShape(
                float(params),
                precision,
                int(context),
                int(concurrency),
                int(layers),
                int(kv_heads),
                int(head_dim),
                kv_precision,
            )
        except (ValueError, OverflowError) as exc:  # OverflowError: int() of an infinity
            return note(str(exc), "error"), None
        result = plan(shape, prices)
        summary = html.P(
            f"Weights {result.weights_gb:.1f} GB + KV cache {result.kv_cache_gb:.1f} GB + overhead "
            f"{result.overhead_gb:.1f} GB = {result.total_gb:.1f} GB per replica",
            id="plan-total",
        )
        rows = [
            {
                "gpu": f.gpu,
                "memory_gb": f.memory_gb,
                "gpus": str(f.tensor_parallel) if f.fits else "does not fit",
                "per_gpu_gb": round(f.per_gpu_gb, 1) if f.per_gpu_gb is not None else None,
                "usd_per_hour": f.usd_per_hour if f.fits else None,
            }
            for f in result.fits
        ]
        kinds = {"gpus": "count", "usd_per_hour": "usd"}
        unpriced = [f.gpu for f in result.fits if f.fits and f.usd_per_hour is None]
        why = (
            f"{MISSING} in Cost per hour: no price in prices.usd_per_gpu_hour for "
            f"{', '.join(unpriced)}; a GPU the model does not fit has no cost either."
            if unpriced
            else f"{MISSING} in Cost per hour: the model does not fit that GPU."
        )
        table = frame_table(pl.DataFrame(rows), "plan-gpus", kinds=kinds)  # type: ignore[arg-type]
        return summary, html.Div([table, note(why, note_id="plan-missing")])
