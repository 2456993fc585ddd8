"""What billing's commands share: the ledger file opened for a command, the admin's client.

The commands that read or change the ledger go through the running service with the admin token
(``$INFERMETER_ADMIN_TOKEN``), or open the file themselves with ``--database`` when it is
stopped. ``billing.cli`` registers them and ``billing.upkeep_cli`` adds the upkeep actions below
it: both take these helpers from here, so neither imports the other back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from infermeter.commands import CommandError

if TYPE_CHECKING:
    import httpx

    from billing.ledger import Ledger
    from infermeter.config import Config

__all__ = [
    "ADMIN_TOKEN_ENV",
    "admin_client",
    "admin_token",
    "call",
    "ledger_file",
    "ledger_problem",
]

ADMIN_TOKEN_ENV = "INFERMETER_ADMIN_TOKEN"
_LOCK_HOLDER = re.compile(r"\(PID (\d+)\)")


def ledger_problem(path: str, reason: str) -> str:
    """What to tell the user when the ledger file at ``path`` cannot be opened for ``reason``.

    DuckDB lets one process hold a file; the usual holder is the billing service itself.
    """
    if "lock" not in reason.lower():
        return reason
    holder = _LOCK_HOLDER.search(reason)
    pid = f" (PID {holder.group(1)})" if holder else ""
    return (
        f"the ledger {path} is in use by another process{pid}, most likely the billing service: "
        "leave out --database to go through the service, or stop it first"
    )


@contextmanager
def ledger_file(config: Config, database: str) -> Iterator[Ledger]:
    """The ledger file, open for the block; a file that cannot be opened is a one-line error.

    Every command that reads ``--database`` works on a ledger billing has kept: a path with no
    file is refused (a mistyped path would otherwise be made a new, empty ledger and read as
    a month with nothing in it)."""
    from billing.ledger import LedgerError
    from billing.serve import open_ledger

    if not Path(database).is_file():
        raise CommandError(
            f"no ledger file at {database} (--database): give the file billing keeps "
            "(billing.database), with the service stopped",
            code=2,
        )
    try:
        ledger = open_ledger(config, database)
    except LedgerError as exc:
        raise CommandError(ledger_problem(database, str(exc)), code=1) from None
    try:
        yield ledger
    finally:
        ledger.close()


def admin_token() -> str | None:
    """The token a command sends billing (``$INFERMETER_ADMIN_TOKEN``); None when it is not set."""
    from infermeter.config import env_value

    return env_value(ADMIN_TOKEN_ENV)


def admin_client(config: Config, url: str | None) -> httpx.Client:
    """A client for billing at ``url`` (else ``billing.url``) with the admin token."""
    import httpx

    token = admin_token()
    if not token:
        raise CommandError(f"set ${ADMIN_TOKEN_ENV} to the admin token (or use --database)")
    return httpx.Client(
        base_url=url or config.billing.url,
        timeout=600,
        headers={"authorization": f"Bearer {token}"},
    )


def call(
    client: httpx.Client, method: str, path: str, params: dict[str, str] | None = None
) -> httpx.Response:
    """One request to billing; an unreachable service is a one-line error."""
    import httpx

    try:
        return client.request(method, path, params=params)
    except httpx.HTTPError as exc:
        raise CommandError(f"billing at {client.base_url} did not answer: {exc}", code=1) from None
