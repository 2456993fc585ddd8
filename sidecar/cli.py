"""``infermeter sidecar``: the metering proxy in front of one vLLM replica.

Imported to build the parser; the proxy itself is imported by the handler.
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
    """Add the ``sidecar`` subcommand."""
    side = subparsers.add_parser(
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
        type=listen_arg,
        metavar="HOST:PORT",
        help="where to listen (default: the replica's sidecar_listen)",
    )
    side.add_argument(
        "--upstream",
        type=url_arg,
        metavar="URL",
        help="the vLLM server (default: the replica's upstream_url)",
    )
    side.add_argument(
        "--spool-dir",
        type=Path,
        metavar="DIR",
        help="this instance's own spool directory (default: sidecar.spool_dir/<pod UID or instance "
        "id>); in a pod, the node directory mounted for this pod alone",
    )
    side.add_argument(
        "--engine-metrics-listen",
        type=listen_arg,
        metavar="HOST:PORT",
        help="also serve vLLM's /metrics here, and nothing else, without a token (for an "
        "endpoint picker; keep the port to it with a NetworkPolicy)",
    )
    side.set_defaults(handler=_sidecar)


def _sidecar(args: argparse.Namespace, config: Config) -> int:
    import asyncio

    from infermeter.identity import IdentityError
    from infermeter.otlp import OtlpConfigError
    from infermeter.serving import loop_factory
    from sidecar.serve import log_to_stderr, serve_sidecar

    log_to_stderr()
    try:
        config.replica(args.replica)
    except KeyError:
        return fail(f"no replica {args.replica!r} in {config_path(args)}")
    choice = config.sidecar.event_loop
    try:
        factory = loop_factory(choice)
    except ImportError:
        return fail(f"{config_path(args)}: sidecar.event_loop: {choice!r}: uvloop is not installed")
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(
                serve_sidecar(
                    Path(config_path(args)),
                    args.replica,
                    args.listen,
                    args.upstream,
                    spool_dir=args.spool_dir,
                    engine_metrics_listen=args.engine_metrics_listen,
                    config=config,
                )
            )
    except IdentityError as exc:
        return fail(f"cannot tell which instance this is: {exc}")
    except OtlpConfigError as exc:
        return fail(f"cannot export over OTLP: {exc}")
    return 0
