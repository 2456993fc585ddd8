"""Run the billing service: open the ledger, serve the API, checkpoint on the way out."""

from __future__ import annotations

import logging

import uvicorn

from billing.api import create_app
from billing.ledger import Ledger
from billing.lifetimes import heartbeat_seconds
from infermeter.config import Config
from infermeter.serving import ServerLimits, ensure_free, host_port, server

__all__ = ["billing_server", "open_ledger", "serve_billing"]

log = logging.getLogger("infermeter.billing")


def open_ledger(config: Config, database: str | None = None) -> Ledger:
    """The configured ledger file (or ``database``), migrated and ready."""
    b = config.billing
    return Ledger.open(
        database or b.database,
        teams=[t.name for t in config.teams],
        ttft_sla_seconds={m.name: m.sla.ttft_p95_seconds for m in config.models},
        memory_limit=b.memory_limit,
        threads=b.threads,
        heartbeat_seconds=heartbeat_seconds(config),
    )


def billing_server(config: Config, ledger: Ledger, host: str, port: int) -> uvicorn.Server:
    """The billing API on ``host:port``, with the connection cap and deadlines of its settings."""
    b = config.billing
    limits = ServerLimits(
        header_timeout_seconds=b.header_timeout_seconds,
        max_connections=b.max_connections,
        keep_alive_seconds=b.keep_alive_timeout_seconds,
    )
    return server(create_app(config, ledger), host, port, limits=limits)


async def serve_billing(
    config: Config, listen: str | None = None, database: str | None = None
) -> None:
    """Serve until told to exit; the ledger is checkpointed and closed after the server stops."""
    host, port = host_port(listen or config.billing.listen)
    ensure_free(host, port, "billing listen address")
    ledger = open_ledger(config, database)
    try:
        log.info(
            "billing: ledger %s, API on http://%s:%d",
            database or config.billing.database,
            host,
            port,
        )
        await billing_server(config, ledger, host, port).serve()
    finally:
        # On SIGTERM this runs because the command turns the signal into SystemExit.
        ledger.close()
