"""The billing service's HTTP API (FastAPI): ingest, statements, spend, exports, queries, /metrics.

``create_app`` only assembles: the shared objects go on ``app.state``, the routers (one per
concern, under ``billing.routes``) are included, and the errors are mapped once. Errors are
OpenAI-style JSON, like the sidecar's, so the same clients can read both.
"""

from __future__ import annotations

import time

from anyio import CapacityLimiter
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from billing.access import keyring
from billing.chargeback import Chargeback
from billing.explorer_cache import Months
from billing.federation_pull import Puller
from billing.keys import KeyBook, Publisher
from billing.ledger import Ledger
from billing.lifetimes import heartbeat_seconds, live_bound
from billing.metrics import (
    IngestCounters,
    InstanceCollector,
    LedgerCollector,
    OverrideCollector,
    QuarantineCollector,
    ReconciliationCollector,
    SpendCollector,
    StatementCollector,
)
from billing.ratelimit import ReadLimiter
from billing.rates import RateCache
from billing.rollups import Rollups
from billing.routes import (
    allocation,
    audit,
    breakdown,
    efficiency,
    errors,
    events,
    federation,
    fleet,
    ingest,
    instances,
    invoices,
    keys,
    maintenance,
    ops,
    overrides,
    queries,
    rates,
    records,
    statements,
)
from billing.routes.dependencies import Services
from billing.statement_cache import CachedChargeback
from billing.writers import WriterGate
from infermeter.config import Config, env_value
from infermeter.oidc import IdTokens
from infermeter.writers import WriterKeys

__all__ = ["create_app"]

# Statements are computed on threads of their own, at most this many at once, so that reads,
# however many, never hold the threads ingest runs on.
STATEMENT_THREADS = 2


def create_app(
    config: Config,
    ledger: Ledger,
    statement_ttl_seconds: float | None = None,
    writer_secret: bytes | None = None,
    key_publisher: Publisher | None = None,
) -> FastAPI:
    """The API over ``ledger``; the caller owns (opens and closes) the ledger.

    ``statement_ttl_seconds``: how long a cached statement is served before it is recomputed
    (default ``Config.statement_ttl_seconds``: at most one dashboard refresh).
    ``writer_secret``: what writer credentials are derived from (default: the variable
    ``billing.writer_secret_env`` names; unset, billing takes no writer credential).
    ``key_publisher``: where the sidecars read the issued keys besides billing (Redis).
    The coarse rollups are built from the whole ledger here, before the first query.
    """
    app = FastAPI(title="infermeter billing", version="1", docs_url=None, redoc_url=None)
    b = config.billing
    ttl = config.statement_ttl_seconds if statement_ttl_seconds is None else statement_ttl_seconds
    cache = CachedChargeback(ledger, config, ttl, b.statement_cache_entries)
    rollups = Rollups(ledger)
    rollups.refresh(time.time())
    registry = CollectorRegistry()
    registry.register(SpendCollector(cache))
    registry.register(LedgerCollector(ledger))
    registry.register(StatementCollector(cache))
    registry.register(InstanceCollector(ledger, heartbeat_seconds(config), live_bound(config)))
    registry.register(ReconciliationCollector(ledger))
    registry.register(QuarantineCollector(ledger))
    registry.register(OverrideCollector(ledger))
    if writer_secret is None:
        writer_secret = (env_value(b.writer_secret_env) or "").encode() or None
    ring = keyring(config)
    app.state.services = Services(
        config=config,
        ledger=ledger,
        keys=KeyBook(
            ledger,
            ring,
            [t.name for t in config.teams],
            key_publisher,
            config.billing.max_keys_per_team,
        ),
        chargeback=Chargeback(ledger, config),
        statements=cache,
        rollups=rollups,
        explorer=Months(cache, rollups, ttl),
        registry=registry,
        ingest_counters=IngestCounters(registry),
        reads=ReadLimiter(b.read_rate_per_second, b.read_burst),
        computing=CapacityLimiter(STATEMENT_THREADS),
        writers=WriterGate(
            WriterKeys(writer_secret) if writer_secret else None, ring, b.shared_ingest_token
        ),
        id_tokens=IdTokens(config.dashboard.oidc) if config.dashboard.oidc else None,
    )
    app.state.rates = RateCache()
    # A central's puller of its clusters' closed months (``billing.federation_pull``), run on its
    # timer by the service and at once by ``POST /v1/federation/pull``.
    app.state.federation = Puller(ledger, b) if b.role == "central" else None
    # The audit trail's ingest route first: /v1/ingest/{kind} would take /v1/ingest/audit.
    for module in (
        ops,
        audit,
        ingest,
        keys,
        overrides,
        statements,
        queries,
        allocation,
        events,
        instances,
        fleet,
        records,
        efficiency,
        invoices,
        breakdown,
        maintenance,
        rates,
        federation,
    ):
        app.include_router(module.router)
    errors.install(app)
    return app
