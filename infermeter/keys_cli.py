"""``infermeter keys create|list|revoke|rotate|signer``: keys issued at run time, through billing's API.

The command is a client of ``/v1/keys`` (billing keeps the keys, ``billing.keys``), run with the
admin token or a team lead's key in ``$INFERMETER_TOKEN`` (else ``$INFERMETER_ADMIN_TOKEN``). A
new key's secret is printed once, alone on stdout, so a script can take it
(``KEY=$(infermeter keys create --team search)``); what it is for goes to stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING, Any, Final

from infermeter.admin_calls import TOKEN_ENVS, action, admin_command, call, shown, token
from infermeter.commands import CommandError, Subparsers

if TYPE_CHECKING:
    from infermeter.config import Config

__all__ = ["parse_duration", "register"]

_DURATION: Final = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)$")
_UNITS: Final = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``12h``, ``30d`` or ``2w``; ArgumentTypeError else."""
    found = _DURATION.match(text.strip())
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 3600, 15m, 12h, 30d or 2w")
    return float(found.group(1)) * _UNITS[found.group(2)]


def register(subparsers: Subparsers) -> None:
    """Add ``keys`` and its actions."""
    actions = admin_command(
        subparsers,
        "keys",
        "issue, list, rotate and revoke API keys at run time (billing's /v1/keys)",
        "Manage the API keys billing issues at run time: per team, with an optional member, "
        "project, expiry, limits and budget. Runs with the admin token, or a team lead's key, "
        f"in ${TOKEN_ENVS[0]} (else ${TOKEN_ENVS[1]}). A new key is printed once.",
        _keys,
    )
    create = action(actions, "create", "issue a key; its secret is printed once")
    create.add_argument("--team", help="the team the key is for (member and lead keys)")
    create.add_argument(
        "--role", default="member", choices=("member", "lead", "finance", "viewer", "spend_reader")
    )
    create.add_argument("--member", help="who in the team holds it (a label)")
    create.add_argument("--project", help="what it is for (a label)")
    create.add_argument(
        "--expires-in",
        type=parse_duration,
        metavar="DURATION",
        help="it stops working after this (15m, 12h, 30d); default: never",
    )
    create.add_argument("--requests-per-minute", type=int, metavar="N")
    create.add_argument("--tokens-per-minute", type=int, metavar="N")
    create.add_argument("--max-concurrent", type=int, metavar="N")
    create.add_argument(
        "--budget-usd", type=float, metavar="USD", help="a monthly budget of its own"
    )
    create.add_argument("--reason", default="", help="why, for the audit trail")
    action(
        actions,
        "signer",
        "print billing's public key for the issued keys' set in Redis, from the writer "
        "secret (for sidecar.shared_limits.key_signer)",
    )
    listing = action(actions, "list", "the keys you manage (never a secret)")
    listing.add_argument("--revoked", action="store_true", help="revoked keys too")
    for name, text in (
        ("revoke", "revoke a key now"),
        ("rotate", "issue a key in place of another; the new secret is printed"),
    ):
        one = action(actions, name, text)
        one.add_argument("key_id", metavar="KEY_ID")
        one.add_argument("--reason", default="", help="why, for the audit trail")
        if name == "rotate":
            one.add_argument(
                "--grace",
                type=parse_duration,
                default=0.0,
                metavar="DURATION",
                help="how long the old key keeps working (at most 7d)",
            )


def _keys(args: argparse.Namespace, config: Config) -> int:
    # Imported with the handler: building the parser (`infermeter --help`) loads no pydantic.
    from infermeter.config import env_value

    if args.action == "signer":
        return _signer(
            env_value(config.billing.writer_secret_env), config.billing.writer_secret_env
        )
    bearer = token()
    url = (args.billing_url or config.billing.url).rstrip("/")
    if args.action == "create":
        body = {
            k: v
            for k, v in {
                "team": args.team,
                "role": args.role,
                "member": args.member,
                "project": args.project,
                "expires_in_seconds": args.expires_in,
                "requests_per_minute": args.requests_per_minute,
                "tokens_per_minute": args.tokens_per_minute,
                "max_concurrent": args.max_concurrent,
                "budget_usd_per_month": args.budget_usd,
                "reason": args.reason,
            }.items()
            if v is not None
        }
        return _issued(call(url, bearer, "POST", "/v1/keys", body))
    if args.action == "list":
        found = call(url, bearer, "GET", "/v1/keys" + ("?revoked=true" if args.revoked else ""))
        _table(found["keys"])
        return 0
    if args.action == "revoke":
        gone = call(url, bearer, "POST", f"/v1/keys/{args.key_id}/revoke", {"reason": args.reason})
        print(
            f"revoked {gone['key_id']} (team {gone['team'] or '-'}, role {gone['role']})",
            file=sys.stderr,
        )
        return 0
    body = {"reason": args.reason, "grace_seconds": args.grace}
    return _issued(call(url, bearer, "POST", f"/v1/keys/{args.key_id}/rotate", body))


def _signer(secret: str | None, variable: str) -> int:
    """Print the public key billing signs the issued keys' set with (``key_set_seal``)."""
    if not secret:
        raise CommandError(f"set ${variable} to billing's writer secret")
    from infermeter.key_set_seal import public_hex, signing_key

    print(public_hex(signing_key(secret.encode())))
    return 0


def _issued(found: dict[str, Any]) -> int:
    print(found["key"])
    whose = f"team {found['team']}" if found["team"] else "no team"
    print(
        f"key {found['key_id']}: {found['role']}, {whose}; the secret above is shown this once",
        file=sys.stderr,
    )
    return 0


def _table(keys: list[dict[str, Any]]) -> None:
    columns = (
        "key_id",
        "role",
        "team",
        "member",
        "project",
        "expires_at",
        "revoked_at",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent",
        "budget_usd_per_month",
    )
    rows = [[shown(k.get(c)) for c in columns] for k in keys]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    for line in ([list(columns)], rows):
        for row in line:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
