"""``infermeter budgets list|override|revoke``: the teams' budgets and the admin's overrides.

A client of billing's API, run with the admin token in ``$INFERMETER_TOKEN`` (else
``$INFERMETER_ADMIN_TOKEN``): ``override`` lets a team past its monthly budget for a while and
``revoke`` takes that back (a grant of 0 minutes: per team the last grant decides), both
through ``POST /v1/admin/budget-overrides``, so every sidecar applies them at its next spend
refresh and both are on the audit trail; ``list`` prints each team's spend, budget and last
override from ``GET /v1/spend``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from infermeter.admin_calls import TOKEN_ENVS, action, admin_command, call, shown, stamp, token
from infermeter.commands import Subparsers
from infermeter.keys_cli import parse_duration
from infermeter.overrides import grant_state

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["override_state", "register"]

_ROUTE = "/v1/admin/budget-overrides"


def register(subparsers: Subparsers) -> None:
    """Add ``budgets`` and its actions."""
    actions = admin_command(
        subparsers,
        "budgets",
        "list the teams' budgets; let a team past its budget for a while, or revoke that",
        "The teams' month-to-date spend against their budgets, and the admin's overrides "
        "(billing's /v1/admin/budget-overrides: every sidecar applies one at its next spend "
        f"refresh). Runs with the admin token in ${TOKEN_ENVS[0]} (else ${TOKEN_ENVS[1]}).",
        _budgets,
    )
    action(actions, "list", "each team's spend, budget and last override")
    grant = action(actions, "override", "let a team past its budget for a while")
    grant.add_argument("--team", required=True)
    grant.add_argument(
        "--for",
        dest="duration",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="how long (90m, 12h, 7d; at most a month)",
    )
    grant.add_argument("--reason", required=True, help="why, for the ledger and the audit trail")
    revoke = action(actions, "revoke", "end a team's override now")
    revoke.add_argument("--team", required=True)
    revoke.add_argument("--reason", required=True, help="why, for the ledger and the audit trail")


def _budgets(args: argparse.Namespace, config: Config) -> int:
    bearer = token("the admin token")
    url = (args.billing_url or config.billing.url).rstrip("/")
    if args.action == "list":
        _table(call(url, bearer, "GET", "/v1/spend"), time.time())
        return 0
    minutes = args.duration / 60 if args.action == "override" else 0
    body = {"team": args.team, "minutes": minutes, "reason": args.reason}
    granted = call(url, bearer, "POST", _ROUTE, body)
    if args.action == "override":
        what = f"may pass its budget until {stamp(granted['until'])}"
    else:
        what = "has no override from now on"
    print(
        f"team {granted['team']} {what}: every sidecar applies it at its next spend refresh "
        f"(override {granted['override_id']})",
        file=sys.stderr,
    )
    return 0


def override_state(row: dict[str, Any], now: float) -> str:
    """What a spend row's last override means at ``now``: ``until <end>`` while in force,
    ``revoked <when>`` for a revocation, ``ended <when>`` for one that ran out, ``-`` for none."""
    state = grant_state(row.get("override"), now)
    return "-" if state is None else f"{state[0]} {stamp(state[1])}"


def _table(rows: list[dict[str, Any]], now: float) -> None:
    columns = ("team", "spent_usd", "budget_usd", "used", "override", "reason")
    lines = [
        [
            row["team"],
            f"{row['spent_usd']:.2f}",
            f"{row['budget_usd']:.2f}" if row.get("budget_usd") else "-",
            f"{100 * row['spent_usd'] / row['budget_usd']:.1f}%" if row.get("budget_usd") else "-",
            override_state(row, now),
            shown((row.get("override") or {}).get("reason")),
        ]
        for row in rows
    ]
    widths = [max([len(c)] + [len(r[i]) for r in lines]) for i, c in enumerate(columns)]
    for line in [list(columns), *lines]:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
