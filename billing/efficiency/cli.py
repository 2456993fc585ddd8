"""``infermeter advise``: the month's plan, as a table for people or JSON for tools.

Like ``infermeter chargeback``, it asks the billing service with the admin token, or reads a
ledger file itself with ``--database`` (the service stopped).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

import orjson

from billing.cli_common import ADMIN_TOKEN_ENV, admin_token
from infermeter.commands import Subparsers, add_config, billing_refused, fail, month_arg, url_arg

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["register", "table"]


def register(sub: Subparsers) -> None:
    """Add the ``advise`` subcommand."""
    advise = sub.add_parser(
        "advise",
        help="what would save GPU money, in USD/month, from the month's measured use",
        description=(
            "One plan for a month (default: this one): engines by the hour, batch size, precision, "
            "GPU type, routing, off-peak batch work and prefix caching, each change proven by "
            "replaying the month's requests through the engine model and priced within the "
            "plan, with the figures and replay it rests on. Asks the billing service (admin "
            f"token in ${ADMIN_TOKEN_ENV}) or reads --database."
        ),
    )
    add_config(advise)
    advise.add_argument(
        "--month", metavar="YYYY-MM", type=month_arg, help="default: the current month (UTC)"
    )
    advise.add_argument("--format", choices=("table", "json"), default="table")
    advise.add_argument("--database", metavar="PATH", help="read this ledger file instead")
    advise.add_argument("--billing-url", metavar="URL", type=url_arg, help="default: billing.url")
    advise.set_defaults(handler=_advise)


def _advise(args: argparse.Namespace, config: Config) -> int:
    from infermeter.months import month_of

    month = args.month or month_of(time.time())
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
    from billing.cli_common import ledger_file
    from billing.efficiency.store import read_report

    with ledger_file(config, database) as ledger, ledger.reader() as cursor:
        report = read_report(cursor, config, month, time.time())
    body: dict[str, Any] = orjson.loads(orjson.dumps(report.to_json()))
    return body


def _from_service(config: Config, url: str | None, month: str) -> dict[str, Any] | int:
    import httpx

    token = admin_token()
    if not token:
        return fail(f"set ${ADMIN_TOKEN_ENV} to the admin token (or use --database)")
    try:
        response = httpx.get(
            f"{(url or config.billing.url).rstrip('/')}/v1/efficiency/{month}",
            headers={"authorization": f"Bearer {token}"},
            timeout=600,
        )
    except httpx.HTTPError as exc:
        return fail(f"billing is unreachable: {exc}", code=1)
    if response.status_code != 200:
        return billing_refused(response)
    body: dict[str, Any] = response.json()
    return body


def table(report: dict[str, Any]) -> str:
    """The plan as aligned text: each change, largest saving first, with its replay, then notes."""
    recs, plan = report["recommendations"], report.get("plan", {})
    lines: list[str] = []
    if not recs:
        lines.append(f"{report['month']}: nothing to save from the use measured.")
    else:
        lines += [
            f"{report['month']}: one plan of {len(recs)} change{'s' * (len(recs) != 1)}, "
            f"{report['saving_usd_per_month']:,.2f} USD/month ({plan.get('saving_usd', 0):,.2f} USD "
            f"over the {plan.get('hours_measured', 0)} hours measured, of "
            f"{plan.get('measured_usd', 0):,.2f} USD they cost)",
            "",
        ]
        width = max(len(r["title"]) for r in recs)
        for r in recs:
            lines.append(
                f"{r['saving_usd_per_month']:>12,.2f} USD/month  {r['title']:<{width}}  [{r['kind']}]"
            )
            lines += _details(r)
    notes = report.get("notes", [])
    if notes:
        lines += ["", "not advised:"] + [f"  {n['text']}" for n in notes]
    return "\n".join(lines) + "\n"


def _details(r: dict[str, Any]) -> list[str]:
    """A recommendation's change, evidence, replay, assumptions, policy change and caveat."""
    pad = " " * 24
    out = [f"{pad}change: " + ", ".join(f"{k}={_short(v)}" for k, v in r["change"].items())]
    out.append(f"{pad}evidence: " + ", ".join(f"{k}={_short(v)}" for k, v in r["evidence"].items()))
    for model, rep in r.get("replay", {}).items():
        out.append(
            f"{pad}replay {model}: GPU-hours {rep['gpu_hours_before']:,.1f} -> "
            f"{rep['gpu_hours_after']:,.1f}, cost {rep['cost_usd_before']:,.2f} -> "
            f"{rep['cost_usd_after']:,.2f} USD"
        )
        for before, after in zip(rep["sla_before"], rep["sla_after"], strict=False):
            out.append(
                f"{pad}  {after['team']} TTFT p95 {_s(before['ttft_p95_s'])} -> "
                f"{_s(after['ttft_p95_s'])} s (target {_s(after['ttft_target_s'])}), "
                f"inter-token p95 {_s(before['itl_p95_s'])} -> {_s(after['itl_p95_s'])} s "
                f"(target {_s(after['itl_target_s'])})"
            )
    out += [f"{pad}assumes: {a}" for a in r["assumptions"]]
    if r.get("policy_change"):
        out.append(
            f"{pad}policy change: " + ", ".join(f"{k}={v}" for k, v in r["policy_change"].items())
        )
    if r["caveat"]:
        out.append(f"{pad}caveat: {r['caveat']}")
    return out


def _s(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and len(value) == 24 and len(set(value)) == 1:
        return f"{value[0]} every hour"
    return str(value)
