"""What the admin's commands share: the token from the environment, and billing called with it.

``infermeter keys`` and ``infermeter budgets`` are clients of billing's admin API, run with the
admin token (or a team lead's key) in ``$INFERMETER_TOKEN``, else ``$INFERMETER_ADMIN_TOKEN``.
A refusal or an unreachable billing is a ``CommandError``: one line, billing's own message.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Final

from infermeter.commands import CommandError, Handler, Subparsers, add_config, url_arg

__all__ = ["TOKEN_ENVS", "action", "admin_command", "call", "shown", "stamp", "token"]

TOKEN_ENVS: Final = ("INFERMETER_TOKEN", "INFERMETER_ADMIN_TOKEN")
# Numbers above this (2000-01-01) in a listing are times, printed as such.
_EPOCH_2000: Final = 946684800


def admin_command(
    subparsers: Subparsers, name: str, help_text: str, description: str, handler: Handler
) -> Subparsers:
    """Add command ``name`` (``--config``, ``--billing-url``, ``handler``) and return its
    actions' subparsers: each action added to it takes ``--config`` too (``action``)."""
    cmd = subparsers.add_parser(name, help=help_text, description=description)
    add_config(cmd)
    cmd.add_argument("--billing-url", type=url_arg, help="billing's URL (default: billing.url)")
    cmd.set_defaults(handler=handler)
    return cmd.add_subparsers(dest="action", metavar="ACTION", required=True)


def action(actions: Subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    """Add action ``name`` to an ``admin_command``'s actions, with ``--config``."""
    parser = actions.add_parser(name, help=help_text)
    add_config(parser, nested=True)
    return parser


def token(who: str = "the admin token or a team lead's key") -> str:
    """The token from the first of ``TOKEN_ENVS`` that is set; CommandError naming ``who``."""
    from infermeter.config import env_value

    found = next((t for v in TOKEN_ENVS if (t := env_value(v))), None)
    if found is None:
        raise CommandError(f"set ${TOKEN_ENVS[0]} to {who}")
    return found


def call(url: str, bearer: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """Billing's JSON answer to ``method path`` (with ``body``), made with ``bearer``."""
    import httpx

    try:
        answer = httpx.request(
            method, url + path, json=body, timeout=30, headers={"authorization": f"Bearer {bearer}"}
        )
    except httpx.HTTPError as exc:
        raise CommandError(f"billing at {url} did not answer: {exc}", code=1) from None
    if answer.status_code >= 400:
        try:
            message = answer.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = answer.text[:200]
        raise CommandError(f"billing refused: HTTP {answer.status_code}: {message}")
    return answer.json()


def shown(value: Any) -> str:
    """A listing's cell: ``-`` for nothing, a time as ``2026-12-07T14:03Z``, else the value."""
    if value is None:
        return "-"
    if isinstance(value, float) and value > _EPOCH_2000:
        return stamp(value)
    return str(value)


def stamp(t: float) -> str:
    """A Unix time as ``2026-12-07T14:03Z`` (UTC)."""
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(t))
