"""Billing's part of a configuration reload: teams, prices, SLAs, keys, without a restart.

``reconfigure`` sets every object that holds the configuration to the new one: the ledger's
known teams, models, groups and nodes, its teams' project tags and its SLA targets (what ingest
checks records against), the statement computations (prices, split policy, budgets: the cached
statements are dropped, since they were priced before), the configured keys, single sign-on's
issuer, client and group mapping (``dashboard.oidc``), and the services' ``config`` that the
routes read.
``restart_needed`` names what a running billing cannot take (where it listens, its ledger file,
its thread and memory limits): such a file is refused, so nothing changes half-way.
Billing's own reloads go on the audit trail in the ledger (``audit_sql``).
"""

from __future__ import annotations

import dataclasses
import time

from fastapi import FastAPI

from billing import audit
from billing.access import keyring
from billing.quarantine import KnownFleet
from billing.routes.dependencies import Services
from infermeter.audit import audit_event
from infermeter.config import Config
from infermeter.oidc import IdTokens
from infermeter.tags import project_rules

__all__ = ["reconfigure", "record_reload", "restart_needed"]

# Billing's settings a running process cannot change.
# The federation's settings too: a central's puller takes them when the service starts.
_FIXED = (
    "listen",
    "database",
    "memory_limit",
    "threads",
    "writer_secret_env",
    "role",
    "clusters",
    "federation",
)


def restart_needed(old: Config, new: Config) -> list[str]:
    """One problem per setting ``new`` changes that billing only takes at a restart."""
    return [
        f"billing.{name}: {getattr(old.billing, name)!r} -> {getattr(new.billing, name)!r} "
        "needs a restart of billing; nothing was reloaded"
        for name in _FIXED
        if getattr(old.billing, name) != getattr(new.billing, name)
    ]


def reconfigure(app: FastAPI, config: Config) -> None:
    """Make ``config`` the one every route of ``app`` works by."""
    svc: Services = app.state.services
    teams = [t.name for t in config.teams]
    svc.ledger.reconfigure(
        teams,
        {m.name: m.sla.ttft_p95_seconds for m in config.models},
        KnownFleet.of(config),
        project_rules(config),
    )
    svc.chargeback.reconfigure(config)
    svc.statements.reconfigure(config)
    ring = keyring(config)
    svc.keys.reconfigure(ring, teams, config.billing.max_keys_per_team)
    svc.writers.ring = ring
    svc.writers.shared_token = config.billing.shared_ingest_token
    app.state.services = dataclasses.replace(svc, config=config, id_tokens=_id_tokens(svc, config))


def _id_tokens(svc: Services, config: Config) -> IdTokens | None:
    """The ID token checker for ``config``: the one in use while single sign-on's settings are
    the same (its issuer's keys already read), a new one when they changed, none when it is off."""
    oidc = config.dashboard.oidc
    if oidc is None:
        return None
    kept = svc.id_tokens
    return kept if kept is not None and kept.settings == oidc else IdTokens(oidc)


def record_reload(app: FastAPI, action: str, trigger: str, why: str) -> None:
    """Billing's reload (or refusal) on the audit trail."""
    svc: Services = app.state.services
    event = audit_event(
        action,
        f"operator ({trigger})",
        "operator",
        "billing",
        target="configuration",
        why=why,
        outcome="ok" if action == "config.reloaded" else "refused",
    )
    with svc.ledger.writing() as cur:
        audit.append(cur, [event], time.time())
