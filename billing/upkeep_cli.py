"""``infermeter billing retain``, ``backup`` and ``restore``: the ledger's upkeep from a shell.

``retain`` and ``backup`` go through the running service (admin token in
``$INFERMETER_ADMIN_TOKEN``), which alone has the ledger open, or open the file themselves with
``--database`` when it is stopped. Through the service, a backup is named, and billing writes it
under ``billing.backup_dir``. ``restore`` always works on the file, with the service
stopped: it refuses a ledger a process has open, and one that exists without ``--force``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from infermeter.commands import add_config, billing_refused, fail

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register"]


def register(actions: Any) -> None:
    """Add ``retain``, ``backup`` and ``restore`` to ``infermeter billing``'s actions."""
    retain = actions.add_parser(
        "retain", help="move raw rows past billing.retention.raw_days to the Parquet archive"
    )
    add_config(retain, nested=True)
    retain.add_argument("--database", metavar="PATH", help="this file, the service stopped")
    retain.set_defaults(handler=_retain)
    take = actions.add_parser("backup", help="snapshot the ledger into a new directory")
    add_config(take, nested=True)
    take.add_argument(
        "dest",
        metavar="DEST",
        help="through the service: the new backup's name, a directory under billing.backup_dir; "
        "with --database: a new directory; strftime fields are filled in (UTC), as in "
        "ledger-%%Y%%m%%dT%%H%%M%%SZ",
    )
    take.add_argument("--database", metavar="PATH", help="this file, the service stopped")
    take.set_defaults(handler=_backup)
    back = actions.add_parser("restore", help="replace the ledger file with a backup")
    add_config(back, nested=True)
    back.add_argument("src", metavar="SRC", help="a backup directory")
    back.add_argument("--database", metavar="PATH", help="the ledger (default: billing.database)")
    back.add_argument("--force", action="store_true", help="replace an existing ledger")
    back.set_defaults(handler=_restore)


def _print(doc: Any) -> None:
    print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())


def _retain(args: argparse.Namespace, config: Config) -> int:
    from billing import archive
    from billing.cli_common import admin_client, call, ledger_file

    r = config.billing.retention
    if args.database:
        with ledger_file(config, args.database) as ledger:
            try:
                report = archive.retain(
                    ledger, r.archive, r.raw_days, cluster=config.billing.cluster_name
                )
                _print(report.to_json())
            except archive.ArchiveError as exc:
                return fail(str(exc), code=1)
        return 0
    with admin_client(config, None) as client:
        response = call(client, "POST", "/v1/admin/retain")
    if response.status_code != 200:
        return billing_refused(response)
    _print(response.json())
    return 0


def _backup(args: argparse.Namespace, config: Config) -> int:
    from billing import backup
    from billing.cli_common import admin_client, call, ledger_file

    args.dest = time.strftime(args.dest, time.gmtime())  # a schedule's each backup a new name
    if args.database:
        with ledger_file(config, args.database) as ledger:
            try:
                manifest = backup.backup(ledger, args.dest)
            except backup.BackupError as exc:
                return fail(str(exc), code=1)
        _print({"directory": str(Path(args.dest).resolve()), **manifest})
        return 0
    with admin_client(config, None) as client:
        response = call(client, "POST", "/v1/admin/backup", params={"name": args.dest})
    if response.status_code != 200:
        return billing_refused(response)
    _print(response.json())
    return 0


def _restore(args: argparse.Namespace, config: Config) -> int:
    from billing import backup

    database = args.database or config.billing.database
    try:
        rows = backup.restore(args.src, database, force=args.force)
    except backup.BackupError as exc:
        return fail(str(exc), code=1)
    print(f"restored {database} from {args.src}: {sum(rows.values())} rows in {len(rows)} tables")
    return 0
