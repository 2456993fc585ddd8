"""Billing, a metrics endpoint and the dashboard on loopback threads, and a headless Chromium.

Selenium's calls block, so each server runs in its own thread, under uvicorn with its own event
loop and with the settings ``infermeter`` serves with, rather than in the test's event loop.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from billing.api import create_app as billing_app
from billing.ledger import Ledger
from dashboards.serve import dashboard_server
from dashboards.wsgi import WsgiServer
from infermeter.config import DEFAULT_CONFIG, Config, DashboardSettings, load_config
from infermeter.serving import free_port, server as serve
from tests.http_stub import serving

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def dashboard_config(environ: Mapping[str, str] | None = None, **dashboard: Any) -> Config:
    """The demo configuration (``environ`` its only environment overrides) with a dashboard of
    ``dashboard`` settings that refreshes only when asked, so a page changes only when a test
    makes it."""
    config = load_config(DEFAULT_CONFIG, environ=environ or {})
    settings = DashboardSettings(refresh_seconds=3600, **dashboard)
    return config.model_copy(update={"dashboard": settings})


@contextlib.contextmanager
def server_thread(server: uvicorn.Server, name: str) -> Iterator[None]:
    """Run ``server`` in a thread until the block ends; returns once it accepts connections."""
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the {name} did not start")
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def billing_thread(config: Config, ledger: Ledger) -> Iterator[str]:
    """The billing API over ``ledger`` on a loopback port, in a thread; yields its URL."""
    port = free_port()
    server = serve(billing_app(config, ledger), "127.0.0.1", port, lifespan="off")
    with server_thread(server, "billing service"):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def metrics_thread(text: str) -> Iterator[str]:
    """A Prometheus-format endpoint serving ``text``, like the autoscaler's /metrics."""
    page = (200, text.encode(), "text/plain; version=0.0.4")
    with serving(lambda _: page, "metrics") as url:
        yield f"{url}/metrics"


@contextlib.contextmanager
def dashboard_thread(config: Config, billing_url: str) -> Iterator[str]:
    """The dashboard on a loopback port, in a thread, as ``infermeter dashboard`` serves it; yields its URL."""
    port = free_port()
    with wsgi_thread(dashboard_server(config, "127.0.0.1", port, billing_url), port) as url:
        yield url


@contextlib.contextmanager
def wsgi_thread(server: WsgiServer, port: int) -> Iterator[str]:
    """``server`` (listening on ``port`` of loopback) serving in a thread for the block; its URL."""
    thread = threading.Thread(target=server.serve, name="dashboard", daemon=True)
    thread.start()
    server.started.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        thread.join(10)


@contextlib.contextmanager
def chromium(downloads: Path, tz: str = "UTC") -> Iterator[webdriver.Chrome]:
    """Headless Chromium from the system packages (never downloaded), with browser logs kept.

    ``tz`` is the browser's time zone (through ``TZ``), so a test can check local times.
    """
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not found: the browser tests need Debian's chromium and "
            "chromium-driver (make test installs them through scripts/system-deps.sh)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1800",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    options.add_experimental_option(
        "prefs",
        {"download.default_directory": str(downloads), "download.prompt_for_download": False},
    )
    service = Service(str(CHROMEDRIVER), env={**os.environ, "TZ": tz})
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()
