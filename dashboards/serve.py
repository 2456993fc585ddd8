"""Serving the dashboard: the Dash (Flask) app under waitress (``dashboards.wsgi``), on its address.

``infermeter dashboard`` stops gracefully on SIGINT and SIGTERM: it stops accepting, lets the
requests being served finish for up to 2 s, then exits (0 after SIGINT, 128 + 15 after SIGTERM,
as a process killed by the signal would). A taken port is a one-line error before anything
starts, as for every other service.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from dashboards.app import create_app
from dashboards.headers import installed_headers
from dashboards.wsgi import WsgiServer
from infermeter.audit_spool import AUDIT_DIR, AuditLog, AuditThread
from infermeter.config import Config, process_environment
from infermeter.http_guard import DEFAULT_LIMITS
from infermeter.serving import ensure_free, host_port
from infermeter.writers import Role, credential_from

__all__ = ["audit_thread", "billing_url_of", "dashboard_server", "serve_dashboard"]


def billing_url_of(config: Config, billing_url: str | None = None) -> str:
    """The billing service to read from: the argument, ``dashboard.billing_url``, ``billing.url``."""
    return billing_url or config.dashboard.billing_url or config.billing.url


def dashboard_server(
    config: Config, host: str, port: int, billing_url: str, audit: AuditThread | None = None
) -> WsgiServer:
    """The dashboard's server, listening, ready to ``serve()``; a taken port is a ``PortInUseError``.

    ``audit``: where sign-ins, sign-in failures and sign-outs go (the audit trail).
    """
    ensure_free(host, port, "dashboard listen address")
    app = create_app(config, billing_url, audit=audit.record if audit else None).server
    return WsgiServer(
        app,
        host,
        port,
        DEFAULT_LIMITS,
        max_body_bytes=config.dashboard.max_body_bytes,
        error_headers=installed_headers(app),
    )


def serve_dashboard(config: Config, listen: str | None, billing_url: str | None) -> int:
    """Serve until SIGINT or SIGTERM; the exit status (0, or 143 after SIGTERM)."""
    host, port = host_port(listen or config.dashboard.listen)
    url = billing_url_of(config, billing_url)
    audit = audit_thread(config, url, process_environment())
    server = dashboard_server(config, host, port, url, audit)
    received: list[int] = []

    def on_signal(sig: int, _: FrameType | None) -> None:
        received.append(sig)
        server.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"dashboard: http://{host}:{port}/ (reading billing at {url})", flush=True)
    audit.start()
    try:
        server.serve()
    finally:
        audit.stop()
    return 128 + signal.SIGTERM if signal.SIGTERM in received else 0


def audit_thread(config: Config, billing_url: str, environ: Mapping[str, str]) -> AuditThread:
    """The dashboard's audit spool, shipped to billing with its writer credential (else the
    shared ingest token in ``$INFERMETER_INGEST_TOKEN``, where billing still takes it).

    WriterError naming the variable when it holds another role's credential.
    """
    credential = credential_from(environ, config.dashboard.credential_env, Role.DASHBOARD)
    source = credential.writer.principal if credential else "dashboard"
    log = AuditLog(Path(config.dashboard.spool_dir) / AUDIT_DIR, source, credential)
    token = None if credential else environ.get("INFERMETER_INGEST_TOKEN") or None
    return AuditThread(log, f"{billing_url.rstrip('/')}/v1/ingest", token)
