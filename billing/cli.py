"""``infermeter billing`` (the service, month closing, Parquet export) and ``infermeter chargeback``.

The service owns the ledger file, so the commands that read or change it go through its API
with the admin token (``$INFERMETER_ADMIN_TOKEN``). With ``--database`` they open the file
themselves instead, for when the service is stopped (a backup, an offline statement).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from billing import upkeep_cli
from billing.cli_common import ADMIN_TOKEN_ENV, admin_client, call, ledger_file, ledger_problem
from billing.efficiency import cli as efficiency_cli
from infermeter.commands import (
    CommandError,
    Subparsers,
    add_config,
    billing_refused,
    fail,
    listen_arg,
    month_arg,
)

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    """Add the ``billing`` and ``chargeback`` subcommands."""
    bill = sub.add_parser(
        "billing",
        help="run the billing service (DuckDB ledger, ingest and statements API)",
        description=(
            "Without a subcommand: serve the billing API on billing.listen, owning the ledger file "
            "billing.database. 'close' freezes a month's statement; 'export' writes the ledger "
            "to Parquet."
        ),
    )
    add_config(bill)
    bill.add_argument(
        "--listen",
        type=listen_arg,
        metavar="HOST:PORT",
        help="where to listen (default: billing.listen)",
    )
    bill.add_argument(
        "--database", metavar="PATH", help="the ledger file (default: billing.database)"
    )
    bill.set_defaults(handler=_serve)
    actions = bill.add_subparsers(dest="billing_command", metavar="ACTION")
    close = actions.add_parser("close", help="close a month: its statement is frozen from then on")
    add_config(close, nested=True)
    close.add_argument("--month", required=True, metavar="YYYY-MM", type=month_arg)
    close.add_argument(
        "--database", metavar="PATH", help="close in this file instead of through the service"
    )
    close.set_defaults(handler=_close)
    export = actions.add_parser("export", help="write every ledger table to Parquet (a backup)")
    add_config(export, nested=True)
    export.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory to write")
    export.add_argument(
        "--partitioned", action="store_true", help="raw tables as Hive partitions by month"
    )
    export.add_argument(
        "--database", metavar="PATH", help="export this file (the service must be stopped)"
    )
    export.set_defaults(handler=_export)
    upkeep_cli.register(actions)

    cb = sub.add_parser(
        "chargeback",
        help="write a month's chargeback statement as CSV or FinOps FOCUS",
        description=(
            "Fetch a month's statement from the billing service (admin token in "
            f"${ADMIN_TOKEN_ENV}) or compute it from a ledger file (--database), and write it "
            "as the chargeback CSV or a FOCUS file."
        ),
    )
    add_config(cb)
    cb.add_argument("--month", required=True, metavar="YYYY-MM", type=month_arg)
    cb.add_argument("--format", choices=("csv", "focus"), default="csv")
    cb.add_argument("--focus-version", choices=("1.0", "1.2", "1.3"), default="1.0")
    cb.add_argument("--out", type=Path, metavar="FILE", help="write here instead of stdout")
    cb.add_argument(
        "--database", metavar="PATH", help="read this ledger file instead of the service"
    )
    cb.add_argument(
        "--billing-url", metavar="URL", help="the billing service (default: billing.url)"
    )
    cb.set_defaults(handler=_chargeback)
    efficiency_cli.register(sub)


def _serve(args: argparse.Namespace, config: Config) -> int:
    import asyncio

    from billing.ledger import LedgerError
    from billing.serve import serve_billing
    from infermeter.commands import config_path
    from infermeter.otlp import OtlpConfigError
    from infermeter.writers import WriterError

    try:
        asyncio.run(serve_billing(config, args.listen, args.database, Path(config_path(args))))
    except LedgerError as exc:
        raise CommandError(
            ledger_problem(args.database or config.billing.database, str(exc)), code=1
        ) from None
    except OtlpConfigError as exc:
        raise CommandError(f"cannot export metrics over OTLP: {exc}", code=2) from None
    except WriterError as exc:
        raise CommandError(str(exc), code=2) from None
    return 0


def _close(args: argparse.Namespace, config: Config) -> int:
    month = args.month
    if args.database:
        from billing.chargeback import Chargeback
        from billing.ledger import LedgerError

        with ledger_file(config, args.database) as ledger:
            try:
                statement = Chargeback(ledger, config).close(month)
            except LedgerError as exc:
                return fail(str(exc), code=1)
        print(f"closed {month}: {statement.total_cents / 100:.2f} {config.prices.currency}")
        return 0
    with admin_client(config, None) as client:
        response = call(client, "POST", f"/v1/months/{month}/close")
    if response.status_code != 200:
        return billing_refused(response)
    print(f"closed {month}: {response.json()['total_cents'] / 100:.2f} {config.prices.currency}")
    return 0


def _export(args: argparse.Namespace, config: Config) -> int:
    from tqdm import tqdm

    from billing import parquet_export

    if not args.database:
        return fail(
            "export reads the ledger file; stop the service and pass --database, "
            "or POST /v1/admin/export to the running service"
        )
    with ledger_file(config, args.database) as ledger:
        tables = parquet_export.table_names(ledger)
        for table in tqdm(tables, desc="export", unit="table", disable=None):
            parquet_export.export_table(ledger, table, args.out, args.partitioned)
    print(f"wrote {len(tables)} tables to {args.out}")
    return 0


def _chargeback(args: argparse.Namespace, config: Config) -> int:
    month = args.month
    suffix = "csv" if args.format == "csv" else "focus.csv"
    if args.database:
        text = _statement_text(config, args.database, month, args.format, args.focus_version)
        if not _has_lines(text):
            from billing import closing

            with ledger_file(config, args.database) as ledger:
                known = [m["month"] for m in closing.months(ledger)]
            _warn_empty(month, known)
    else:
        with admin_client(config, args.billing_url) as client:
            params = {"version": args.focus_version} if args.format == "focus" else {}
            response = call(client, "GET", f"/v1/chargeback/{month}.{suffix}", params)
            if response.status_code != 200:
                return billing_refused(response)
            text = response.text
            if not _has_lines(text):
                months = call(client, "GET", "/v1/months")
                known = [m["month"] for m in months.json()] if months.status_code == 200 else []
                _warn_empty(month, known)
    if args.out:
        try:
            args.out.write_text(text)
        except OSError as exc:
            return fail(f"cannot write {args.out}: {exc.strerror or exc}", code=1)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _has_lines(text: str) -> bool:
    """Whether a chargeback CSV or FOCUS file has a line besides the chargeback CSV's total."""
    import csv
    import io

    return any(row.get("line_type") != "total" for row in csv.DictReader(io.StringIO(text)))


def _warn_empty(month: str, known: list[str]) -> None:
    """Say on stderr that ``month`` has no data, so a mistyped month does not pass for zero."""
    where = (
        f"months with data: {', '.join(known)}" if known else "the ledger has no month with data"
    )
    print(
        f"warning: {month} has no usage or GPU time in the ledger, so every figure in this "
        f"statement is zero; is it the month you meant? ({where})",
        file=sys.stderr,
    )


def _statement_text(config: Config, database: str, month: str, fmt: str, version: str) -> str:
    from tqdm import tqdm

    from billing.breakdown import with_tags
    from billing.chargeback import Chargeback
    from exporters.chargeback_csv import chargeback_frame, write_csv
    from exporters.focus import focus_frame

    with tqdm(total=3, desc=f"chargeback {month}", unit="step", disable=None) as bar:
        with ledger_file(config, database) as ledger:
            bar.update()
            chargeback = Chargeback(ledger, config)
            statement = chargeback.statement(month)
            if fmt != "csv" or config.prices.pools:  # the CSV names each line's node pools
                statement = chargeback.by_instance(statement)
            statement = with_tags(ledger, statement, config)  # projects and end users
        bar.update()
        budgets = {t.name: t.budget_usd_per_month for t in config.teams}
        frame = (
            chargeback_frame(statement, budgets)
            if fmt == "csv"
            else focus_frame(statement, config, version)
        )
        bar.update()
    return write_csv(frame)
