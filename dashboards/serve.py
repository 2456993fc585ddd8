"""Serving the dashboard: the Dash (Flask) app under uvicorn through a2wsgi, on its address.

Why uvicorn and a2wsgi rather than a WSGI server of its own:

- **One server for every service.** The dashboard starts through ``infermeter.serving`` like
  billing, the sidecars and the collector: the same HTTP parser, logging, graceful-shutdown
  timeout and one-line error for a taken port, and the same Ctrl-C and SIGTERM handling (uvicorn
  stops gracefully, then the command exits as for every other service).
- **Started and stopped in-process.** ``infermeter dashboard`` runs it under the demo's supervisor
  and the browser tests run it in a thread, stopped by ``should_exit`` as they stop billing.
  gunicorn cannot start inside a process (it forks its own workers from its own command line);
  waitress can, but would be a second server with its own settings, logging, signal handling
  and shutdown behaviour to keep in line with uvicorn's.
- **a2wsgi, not uvicorn's WSGI mode**, which is deprecated in a2wsgi's favour. It is pure Python
  with no dependencies: Flask runs on a bounded pool of worker threads (``wsgi_server``'s
  ``threads``) instead of Werkzeug's development server, which starts a thread per request.
"""

from __future__ import annotations

import asyncio

import uvicorn

from dashboards.app import create_app
from infermeter.config import Config
from infermeter.serving import ensure_free, host_port, wsgi_server

__all__ = ["billing_url_of", "dashboard_server", "serve_dashboard"]


def billing_url_of(config: Config, billing_url: str | None = None) -> str:
    """The billing service to read from: the argument, ``dashboard.billing_url``, ``billing.url``."""
    return billing_url or config.dashboard.billing_url or config.billing.url


def dashboard_server(config: Config, host: str, port: int, billing_url: str) -> uvicorn.Server:
    """The dashboard's server, ready to ``serve()``; a taken port is a ``PortInUseError`` first."""
    ensure_free(host, port, "dashboard listen address")
    return wsgi_server(create_app(config, billing_url).server, host, port)


def serve_dashboard(config: Config, listen: str | None, billing_url: str | None) -> int:
    """Serve until interrupted; 0 on a clean stop."""
    host, port = host_port(listen or config.dashboard.listen)
    url = billing_url_of(config, billing_url)
    server = dashboard_server(config, host, port, url)
    print(f"dashboard: http://{host}:{port}/ (reading billing at {url})", flush=True)
    asyncio.run(server.serve())
    return 0
