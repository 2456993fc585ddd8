"""The billing service's HTTP API (FastAPI): ingest, statements, spend, exports, queries, /metrics.

``create_app`` only assembles: the shared objects go on ``app.state``, the routers (one per
concern, under ``billing.routes``) are included, and the errors are mapped once. Errors are
OpenAI-style JSON, like the sidecar's, so the same clients can read both.
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from billing.access import keyring
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.metrics import IngestCounters, LedgerCollector, SpendCollector
from billing.rollups import Rollups
from billing.routes import errors, ingest, ops, queries, statements
from billing.routes.dependencies import Services
from billing.statement_cache import CachedChargeback
from infermeter.config import Config

__all__ = ["create_app"]


def create_app(config: Config, ledger: Ledger, statement_ttl_seconds: float = 300.0) -> FastAPI:
    """The API over ``ledger``; the caller owns (opens and closes) the ledger.

    ``statement_ttl_seconds``: how long a cached statement is served before it is recomputed.
    The coarse rollups are built from the whole ledger here, before the first query.
    """
    app = FastAPI(title="infermeter billing", version="1", docs_url=None, redoc_url=None)
    cache = CachedChargeback(ledger, config, statement_ttl_seconds)
    rollups = Rollups(ledger)
    rollups.refresh(time.time())
    registry = CollectorRegistry()
    registry.register(SpendCollector(cache))
    registry.register(LedgerCollector(ledger))
    app.state.services = Services(
        config=config,
        ledger=ledger,
        ring=keyring(config),
        chargeback=Chargeback(ledger, config),
        statements=cache,
        rollups=rollups,
        registry=registry,
        ingest_counters=IngestCounters(registry),
    )
    for module in (ops, ingest, statements, queries):
        app.include_router(module.router)
    errors.install(app)
    return app
