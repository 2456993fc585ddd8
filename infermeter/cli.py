"""The ``infermeter`` command: one entry point, one subcommand per part of the platform.

This module is where the parts meet: it imports each part's ``cli`` module (only the one a
command needs, ``PARTS``) and asks it to ``register`` its subcommands, and composes ``demo`` from
all of them. Nothing imports it back
(the shared pieces are in ``infermeter.commands``).

Configuration is loaded here, once, and handed down; errors a user can fix (a bad config file, a
port in use, a bad argument value) end the program with a one-line message and exit code 2, and
those of the machine (a ledger file in use, a path that cannot be written) with exit code 1;
never a traceback. ``tests/infermeter/test_cli_errors.py`` runs every subcommand to hold this.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

from infermeter import __version__
from infermeter.commands import CommandError, Handler, Subparsers, add_config, config_path
from infermeter.writers import DEMO_SECRET

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["build_parser", "main"]

DEMO_METRICS_TOKEN = "im-demo-metrics"  # public, like the demo team keys
DEMO_SPEND_TOKEN = "im-demo-spend"  # the sidecars' spend_reader token, public too
# What the demo's writer credentials are derived from (``infermeter.writers.DEMO_SECRET``): public
# too, and given only to billing and the autoscaler (``infermeter.fleet.with_writer_credentials``).
DEMO_WRITER_SECRET = DEMO_SECRET.decode()


# Each part's ``cli`` module and the commands its ``register`` adds, in the order ``--help``
# lists them: the data flow, then the tools that read its results (``demo`` is this module's).
# ``tests/infermeter/test_cli.py`` checks the names against what each module registers.
PARTS: tuple[tuple[str | None, tuple[str, ...]], ...] = (
    ("simulator.cli", ("simulate",)),
    ("sidecar.cli", ("sidecar",)),
    ("collectors.cli", ("collect",)),
    (None, ("demo",)),
    ("alerts.cli", ("alerts",)),
    ("billing.cli", ("billing", "chargeback", "advise")),
    ("billing.invoices_cli", ("invoices",)),
    ("alerts.autoscale.cli", ("autoscale",)),
    ("dashboards.cli", ("dashboard", "plan")),
    ("infermeter.credentials", ("credential",)),
    ("infermeter.keys_cli", ("keys",)),
    ("infermeter.spool_cli", ("spool",)),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser, with every subcommand and its help text.

    With ``command`` (one of ``PARTS``' names), only the part that registers it: a sidecar, one
    process in every vLLM pod, then loads no other part's command-line module (about 0.9 MB
    of its memory, for as long as it runs).
    """
    parser = argparse.ArgumentParser(
        prog="infermeter",
        description="Observability and cost chargeback for GPU inference fleets that serve vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"infermeter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module, names in PARTS:
        if command is not None and command not in names:
            continue
        if module is None:
            _register_demo(sub)
        else:
            importlib.import_module(module).register(sub)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names, when it names a known one first; else None (all of them)."""
    first = argv[0] if argv else ""
    return first if any(first in names for _, names in PARTS) else None


def _register_demo(subparsers: Subparsers) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="run the whole platform on a simulated fleet, with traffic",
        description=(
            "The simulated fleet, a sidecar in front of every replica, the collector, the billing "
            "service with its DuckDB ledger, the dashboard, the autoscaler (starting and stopping "
            "simulated instances on spare GPUs as demand changes), and traffic from several "
            "teams through the sidecars, all on loopback. Ctrl-C stops everything."
        ),
    )
    add_config(demo)
    demo.add_argument("--peak-rps", type=float, default=6.0, help="requests/s at the morning peak")
    demo.add_argument(
        "--day-seconds", type=float, default=600.0, help="wall seconds per simulated day"
    )
    demo.add_argument(
        "--front-door",
        default="127.0.0.1:18100",
        metavar="HOST:PORT",
        help="where vLLM's router serves every model (the one base URL; default %(default)s)",
    )
    demo.add_argument(
        "--front-door-metrics-port",
        type=int,
        default=18190,
        metavar="PORT",
        help="where the router serves its own metrics (default %(default)s)",
    )
    demo.set_defaults(handler=_demo)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, load the configuration, run the subcommand."""
    if argv is None:
        # SIGTERM (what Kubernetes and the supervisor send) becomes SystemExit, so every
        # ``finally`` runs: uvicorn shuts down gracefully on it, then re-raises the signal, which
        # with the default action would kill the process before the code after ``serve()``.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = build_parser(_command(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    # Imported once the arguments are parsed: pydantic and uvicorn are most of the command's
    # start-up time, and ``--help`` or a usage error needs neither.
    from infermeter.config import ConfigError, load_config
    from infermeter.serving import PortInUseError

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
    except CommandError as exc:
        print(f"infermeter: {exc}", file=sys.stderr)
        return exc.code
    except OSError as exc:
        # A file or directory the command was pointed at that cannot be used: the user's to fix.
        where = f": {exc.filename}" if exc.filename else ""
        print(f"infermeter: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _refuse_public_keys(args: argparse.Namespace, config: Config) -> None:
    """Warn on the demo configuration; refuse public key hashes on a reachable address."""
    from infermeter import exposure
    from infermeter.config import ConfigError, default_config_path

    warning = exposure.fallback_warning(args.command, args.config, default_config_path())
    if warning:
        print(warning, file=sys.stderr)
    if args.command != "simulate":  # the simulator checks no keys; everything else does
        problems = exposure.public_key_problems(config, getattr(args, "listen", None))
        if problems:
            raise ConfigError(config_path(args), problems)


def _demo(args: argparse.Namespace, config: Config) -> int:
    from infermeter import fleet

    path = config_path(args)
    args.via_sidecars = True
    args.duration = None
    # Sidecars, the collector and the autoscaler (each change of a model's desired count, for the
    # Fleet page) ship to the demo's billing service, each with a writer credential of its own
    # (the shared ingest token is not taken: the demo is a new installation); a user's own
    # settings win.
    ingest = f"{config.billing.url.rstrip('/')}/v1/ingest"
    os.environ.setdefault("INFERMETER__SIDECAR__INGEST_URL", config.sidecar.ingest_url or ingest)
    os.environ.setdefault(
        "INFERMETER__COLLECTOR__INGEST_URL", config.collector.ingest_url or ingest
    )
    os.environ.setdefault(
        "INFERMETER__AUTOSCALE__INGEST_URL", config.autoscale.ingest_url or ingest
    )
    # The collector ships what a sidecar that is gone left in its spool: the records of an
    # instance the autoscaler stopped, or of a sidecar killed before it shipped them.
    os.environ.setdefault(
        "INFERMETER__COLLECTOR__ADOPT_SPOOLS_DIR",
        config.collector.adopt_spools_dir or config.sidecar.spool_dir,
    )
    # The autoscaler reads the collector's and the sidecars' /metrics with the demo's reader key.
    os.environ.setdefault(config.autoscale.metrics_token_env, DEMO_METRICS_TOKEN)
    # The sidecars read spend and the keys issued at run time with the spend_reader token, not
    # the admin's (the ones the autoscaler starts inherit it too).
    os.environ.setdefault(config.sidecar.budgets.spend_token_env, DEMO_SPEND_TOKEN)
    # Spare GPUs on every node, for the instances the autoscaler starts (every child must agree).
    for key, value in fleet.spare_gpu_overrides(config).items():
        os.environ.setdefault(key, value)
    children = [fleet.billing_child(config, path)]
    children += fleet.simulator_children(config, path) + fleet.sidecar_children(config, path)
    # One base URL for every model: vLLM's router in front of the sidecars.
    children.append(fleet.front_door_child(path, args.front_door, args.front_door_metrics_port))
    children.append(fleet.collector_child(config, path))
    children.append(fleet.dashboard_child(config, path))
    children.append(fleet.autoscaler_child(config, path, args.day_seconds))
    children.append(fleet.traffic_child(path, args))
    secret = os.environ.get(config.billing.writer_secret_env) or DEMO_WRITER_SECRET
    children = fleet.with_writer_credentials(children, config, secret.encode())
    urls = [("front door: every model (OpenAI API)", f"http://{args.front_door}/v1")]
    urls += fleet.sidecar_urls(config) + fleet.simulator_urls(config)
    fleet_view = f"http://{config.collector.listen}/metrics"
    urls.append(("collector (fleet view) (metrics: im-demo-metrics)", fleet_view))
    urls.append(("billing API (admin: im-demo-admin)", f"{config.billing.url}/v1/spend"))
    urls.append(("dashboard (sign in: im-demo-admin)", f"http://{config.dashboard.listen}/"))
    urls.append(("autoscaler (desired replicas)", f"http://{config.autoscale.listen}/metrics"))
    keys = demo_team_keys(config)
    if keys:
        urls.append(("team keys (API and dashboard)", ", ".join(keys)))
    return fleet.run(children, urls)


def demo_team_keys(config: Config) -> list[str]:
    """The public demo keys (``im-demo-<team>``) that this configuration accepts, team by team."""
    from infermeter.config import hash_key

    return [
        f"im-demo-{t.name}"
        for t in config.teams
        if hash_key(f"im-demo-{t.name}") in t.api_key_sha256
    ]
