"""The ``infermeter`` command: one entry point, one subcommand per part of the platform.

This module is where the parts meet: it imports each part's ``cli`` module (only the one a
command needs, ``PARTS``) and asks it to ``register`` its subcommands; ``launcher.demo`` composes
``demo`` from all of them. Every import of a part is a plain ``import`` statement inside the
function that registers it, so a reader and import-linter both see each edge, and parsing one
command still loads only its own part. Nothing imports the launcher back (the shared pieces are in
``infermeter.commands``).

Configuration is loaded here, once, and handed down; errors a user can fix (a bad config file, a
port in use, a bad argument value) end the program with a one-line message and exit code 2, and
those of the machine (a ledger file in use, a path that cannot be written) with exit code 1;
never a traceback. ``tests/launcher/test_cli_errors.py`` runs every subcommand to hold this.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING

from infermeter import __version__
from infermeter.commands import CommandError, Handler, Subparsers, config_path

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["PARTS", "build_parser", "main"]

#: Adds one part's subcommands to the parser.
Registrar = Callable[[Subparsers], None]


def _simulator(sub: Subparsers) -> None:
    from simulator import cli

    cli.register(sub, run_fleet=_run_simulated)


def _run_simulated(args: argparse.Namespace, config: Config, path: str) -> int:
    # Imported when the fleet is run: the fleet's module loads the configuration's (pydantic).
    from launcher import fleet

    return fleet.run_simulated(args, config, path)


def _sidecar(sub: Subparsers) -> None:
    from sidecar import cli

    cli.register(sub)


def _collectors(sub: Subparsers) -> None:
    from collectors import cli

    cli.register(sub)


def _demo(sub: Subparsers) -> None:
    from launcher import demo

    demo.register(sub)


def _alerts(sub: Subparsers) -> None:
    from alerts import cli

    cli.register(sub)


def _billing(sub: Subparsers) -> None:
    from billing import cli

    cli.register(sub)


def _invoices(sub: Subparsers) -> None:
    from billing import invoices_cli

    invoices_cli.register(sub)


def _autoscale(sub: Subparsers) -> None:
    from alerts.autoscale import cli

    cli.register(sub)


def _dashboards(sub: Subparsers) -> None:
    from dashboards import cli

    cli.register(sub)


def _credentials(sub: Subparsers) -> None:
    from infermeter import credentials

    credentials.register(sub)


def _keys(sub: Subparsers) -> None:
    from infermeter import keys_cli

    keys_cli.register(sub)


def _budgets(sub: Subparsers) -> None:
    from infermeter import budgets_cli

    budgets_cli.register(sub)


def _spool(sub: Subparsers) -> None:
    from infermeter import spool_cli

    spool_cli.register(sub)


# Each part's registrar and the commands it adds, in the order ``--help`` lists them: the data
# flow, then the tools that read its results. ``tests/launcher/test_cli.py`` checks the names
# against what each registrar adds.
PARTS: tuple[tuple[Registrar, tuple[str, ...]], ...] = (
    (_simulator, ("simulate",)),
    (_sidecar, ("sidecar",)),
    (_collectors, ("collect",)),
    (_demo, ("demo",)),
    (_alerts, ("alerts",)),
    (_billing, ("billing", "chargeback", "advise")),
    (_invoices, ("invoices",)),
    (_autoscale, ("autoscale",)),
    (_dashboards, ("dashboard", "plan")),
    (_credentials, ("credential",)),
    (_keys, ("keys",)),
    (_budgets, ("budgets",)),
    (_spool, ("spool",)),
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
    for register, names in PARTS:
        if command is None or command in names:
            register(sub)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names, when it names a known one first; else None (all of them)."""
    first = argv[0] if argv else ""
    return first if any(first in names for _, names in PARTS) else None


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

    seed = getattr(args, "seed", None)
    overrides = {} if seed is None else {"INFERMETER__SIMULATOR__SEED": str(seed)}
    try:
        config = load_config(args.config, overrides=overrides)
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
