"""Serving the dashboard: Werkzeug's threaded WSGI server, on the configured address.

No production WSGI server (gunicorn, waitress) is a dependency; Werkzeug's threaded server is
the one Dash itself uses and is enough for a handful of viewers. Behind a reverse proxy with
many viewers, run ``dashboards.app:create_app`` under a WSGI server of your choice.
"""

from __future__ import annotations

import logging

from werkzeug.serving import BaseWSGIServer, make_server

from dashboards.app import create_app
from infermeter.config import Config
from infermeter.serving import PortInUseError

__all__ = ["dashboard_server", "serve_dashboard"]


def billing_url_of(config: Config, billing_url: str | None = None) -> str:
    """The billing service to read from: the argument, ``dashboard.billing_url``, ``billing.url``."""
    return billing_url or config.dashboard.billing_url or config.billing.url


def dashboard_server(config: Config, host: str, port: int, billing_url: str) -> BaseWSGIServer:
    """A threaded WSGI server for the app, bound but not yet serving."""
    try:
        return make_server(host, port, create_app(config, billing_url).server, threaded=True)
    except OSError as exc:
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve_dashboard(config: Config, listen: str | None, billing_url: str | None) -> int:
    """Serve until interrupted; 0 on a clean stop."""
    # One line per request (every callback and refresh) would drown the service's own log.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    host, _, port = (listen or config.dashboard.listen).rpartition(":")
    url = billing_url_of(config, billing_url)
    server = dashboard_server(config, host or "127.0.0.1", int(port), url)
    print(f"dashboard: http://{host}:{port}/ (reading billing at {url})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
