"""``infermeter simulate``: the simulated fleet, one of its processes, or its traffic.

Imported to build the parser; the servers and the traffic generator are imported by the handler.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from infermeter.commands import Subparsers, add_config, config_path, fail

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register"]


def register(subparsers: Subparsers) -> None:
    """Add the ``simulate`` subcommand."""
    sim = subparsers.add_parser(
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
        "--listen",
        metavar="HOST:PORT",
        help="with --replica: listen here instead of the replica's upstream_url",
    )
    sim.add_argument(
        "--instance",
        metavar="ID",
        help="with --replica: serve as this instance of the replica group (its own GPUs' figures)",
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


def _simulate(args: argparse.Namespace, config: Config) -> int:
    import asyncio
    import contextlib

    from simulator import serve, traffic

    if args.replica:
        try:
            config.replica(args.replica)
        except KeyError:
            return fail(f"no replica {args.replica!r} in {config_path(args)}")
        asyncio.run(serve.serve_replica(config, args.replica, args.listen, args.instance))
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
            instance_targets=traffic.InstanceTargets(
                config, Path(config.simulator.instances_file), args.via_sidecars
            ),
        )
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(gen.run(args.duration))
        print("traffic summary:\n" + gen.summary())
        return 0
    from infermeter import fleet

    children = fleet.simulator_children(config, config_path(args))
    if args.traffic:
        children.append(fleet.traffic_child(config_path(args), args))
    return fleet.run(children, fleet.simulator_urls(config))
