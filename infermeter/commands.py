"""What every subcommand shares: the ``--config`` option, the handler type and one-line errors.

Each part of the platform adds its own subcommands in its ``cli`` module with
``register(subparsers)``, and needs only this module from the command line's side. The
``infermeter`` command (``launcher.cli``) imports every part's ``cli`` module; no part imports it
back, so the packages form no cycle.

Building the parser must stay cheap (``infermeter --help`` imports every ``cli`` module), so this
module imports the configuration only for type checking and inside the one helper that needs it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = [
    "CommandError",
    "Handler",
    "Subparsers",
    "add_config",
    "billing_refused",
    "config_path",
    "fail",
    "listen_arg",
    "month_arg",
    "port_arg",
    "url_arg",
]

#: What a subcommand's parser sets as its ``handler`` default: the exit code of the command.
Handler: TypeAlias = "Callable[[argparse.Namespace, Config], int]"
#: What ``register(subparsers)`` receives: ``ArgumentParser.add_subparsers()``'s result.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CommandError(Exception):
    """A failure the user can act on: the ``infermeter`` command prints it as one line, no traceback.

    Handlers raise it (or return ``fail(...)``) for a bad argument value or a resource they
    cannot use, such as a ledger file another process holds; ``code`` is the exit code.
    """

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


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


def config_path(args: argparse.Namespace) -> str:
    """The configuration file the command runs on: ``--config``, else the default's path."""
    # The configuration is loaded before any handler runs, so this import costs nothing then.
    from infermeter.config import default_config_path

    return str(args.config or default_config_path())


def fail(message: str, code: int = 2) -> int:
    """Report ``message`` as the command's one line on stderr; ``code`` is the exit code."""
    print(f"infermeter: {message}", file=sys.stderr)
    return code


class _Answer(Protocol):
    """What ``billing_refused`` reads of an HTTP answer (an ``httpx.Response``)."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


def billing_refused(answer: _Answer) -> int:
    """Report billing's refusal of a command's request: its error message (billing answers
    OpenAI-style errors), else the start of its body; exit code 1."""
    try:
        message = answer.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = answer.text[:300]
    return fail(f"billing answered {answer.status_code}: {message}", code=1)


def listen_arg(value: str) -> str:
    """An ``argparse`` type for ``--listen``: ``HOST:PORT`` checked as the configuration checks
    it, so a port out of range is a usage error, not a traceback when the server binds."""
    from infermeter.config import listen_address

    try:
        listen_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    return value


def url_arg(value: str) -> str:
    """An ``argparse`` type for a URL option: ``http://`` or ``https://`` and a host."""
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"{value!r}: an http:// or https:// URL expected (such as http://127.0.0.1:8000)"
        )
    try:
        parts.port  # noqa: B018 (raises for a port out of range)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: the port must be from 1 to 65535") from None
    return value


def port_arg(value: str) -> int:
    """An ``argparse`` type for a port option: a number from 1 to 65535."""
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: a port from 1 to 65535 expected")
    return int(value)


def month_arg(text: str) -> str:
    """An ``argparse`` type for ``--month``: a usage error naming the value unless ``YYYY-MM``."""
    from infermeter.months import check_month

    try:
        return check_month(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
