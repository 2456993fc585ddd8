"""``infermeter dashboard`` (the web app) and ``infermeter plan`` (the capacity planner).

Imported only to build the parser; the web app's heavy imports (dash, plotly) happen inside the
handler, so ``infermeter --help`` and ``infermeter plan`` stay quick.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from dashboards.formatting import MISSING
from infermeter.commands import Subparsers, add_config, fail, listen_arg, url_arg
from infermeter.planner import BYTES_PER_PARAM, GPUS_GB, PRESETS, ModelShape, Plan, plan

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["format_plan", "register"]


def register(subparsers: Subparsers) -> None:
    """Add the ``dashboard`` and ``plan`` subcommands."""
    dash = subparsers.add_parser(
        "dashboard",
        help="serve the web dashboards (fleet, teams, chargeback, SLA, capacity planner)",
        description=(
            "Serve the Plotly Dash web app. It reads the ledger only through the billing "
            "service's query API, forwarding the signed-in user's key, so a team key sees only "
            "its own team."
        ),
    )
    add_config(dash)
    dash.add_argument(
        "--listen",
        type=listen_arg,
        metavar="HOST:PORT",
        help="where to serve (default: dashboard.listen)",
    )
    dash.add_argument(
        "--billing-url",
        type=url_arg,
        metavar="URL",
        help="the billing service (default: dashboard.billing_url, else billing.url)",
    )
    dash.set_defaults(handler=_dashboard)

    p = subparsers.add_parser(
        "plan",
        help="size a model: memory, GPUs that fit, tensor parallelism and hourly cost",
        description=(
            "Memory for weights, KV cache and runtime overhead of one vLLM replica, the number "
            "of GPUs of each model it needs (tensor parallelism) and its price per hour from "
            "the configuration's price book."
        ),
    )
    add_config(p)
    p.add_argument("--params", type=float, required=True, help="parameters, in billions")
    p.add_argument("--precision", choices=sorted(BYTES_PER_PARAM), default="bf16")
    p.add_argument("--kv-precision", choices=sorted(BYTES_PER_PARAM), default="fp16")
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--concurrency", type=int, default=16, help="sequences held at once")
    p.add_argument("--preset", choices=sorted(PRESETS), help="layers, KV heads and head dim")
    p.add_argument("--layers", type=int, help="transformer layers (default: from the preset)")
    p.add_argument("--kv-heads", type=int, help="KV heads (default: from the preset)")
    p.add_argument("--head-dim", type=int, help="head dimension (default: from the preset)")
    p.add_argument("--gpu", choices=sorted(GPUS_GB), help="only this GPU model")
    p.set_defaults(handler=_plan)


def _nearest_preset(params_billions: float) -> str:
    return min(PRESETS, key=lambda name: abs(PRESETS[name].params_billions - params_billions))


def _preset_of(params_billions: float) -> str | None:
    """The preset of this size, if there is one (8, 70 or 405 billion)."""
    for name, preset in PRESETS.items():
        if math.isclose(preset.params_billions, params_billions, rel_tol=0.02):
            return name
    return None


def _plan(args: argparse.Namespace, config: Config) -> int:
    named = args.preset or _preset_of(args.params)
    explicit = None not in (args.layers, args.kv_heads, args.head_dim)
    if named is None and not explicit and args.params > 0:
        # Borrowing the nearest preset's layers and heads would print a plan for another model.
        return fail(
            f"no model shape for {args.params:g}B parameters: give --preset "
            f"({', '.join(PRESETS)}) or all of --layers, --kv-heads and --head-dim"
        )
    preset = PRESETS[named or _nearest_preset(args.params)]
    try:
        shape = ModelShape(
            params_billions=args.params,
            precision=args.precision,
            context_tokens=args.context,
            concurrency=args.concurrency,
            layers=args.layers or preset.layers,
            kv_heads=args.kv_heads or preset.kv_heads,
            head_dim=args.head_dim or preset.head_dim,
            kv_precision=args.kv_precision,
        )
    except ValueError as exc:
        return fail(str(exc))
    gpus = {args.gpu: GPUS_GB[args.gpu]} if args.gpu else GPUS_GB
    print(format_plan(shape, plan(shape, config.prices.usd_per_gpu_hour, gpus)))
    return 0


def format_plan(shape: ModelShape, result: Plan) -> str:
    """The plan as a plain-text table."""
    head = (
        f"{shape.params_billions:g}B {shape.precision}, {shape.layers} layers x "
        f"{shape.kv_heads} KV heads x {shape.head_dim}, {shape.concurrency} x "
        f"{shape.context_tokens} tokens (KV {shape.kv_precision})\n"
        f"weights {result.weights_gb:.1f} GB + KV cache {result.kv_cache_gb:.1f} GB + "
        f"overhead {result.overhead_gb:.1f} GB = {result.total_gb:.1f} GB\n"
    )
    rows = [("GPU", "memory", "GPUs (TP)", "per GPU", "USD/hour")]
    for f in result.fits:
        rows.append(
            (
                f.gpu,
                f"{f.memory_gb:g} GB",
                str(f.tensor_parallel) if f.fits else "does not fit",
                f"{f.per_gpu_gb:.1f} GB" if f.per_gpu_gb is not None else MISSING,
                f"{f.usd_per_hour:.2f}" if f.fits and f.usd_per_hour is not None else MISSING,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    unpriced = [f.gpu for f in result.fits if f.fits and f.usd_per_hour is None]
    if unpriced:
        lines.append(
            f"{MISSING} USD/hour: no price in prices.usd_per_gpu_hour for {', '.join(unpriced)}"
        )
    return head + "\n".join(lines)


def _dashboard(args: argparse.Namespace, config: Config) -> int:
    from dashboards.serve import serve_dashboard

    return serve_dashboard(config, args.listen, args.billing_url)
