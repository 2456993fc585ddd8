"""Run one sidecar as a server (``sidecar.http_server``): reload on SIGHUP or a file change, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from infermeter.config import Config, ConfigError, load_config, process_environment
from infermeter.exposure import public_key_problems
from infermeter.identity import identity_from_environment
from infermeter.otlp import metrics_export_configured, otlp_settings
from infermeter.reload import Reloader
from infermeter.serving import ensure_free, host_port
from sidecar.app import Sidecar
from sidecar.drain import drain
from sidecar.engine_listener import EngineMetricsOnly
from sidecar.http_server import HttpServer
from sidecar.lifetime import engine_metrics_url, resource_attributes
from sidecar.tracing import make_tracer_provider

__all__ = ["log_to_stderr", "ready_line", "serve_sidecar"]

log = logging.getLogger("infermeter.sidecar")


async def serve_sidecar(
    config_path: Path,
    replica_id: str,
    listen: str | None,
    upstream: str | None,
    *,
    spool_dir: Path | None = None,
    engine_metrics_listen: str | None = None,
    config: Config | None = None,
) -> None:
    """Serve the sidecar of ``replica_id`` until told to stop.

    ``config``: the file at ``config_path`` as the command already read it (read here when
    None); the file is read again only on a reload. A fleet's file with a thousand teams costs
    the process about 1.5 MB held and a few more at its peak each time it is read.

    ``spool_dir``: this instance's own spool directory (default: under ``sidecar.spool_dir``).
    ``engine_metrics_listen``: a second listener serving vLLM's ``/metrics`` alone, without a
    token (``sidecar.engine_listener``), stopped with the sidecar.

    IdentityError when the environment names the instance wrongly, OtlpConfigError when the
    OTEL_* variables ask for a metric or span export that cannot be made. A start-up that fails (the
    spool directory stays locked) is logged, and the process exits with status 3.
    """
    if config is None:
        config = load_config(config_path)
    if upstream:
        config = _with_upstream(config, replica_id, upstream)
    replica = config.replica(replica_id)
    identity = identity_from_environment(replica, process_environment())
    address = listen or replica.sidecar_listen
    if not address:
        raise ConfigError(
            str(config_path),
            [f"replicas[{replica_id}].sidecar_listen: not set and no --listen given"],
        )
    host, port = host_port(address)
    ensure_free(host, port, f"sidecar of replica {replica_id}")
    extra = host_port(engine_metrics_listen) if engine_metrics_listen else None
    if extra is not None:
        ensure_free(*extra, "sidecar --engine-metrics-listen")
    tracer_provider = make_tracer_provider(
        f"infermeter-sidecar-{replica_id}", attributes=resource_attributes(identity)
    )
    otlp = otlp_settings() if metrics_export_configured() else None
    metrics_url = engine_metrics_url(host, port, process_environment(), socket.gethostname())
    app = Sidecar(
        config,
        replica_id,
        tracer_provider=tracer_provider,
        identity=identity,
        engine_metrics_url=metrics_url,
        otlp=otlp,
        spool_dir=spool_dir,
    )
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task[None]] = []

    def on_signal(sig: signal.Signals) -> None:
        # The first SIGTERM (or Ctrl-C) starts the drain; another one ends its wait at once.
        if draining:
            log.warning("%s again: ending the drain period now", sig.name)
            app.drain.cut_now()
            return
        log.warning(
            "%s: draining (sidecar.drain_seconds %.0f)", sig.name, app.settings.drain_seconds
        )
        draining.append(loop.create_task(_drain_then_exit()))

    async def _drain_then_exit() -> None:
        try:
            await drain(app, app.settings.drain_seconds)
        finally:
            srv.should_exit = True

    # SIGTERM and SIGINT start the drain (``on_signal``), which stops the server once it is over.
    srv = HttpServer(app, host, port, limits=app.server_limits, on_signal=on_signal)
    gauges = None
    if extra is not None:
        gauges = HttpServer(
            EngineMetricsOnly.of(app), *extra, limits=app.server_limits, lifespan=False
        )

    def apply(fresh: Config) -> None:
        app.reload(_with_upstream(fresh, replica_id, upstream) if upstream else fresh)

    async def audit(action: str, trigger: str, why: str) -> None:
        # Who reloads is the operator behind the signal or the file change.
        await app.audit.note(
            action,
            f"operator ({trigger})",
            "operator",
            target=f"file:{config_path}",
            why=why,
            outcome="ok" if action == "config.reloaded" else "refused",
        )

    reloader = Reloader(
        config_path,
        f"sidecar {replica_id}",
        apply,
        audit,
        lambda fresh: public_key_problems(fresh, address),
    )
    watcher = reloader.install(loop)
    announce = loop.create_task(_announce_ready(srv, ready_line(app, host, port)))
    serving_gauges = loop.create_task(gauges.serve()) if gauges is not None else None
    try:
        await srv.serve()
    finally:
        if gauges is not None and serving_gauges is not None:
            gauges.should_exit = True
            await serving_gauges
        for task in (watcher, announce):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def log_to_stderr() -> None:
    """Sidecar lines on stderr: its own from INFO (the ready line), everyone else's from WARNING."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)


def ready_line(app: Sidecar, host: str, port: int) -> str:
    """The one line saying the sidecar serves: where, for whom, in front of what, limited how.

    Nothing secret: the upstream is shown without credentials or query, Redis by its mode only.
    """
    shared = app.settings.shared_limits
    limits = (
        "local (per process)"
        if shared.redis_url is None
        else f"shared in Redis (scope {shared.scope}, {shared.on_failure})"
    )
    return (
        f"sidecar ready on http://{host}:{port}: replica group {app.replica_id}, "
        f"instance {app.identity.instance}, upstream {_without_credentials(app.upstream)}, "
        f"limits {limits}, event loop {_loop_name()}"
    )


def _loop_name() -> str:
    """ "uvloop" or "asyncio": the loop this process runs on (``sidecar.event_loop``)."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


async def _announce_ready(srv: HttpServer, line: str) -> None:
    """Log ``line`` once, as soon as the server listens (never if it stops first)."""
    while not srv.started:
        if srv.should_exit:
            return
        await asyncio.sleep(0.05)
    log.info("%s", line)


def _with_upstream(config: Config, replica_id: str, upstream: str) -> Config:
    data = config.model_dump()
    for r in data["replicas"]:
        if r["id"] == replica_id:
            r["upstream_url"] = upstream
    return type(config).model_validate(data)
