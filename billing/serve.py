"""Run the billing service: open the ledger, serve the API, checkpoint on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

import duckdb
import uvicorn
from fastapi import FastAPI

from billing import allocation_runs, reconciliation_hours
from billing.api import create_app
from billing.archive import retaining
from billing.bounds import SampleBounds
from billing.ledger import Ledger
from billing.lifetimes import heartbeat_seconds
from billing.quarantine import KnownFleet
from infermeter.config import Config, env_value, process_environment
from infermeter.exposure import is_loopback
from infermeter.otlp import metrics_export_configured, otlp_settings
from infermeter.serving import ServerLimits, ensure_free, host_port, server
from infermeter.tags import project_rules
from infermeter.writers import DEMO_SECRET, WriterError

if TYPE_CHECKING:
    from billing.key_publish import RedisPublisher
    from infermeter.otlp_export import MetricsExport

__all__ = ["billing_server", "key_publisher", "metrics_export", "open_ledger", "serve_billing"]

log = logging.getLogger("infermeter.billing")


def open_ledger(config: Config, database: str | None = None) -> Ledger:
    """The configured ledger file (or ``database``), migrated and ready, knowing the fleet's
    models, replica groups and nodes and the teams' project tags (what the trust checks take
    records for)."""
    b = config.billing
    return Ledger.open(
        database or b.database,
        teams=[t.name for t in config.teams],
        ttft_sla_seconds={m.name: m.sla.ttft_p95_seconds for m in config.models},
        memory_limit=b.memory_limit,
        threads=b.threads,
        heartbeat_seconds=heartbeat_seconds(config),
        fleet=KnownFleet.of(config),
        bounds=SampleBounds.of(config),
        projects=project_rules(config),
    )


def billing_server(
    config: Config, ledger: Ledger, host: str, port: int, app: FastAPI | None = None
) -> uvicorn.Server:
    """The billing API (``app``, or one made over ``ledger``) on ``host:port``, with the
    connection cap and deadlines of its settings."""
    b = config.billing
    limits = ServerLimits(
        header_timeout_seconds=b.header_timeout_seconds,
        max_connections=b.max_connections,
        keep_alive_seconds=b.keep_alive_timeout_seconds,
    )
    return server(app or create_app(config, ledger), host, port, limits=limits)


def metrics_export(app: FastAPI, environ: Mapping[str, str]) -> MetricsExport | None:
    """``infermeter.cost`` over OTLP when the OTEL_* variables ask for it (``billing.otlp_metrics``).

    The SDK is imported only then (its exporter reads the rest of the variables from the process
    environment). OtlpConfigError for a protocol or interval it cannot honour.
    """
    if not metrics_export_configured(environ):
        return None
    from billing.otlp_metrics import CostExport
    from infermeter.otlp_export import make_metrics_export

    services = app.state.services
    return make_metrics_export(
        otlp_settings(environ),
        "infermeter-billing",
        "infermeter.billing",
        {},
        [CostExport(services.statements).produce],
        services.registry,
    )


def _reloading(app: FastAPI, config: Config, path: Path, listen: str) -> asyncio.Task[None]:
    """Reload ``app``'s configuration from ``path`` on SIGHUP and on a change of the file."""
    from billing import reload
    from infermeter.exposure import public_key_problems
    from infermeter.reload import Reloader

    def check(fresh: Config) -> list[str]:
        return public_key_problems(fresh, listen) + reload.restart_needed(config, fresh)

    async def audit(action: str, trigger: str, why: str) -> None:
        await asyncio.to_thread(reload.record_reload, app, action, trigger, why)

    reloader = Reloader(path, "billing", lambda fresh: reload.reconfigure(app, fresh), audit, check)
    return reloader.install(asyncio.get_running_loop())


def key_publisher(config: Config) -> RedisPublisher | None:
    """Where the sidecars read the issued keys besides billing: the Redis of their shared limits,
    the set signed with a key derived from the writer secret (without one, billing does not
    write it there, and the sidecars read billing's route)."""
    if config.sidecar.shared_limits.redis_url is None:
        return None
    secret = env_value(config.billing.writer_secret_env)
    if not secret:
        log.warning(
            "billing: $%s is not set: the issued keys are not written to Redis (nothing to sign "
            "them with); the sidecars read them from billing",
            config.billing.writer_secret_env,
        )
        return None
    from billing.key_publish import RedisPublisher  # redis-py, only when configured
    from infermeter.key_set_seal import signing_key

    return RedisPublisher(config.sidecar.shared_limits, signing_key(secret.encode()))


# How often the hours that batches made stale get their cost rows rebuilt (``billing.hourly``)
# and their reconciliation kept (``billing.reconciliation_hours``):
# a statement builds what is still stale itself, so this only bounds how much it has to.
HOUR_REBUILD_SECONDS: Final = 30.0


async def rebuild_hours(ledger: Ledger, interval: float = HOUR_REBUILD_SECONDS) -> None:
    """Rebuild the stale hourly cost rows every ``interval`` seconds until cancelled.

    A failed rebuild is logged and tried again: the hours stay marked until one succeeds.
    """
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(allocation_runs.refresh_hours, ledger)
            await asyncio.to_thread(reconciliation_hours.refresh, ledger)
        except duckdb.Error as exc:
            log.warning(
                "billing: rebuilding hourly cost rows failed, retried in %.0f s: %s", interval, exc
            )


async def serve_billing(
    config: Config,
    listen: str | None = None,
    database: str | None = None,
    config_path: Path | None = None,
) -> None:
    """Serve until told to exit; the ledger is checkpointed and closed after the server stops.

    With ``config_path``, SIGHUP or a change of the file reloads teams, prices, SLAs and the
    configured keys (``billing.reload``), validated first and audited.
    """
    b = config.billing
    host, port = host_port(listen or b.listen)
    ensure_free(host, port, "billing listen address")
    secret = env_value(b.writer_secret_env) or ""
    if secret.encode() == DEMO_SECRET and not is_loopback(f"{host}:{port}"):
        raise WriterError(
            f"${b.writer_secret_env} is the public demo writer secret and billing listens on "
            f"{host}:{port}: anyone could issue credentials; set a secret of your own, or listen "
            "on 127.0.0.1 only"
        )
    if not secret and not b.shared_ingest_token:
        log.warning(
            "billing: $%s is not set and billing.shared_ingest_token is false: no "
            "writer can send records (docs/security.md)",
            b.writer_secret_env,
        )
    ledger = open_ledger(config, database)
    try:
        log.info(
            "billing: ledger %s, API on http://%s:%d",
            database or config.billing.database,
            host,
            port,
        )
        publisher = key_publisher(config)
        app = create_app(config, ledger, key_publisher=publisher)
        export = metrics_export(app, process_environment())
        task = asyncio.create_task(export.run()) if export is not None else None
        keys = app.state.services.keys
        keeping = asyncio.create_task(publisher.keep(lambda: keys.issued)) if publisher else None
        watching = _reloading(app, config, config_path, f"{host}:{port}") if config_path else None
        r = b.retention
        retention = (
            asyncio.create_task(retaining(ledger, r, b.cluster_name))
            if r.interval_seconds > 0
            else None
        )
        puller = app.state.federation
        pulling = asyncio.create_task(puller.run()) if puller is not None else None
        rebuilding = asyncio.create_task(rebuild_hours(ledger))
        try:
            await billing_server(config, ledger, host, port, app).serve()
        finally:
            for running in (retention, keeping, watching, pulling, rebuilding, task):
                if running is not None:
                    running.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await running
            if export is not None:
                await export.close()
    finally:
        # On SIGTERM this runs because the command turns the signal into SystemExit.
        ledger.close()
