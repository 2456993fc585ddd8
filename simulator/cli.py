"""``infermeter simulate``: the simulated fleet, one of its processes, or its traffic.

Imported to build the parser; the servers and the traffic generator are imported by the handler.
The whole fleet is started as processes by the launcher, which hands its runner to ``register``
(``run_fleet``): the simulator serves one process's part and does not know the launcher.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from infermeter.commands import Subparsers, add_config, config_path, fail, listen_arg

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["FleetRunner", "register"]


#: What runs the whole simulated fleet: the arguments, the configuration and its file's path.
FleetRunner = Callable[[argparse.Namespace, "Config", str], int]


def register(subparsers: Subparsers, run_fleet: FleetRunner) -> None:
    """Add the ``simulate`` subcommand; ``run_fleet`` starts the fleet when no one part is asked."""
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
        type=listen_arg,
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
    sim.set_defaults(handler=partial(_simulate, run_fleet))


def _simulate(run_fleet: FleetRunner, args: argparse.Namespace, config: Config) -> int:
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
    return run_fleet(args, config, config_path(args))
