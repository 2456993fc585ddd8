"""``infermeter autoscale run`` and ``infermeter autoscale replay``.

Imported to build the parser; the handlers import the service and the replay only when run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from infermeter.commands import Subparsers, add_config, config_path, fail, listen_arg, url_arg

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register"]


def register(subparsers: Subparsers) -> None:
    """Add the ``autoscale`` command and its ``run`` and ``replay`` subcommands."""
    parser = subparsers.add_parser(
        "autoscale",
        help="scale replicas per model from queue depth, TTFT, GPU utilization and history",
        description=(
            "Run the autoscaling policy against live metrics (run), or over a recorded or "
            "simulated day to see what it would have cost (replay)."
        ),
    )
    sub = parser.add_subparsers(dest="autoscale_command", metavar="SUBCOMMAND", required=True)
    run = sub.add_parser(
        "run",
        help="evaluate the policy every autoscale.interval_seconds and publish decisions",
        description=(
            "Read queue depth and GPU utilization from the collector's /metrics and TTFT and "
            "tokens from the sidecars' /metrics (or everything from Prometheus), run the policy, "
            "serve infermeter_desired_replicas{model} on /metrics and call the configured hooks "
            "(signed webhook, Kubernetes scale subresource)."
        ),
    )
    add_config(run)
    run.add_argument(
        "--listen",
        type=listen_arg,
        metavar="HOST:PORT",
        help="where to serve /metrics (default: autoscale.listen)",
    )
    run.add_argument(
        "--prometheus",
        type=url_arg,
        metavar="URL",
        help="read inputs from this Prometheus server (default: autoscale.prometheus_url)",
    )
    run.add_argument(
        "--day-seconds",
        type=float,
        default=86400.0,
        help="length of a day for the demand history's time-of-day slots (default 86400; "
        "the demo's simulated day is shorter)",
    )
    run.set_defaults(handler=_run)

    replay = sub.add_parser(
        "replay",
        help="run the policy over a recorded or simulated day and report GPU-hours and SLA",
        description=(
            "Replay the policy, with a simple queueing model of each model's replicas, over a "
            "recorded day (--input: CSV or JSONL of per-tick demand) or the simulator's daily "
            "traffic shape. Reports GPU-hours against a fixed fleet sized for the peak, minutes "
            "over the TTFT SLA and every scale event of the last day."
        ),
    )
    add_config(replay)
    replay.add_argument("--input", type=Path, metavar="FILE", help="recorded demand (CSV/JSONL)")
    replay.add_argument(
        "--days",
        type=int,
        default=2,
        help="simulated days; all but the last fill the demand history (default 2)",
    )
    replay.add_argument(
        "--day-seconds",
        type=float,
        default=86400.0,
        help="length of one simulated day in seconds (default 86400)",
    )
    replay.add_argument(
        "--tick-seconds",
        type=float,
        default=60.0,
        help="time between policy evaluations (default 60)",
    )
    replay.add_argument(
        "--peak-replicas",
        type=float,
        default=8.0,
        help="simulated demand: replicas the peak needs at the target utilization",
    )
    replay.add_argument(
        "--noise",
        type=float,
        default=0.1,
        help="simulated demand: log-normal sigma per tick (default 0.1)",
    )
    replay.add_argument("--model", action="append", help="only this model (repeatable)")
    replay.add_argument("--no-events", action="store_true", help="omit the scale event list")
    replay.set_defaults(handler=_replay)


def _run(args: argparse.Namespace, config: Config) -> int:
    import asyncio

    from alerts.autoscale.hooks import HookError
    from alerts.autoscale.service import log_to_stderr, serve_autoscaler
    from infermeter.writers import WriterError

    log_to_stderr()
    try:
        path = Path(config_path(args))
        asyncio.run(serve_autoscaler(config, args.listen, args.prometheus, path, args.day_seconds))
    except HookError as exc:
        return fail(f"autoscale: {exc}")
    except WriterError as exc:
        return fail(f"autoscale.credential_env: {exc}")
    return 0


def _replay(args: argparse.Namespace, config: Config) -> int:
    from alerts.autoscale.policy import model_limits, params_from_config
    from alerts.autoscale.replay import (
        engine_for,
        format_report,
        read_recording,
        replay_model,
        simulated_demand,
    )

    models = args.model or [m.name for m in config.models]
    unknown = [m for m in models if m not in {x.name for x in config.models}]
    if unknown:
        return fail(f"autoscale replay: unknown model(s) {unknown}")
    params = params_from_config(config, day_seconds=args.day_seconds)
    recorded = None
    if args.input is not None:
        try:
            recorded = read_recording(args.input)
        except (OSError, ValueError) as exc:
            return fail(f"autoscale replay: {exc}")
        models = [m for m in models if m in recorded]
    reports = []
    for model in models:
        engine = engine_for(config, model)
        if recorded is not None:
            demand = recorded[model]
            last = demand[-1].time if demand else 0.0
            measure_from = max(0.0, last + args.tick_seconds - args.day_seconds)
        else:
            peak = args.peak_replicas * engine.tokens_per_second * params.target_gpu_utilization
            demand = simulated_demand(
                peak,
                args.days,
                args.day_seconds,
                args.tick_seconds,
                args.noise,
                config.simulator.seed,
            )
            measure_from = (args.days - 1) * args.day_seconds
        limits = model_limits(config, model)
        reports.append(
            replay_model(params, limits, engine, demand, measure_from, args.tick_seconds)
        )
    print(format_report(reports, events=not args.no_events, day_seconds=args.day_seconds))
    return 0
