"""``infermeter advise``: the month's recommendations, as a table for people or JSON for tools.

Like ``infermeter chargeback``, it asks the billing service with the admin token, or reads a
ledger file itself with ``--database`` (the service stopped).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import orjson

from infermeter.commands import Subparsers, add_config, fail

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register", "table"]

ADMIN_TOKEN_ENV = "INFERMETER_ADMIN_TOKEN"


def register(sub: Subparsers) -> None:
    """Add the ``advise`` subcommand."""
    advise = sub.add_parser(
        "advise",
        help="what would save GPU money, in USD/month, from the month's measured use",
        description=(
            "Right-sizing, quantization, GPU type, routing, scaling-schedule, off-peak batch and "
            "prefix-caching recommendations for a month (default: this "
            "one), each with the measured figures it rests on and its assumptions. Asks the "
            f"billing service (admin token in ${ADMIN_TOKEN_ENV}) or reads --database."
        ),
    )
    add_config(advise)
    advise.add_argument("--month", metavar="YYYY-MM", help="default: the current month (UTC)")
    advise.add_argument("--format", choices=("table", "json"), default="table")
    advise.add_argument("--database", metavar="PATH", help="read this ledger file instead")
    advise.add_argument("--billing-url", metavar="URL", help="default: billing.url")
    advise.set_defaults(handler=_advise)


def _advise(args: argparse.Namespace, config: Config) -> int:
    from infermeter.months import check_month, month_of

    month = check_month(args.month) if args.month else month_of(time.time())
    if args.database:
        report = _from_file(config, args.database, month)
    else:
        found = _from_service(config, args.billing_url, month)
        if isinstance(found, int):
            return found
        report = found
    if args.format == "json":
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(table(report))
    return 0


def _from_file(config: Config, database: str, month: str) -> dict[str, Any]:
    from billing.efficiency.store import read_report
    from billing.serve import open_ledger

    ledger = open_ledger(config, database)
    try:
        with ledger.reader() as cursor:
            report = read_report(cursor, config, month, time.time())
    finally:
        ledger.close()
    body: dict[str, Any] = orjson.loads(orjson.dumps(report.to_json()))
    return body


def _from_service(config: Config, url: str | None, month: str) -> dict[str, Any] | int:
    import httpx

    token = os.environ.get(ADMIN_TOKEN_ENV)
    if not token:
        return fail(f"set ${ADMIN_TOKEN_ENV} to the admin token (or use --database)")
    try:
        response = httpx.get(f"{(url or config.billing.url).rstrip('/')}/v1/efficiency/{month}",
                             headers={"authorization": f"Bearer {token}"}, timeout=600)  # fmt: skip
    except httpx.HTTPError as exc:
        return fail(f"billing is unreachable: {exc}", code=1)
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        return fail(f"billing answered {response.status_code}: {message}", code=1)
    body: dict[str, Any] = response.json()
    return body


def table(report: dict[str, Any]) -> str:
    """The recommendations as aligned text, largest saving first, then the total."""
    recs = report["recommendations"]
    if not recs:
        return f"{report['month']}: nothing to save from the use measured.\n"
    lines = [f"{report['month']}: {len(recs)} recommendation(s), "
             f"{report['saving_usd_per_month']:,.2f} USD/month in all", ""]  # fmt: skip
    width = max(len(r["title"]) for r in recs)
    for r in recs:
        lines.append(
            f"{r['saving_usd_per_month']:>12,.2f} USD/month  {r['title']:<{width}}  [{r['kind']}]"
        )
        evidence = ", ".join(f"{k}={_short(v)}" for k, v in r["evidence"].items())
        lines.append(f"{'':>24}evidence: {evidence}")
        lines.extend(f"{'':>24}assumes: {a}" for a in r["assumptions"])
        if r["caveat"]:
            lines.append(f"{'':>24}caveat: {r['caveat']}")
    return "\n".join(lines) + "\n"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
