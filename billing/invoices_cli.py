"""``infermeter invoices import FILE``: a cloud provider's FOCUS billing export, matched to node pools.

Like ``infermeter billing close``, it goes through the billing service with the admin or a
finance token (``$INFERMETER_ADMIN_TOKEN``), or, with ``--database``, imports into a ledger
file itself while the service is stopped. It prints the totals per month and pool, and what
no pool claimed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from billing.cli_common import ADMIN_TOKEN_ENV, admin_token
from infermeter.commands import CommandError, Subparsers, add_config, billing_refused, fail

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register", "report"]

_MEDIA = {"csv": "text/csv", "parquet": "application/vnd.apache.parquet"}


def register(sub: Subparsers) -> None:
    """Add the ``invoices`` subcommand."""
    inv = sub.add_parser(
        "invoices",
        help="import a cloud invoice (FinOps FOCUS, CSV or Parquet) matched to node pools",
        description=(
            "'import' reads a FOCUS 1.0-1.3 billing export, sums its billed cost per month and "
            "node pool (prices.pools: resource_ids, invoice_tags) and keeps it in the ledger, "
            "through the billing service (token in $INFERMETER_ADMIN_TOKEN) or into --database."
        ),
    )
    add_config(inv)
    actions = inv.add_subparsers(dest="invoices_command", metavar="ACTION", required=True)
    imp = actions.add_parser("import", help="import one file; the same file again changes nothing")
    add_config(imp, nested=True)
    imp.add_argument("file", type=Path, metavar="FILE", help="the FOCUS export (.csv or .parquet)")
    imp.add_argument("--format", choices=("csv", "parquet"), help="default: by the file's suffix")
    imp.add_argument("--include-tax", action="store_true", help="count Tax items too")
    imp.add_argument(
        "--database", metavar="PATH", help="import into this ledger file instead of the service"
    )
    imp.add_argument(
        "--billing-url", metavar="URL", help="the billing service (default: billing.url)"
    )
    imp.set_defaults(handler=_import)


def _import(args: argparse.Namespace, config: Config) -> int:
    from billing.invoices import InvoiceError, format_for

    path: Path = args.file
    try:
        fmt = format_for(path.name, args.format)
        answer = _offline(args, config, fmt) if args.database else _online(args, config, fmt)
    except InvoiceError as exc:
        return fail(exc.message, code=1)
    if isinstance(answer, int):
        return answer
    sys.stdout.write(report(answer))
    return 0


def _offline(args: argparse.Namespace, config: Config, fmt: str) -> dict[str, Any]:
    from billing import invoice_store
    from billing.cli_common import ledger_problem
    from billing.invoices import read_invoice
    from billing.ledger import LedgerError
    from billing.serve import open_ledger

    invoice = read_invoice(args.file, config.prices.pools, fmt, include_tax=args.include_tax)
    try:
        ledger = open_ledger(config, args.database)
    except LedgerError as exc:
        raise CommandError(ledger_problem(args.database, str(exc)), code=1) from None
    try:
        stored = invoice_store.import_invoice(ledger, invoice)
    finally:
        ledger.close()
    return invoice.to_json() | stored.to_json()


def _online(args: argparse.Namespace, config: Config, fmt: str) -> dict[str, Any] | int:
    import httpx

    from billing.invoices import InvoiceError

    token = admin_token()
    if not token:
        raise CommandError(
            f"set ${ADMIN_TOKEN_ENV} to an admin or finance token (or use --database)"
        )
    limit = config.billing.max_body_bytes
    try:
        size = args.file.stat().st_size
        if size > limit:
            raise InvoiceError(f"{args.file}: {size} bytes, over billing.max_body_bytes ({limit})")
        data = args.file.read_bytes()
    except OSError as exc:
        raise InvoiceError(f"{args.file}: cannot read it: {exc.strerror or exc}") from None
    params = {"format": fmt, "source": args.file.name[-256:]}
    if args.include_tax:
        params["include_tax"] = "true"
    url = args.billing_url or config.billing.url
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            response = client.post(
                "/v1/invoices",
                content=data,
                params=params,
                headers={"authorization": f"Bearer {token}", "content-type": _MEDIA[fmt]},
            )
    except httpx.HTTPError as exc:
        raise CommandError(f"billing at {url} did not answer: {exc}", code=1) from None
    if response.status_code != 200:
        return billing_refused(response)
    found: dict[str, Any] = response.json()
    return found


def report(answer: dict[str, Any]) -> str:
    """The import's answer for people: a line per (month, pool), then what was left out."""
    lines = [f"{answer['source']}: {answer['rows']} line items (sha256 {answer['sha256'][:12]})"]
    lines.append(f"{'month':<8} {'pool':<24} {'billed USD':>14} {'items':>8}")
    for t in answer["totals"]:
        lines.append(
            f"{t['month']:<8} {t['pool']:<24} {_usd(t['billed_cents']):>14} {t['line_items']:>8}"
        )
    for name, key in (("claimed by no pool", "unmatched"), ("tax, not counted", "excluded")):
        left = answer[key]
        if left["line_items"]:
            lines.append(f"{name}: {left['line_items']} items, {_usd(left['billed_cents'])} USD")
            for s in left["by_service_category"][:10]:
                lines.append(
                    f"  {s['service_category'] or '(no ServiceCategory)'}: "
                    f"{s['line_items']} items, {_usd(s['billed_cents'])} USD"
                )
    if answer["unchanged"]:
        lines.append("unchanged: the ledger already holds this file's totals")
    else:
        lines.append(f"kept {len(answer['changed'])} (month, pool) rows")
    if answer["dirty_months"]:
        lines.append(
            f"closed months changed (adjusted on the next statement): "
            f"{', '.join(answer['dirty_months'])}"
        )
    return "\n".join(lines) + "\n"


def _usd(cents: int) -> str:
    sign = "-" if cents < 0 else ""
    return f"{sign}{abs(cents) // 100:,}.{abs(cents) % 100:02d}"
