"""The ``infermeter`` command: one entry point, one subcommand per part of the platform.

Configuration is loaded here, once, and handed down; errors a user can fix (a bad config file, a
port in use) end the program with a one-line message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from infermeter import __version__, exposure
from infermeter.config import Config, ConfigError, default_config_path, load_config
from infermeter.serving import PortInUseError

__all__ = ["add_config", "main"]

Handler = Callable[[argparse.Namespace, Config], int]
DEMO_INGEST_TOKEN = "im-demo-ingest"  # public, like the demo team keys

# Parts that bring their own subcommands: each module has ``register(subparsers)``, which adds
# parsers whose ``handler`` default is a ``Handler``. Imported only to build the parser, so each
# keeps its heavy imports inside its handlers.
PLUGINS: tuple[str, ...] = ("alerts.cli", "billing.cli", "alerts.autoscale.cli", "dashboards.cli")


def add_config(parser: argparse.ArgumentParser, nested: bool = False) -> None:
    """The ``--config`` option every subcommand takes.

    ``nested``: for a parser below another that already has it; its default must not reset a
    ``--config`` given before the action's name.
    """
    parser.add_argument(
        "--config",
        type=Path,
        default=argparse.SUPPRESS if nested else None,
        help="infermeter.yaml to use (default: $INFERMETER_CONFIG, else the embedded demo fleet)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with every subcommand and its help text."""
    parser = argparse.ArgumentParser(
        prog="infermeter",
        description="Observability and cost chargeback for GPU inference fleets that serve vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"infermeter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    sim = sub.add_parser(
        "simulate",
        help="run a simulated vLLM fleet and dcgm-exporter stand-ins (no GPU needed)",
        description=(
            "Start every replica of the configuration as a vLLM-compatible server (one process "
            "each, on its upstream_url) and a dcgm-exporter stand-in per node (on its "
            "dcgm_exporter_url). Ctrl-C stops everything."
        ),
    )
    add_config(sim)
    only = sim.add_mutually_exclusive_group()
    only.add_argument("--replica", metavar="ID", help="serve only this replica, in this process")
    only.add_argument("--dcgm", action="store_true", help="serve only the dcgm-exporter stand-ins")
    only.add_argument(
        "--traffic-only", action="store_true", help="only send traffic to a running fleet"
    )
    sim.add_argument(
        "--traffic", action="store_true", help="also generate traffic from several teams"
    )
    sim.add_argument(
        "--via-sidecars", action="store_true", help="send traffic to the sidecars, not the replicas"
    )
    sim.add_argument(
        "--peak-rps", type=float, default=6.0, help="traffic: requests/s at the morning peak"
    )
    sim.add_argument(
        "--day-seconds", type=float, default=600.0, help="traffic: wall seconds per simulated day"
    )
    sim.add_argument(
        "--duration", type=float, default=None, help="traffic: stop after this many seconds"
    )
    sim.add_argument("--seed", type=int, default=None, help="override simulator.seed")
    sim.set_defaults(handler=_simulate)

    side = sub.add_parser(
        "sidecar",
        help="run the metering proxy in front of one vLLM replica",
        description=(
            "Relay the OpenAI API to one replica: identify the team, enforce its limits, meter "
            "every request, write one durable usage record per request and ship them to billing. "
            "SIGHUP or a change of the config file reloads keys, limits and approved models."
        ),
    )
    add_config(side)
    side.add_argument(
        "--replica", required=True, metavar="ID", help="the replica (from the config) to front"
    )
    side.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="where to listen (default: the replica's sidecar_listen)",
    )
    side.add_argument(
        "--upstream", metavar="URL", help="the vLLM server (default: the replica's upstream_url)"
    )
    side.set_defaults(handler=_sidecar)

    col = sub.add_parser(
        "collect",
        help="scrape GPU telemetry (dcgm-exporter or NVML) and vLLM engine state",
        description=(
            "Scrape every node's dcgm-exporter (or this node's GPUs through NVML) and every "
            "replica's vLLM /metrics, join each GPU sample to its replica, compute energy, spool "
            "and ship the samples to billing, and serve the joined fleet view on /metrics."
        ),
    )
    add_config(col)
    col.add_argument(
        "--listen", metavar="HOST:PORT", help="where to serve /metrics (default: collector.listen)"
    )
    col.set_defaults(handler=_collect)

    demo = sub.add_parser(
        "demo",
        help="run the whole platform on a simulated fleet, with traffic",
        description=(
            "The simulated fleet, a sidecar in front of every replica, the collector, the billing "
            "service with its DuckDB ledger, the dashboard, and traffic from several teams "
            "through the sidecars, all on loopback. Ctrl-C stops everything."
        ),
    )
    add_config(demo)
    demo.add_argument("--peak-rps", type=float, default=6.0, help="requests/s at the morning peak")
    demo.add_argument(
        "--day-seconds", type=float, default=600.0, help="wall seconds per simulated day"
    )
    demo.set_defaults(handler=_demo)
    for module in PLUGINS:
        importlib.import_module(module).register(sub)
    return parser


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, load the configuration, run the subcommand."""
    if argv is None:
        # SIGTERM (what Kubernetes and the supervisor send) becomes SystemExit, so every
        # ``finally`` runs: uvicorn shuts down gracefully on it, then re-raises the signal, which
        # with the default action would kill the process before the code after ``serve()``.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = build_parser().parse_args(argv)
    if getattr(args, "seed", None) is not None:
        os.environ["INFERMETER__SIMULATOR__SEED"] = str(args.seed)
    try:
        config = load_config(args.config)
        _refuse_public_keys(args, config)
        handler: Handler = args.handler
        return handler(args, config)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"infermeter: config error: {line}", file=sys.stderr)
        return 2
    except PortInUseError as exc:
        print(f"infermeter: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _refuse_public_keys(args: argparse.Namespace, config: Config) -> None:
    """Warn on the demo configuration; refuse public key hashes on a reachable address."""
    warning = exposure.fallback_warning(args.command, args.config, default_config_path())
    if warning:
        print(warning, file=sys.stderr)
    if args.command != "simulate":  # the simulator checks no keys; everything else does
        problems = exposure.public_key_problems(config, getattr(args, "listen", None))
        if problems:
            raise ConfigError(_config_path(args), problems)


def _config_path(args: argparse.Namespace) -> str:
    return str(args.config or default_config_path())


def _simulate(args: argparse.Namespace, config: Config) -> int:
    from simulator import serve, traffic

    if args.replica:
        try:
            config.replica(args.replica)
        except KeyError:
            print(
                f"infermeter: no replica {args.replica!r} in {_config_path(args)}", file=sys.stderr
            )
            return 2
        asyncio.run(serve.serve_replica(config, args.replica))
        return 0
    if args.dcgm:
        asyncio.run(serve.serve_dcgm(config))
        return 0
    if args.traffic_only:
        gen = traffic.TrafficGenerator(
            traffic.default_targets(config, args.via_sidecars),
            traffic.demo_teams(config),
            traffic.TrafficProfile(
                peak_requests_per_second=args.peak_rps,
                day_seconds=args.day_seconds,
                seed=config.simulator.seed,
            ),
        )
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(gen.run(args.duration))
        print("traffic summary:\n" + gen.summary())
        return 0
    from infermeter import fleet

    children = fleet.simulator_children(config, _config_path(args))
    if args.traffic:
        children.append(fleet.traffic_child(_config_path(args), args))
    return fleet.run(children, fleet.simulator_urls(config))


def _sidecar(args: argparse.Namespace, config: Config) -> int:
    from sidecar.serve import serve_sidecar

    try:
        config.replica(args.replica)
    except KeyError:
        print(f"infermeter: no replica {args.replica!r} in {_config_path(args)}", file=sys.stderr)
        return 2
    asyncio.run(serve_sidecar(Path(_config_path(args)), args.replica, args.listen, args.upstream))
    return 0


def _collect(args: argparse.Namespace, config: Config) -> int:
    from collectors.serve import serve_collector

    asyncio.run(serve_collector(config, args.listen))
    return 0


def _demo(args: argparse.Namespace, config: Config) -> int:
    from infermeter import fleet

    path = _config_path(args)
    args.via_sidecars = True
    args.duration = None
    # Sidecars and the collector ship to the demo's billing service with the demo ingest token
    # (its hash is in the embedded defaults); a user's own settings win.
    ingest = f"{config.billing.url.rstrip('/')}/v1/ingest"
    os.environ.setdefault("INFERMETER__SIDECAR__INGEST_URL", config.sidecar.ingest_url or ingest)
    os.environ.setdefault(
        "INFERMETER__COLLECTOR__INGEST_URL", config.collector.ingest_url or ingest
    )
    os.environ.setdefault("INFERMETER_INGEST_TOKEN", DEMO_INGEST_TOKEN)
    children = [fleet.billing_child(config, path)]
    children += fleet.simulator_children(config, path) + fleet.sidecar_children(config, path)
    children.append(fleet.collector_child(config, path))
    children.append(fleet.dashboard_child(config, path))
    children.append(fleet.traffic_child(path, args))
    urls = fleet.sidecar_urls(config) + fleet.simulator_urls(config)
    urls.append(("collector (fleet view)", f"http://{config.collector.listen}/metrics"))
    urls.append(("billing API (admin: im-demo-admin)", f"{config.billing.url}/v1/spend"))
    urls.append(("dashboard (sign in: im-demo-admin)", f"http://{config.dashboard.listen}/"))
    return fleet.run(children, urls)
