"""The dashboard's sign-ins, sign-in failures and sign-outs reach billing's audit trail: spooled by
the dashboard's server, shipped to billing, with who, from where and why. Real billing on a DuckDB
file and the dashboard under waitress, on loopback."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from dashboards.serve import audit_thread, dashboard_server
from infermeter.config import Config
from infermeter.serving import free_port
from tests.conftest import config_ledger
from tests.dashboards.stack import billing_thread
from tests.security.test_dashboard_security import SIGN_IN, callback, sign_in

ADMIN = "im-demo-admin"


def trail(billing: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{billing}/v1/audit", headers={"authorization": f"Bearer {ADMIN}"})
    events: list[dict[str, Any]] = answer.json()["events"]
    return events


def test_sign_ins_their_failures_and_sign_outs_are_on_the_audit_trail(
    config: Config, tmp_path: Path
) -> None:
    """A wrong key, the admin's key and the sign-out are three events, from the browser's address."""
    config = config.model_copy(
        update={
            "dashboard": config.dashboard.model_copy(update={"spool_dir": str(tmp_path / "spool")})
        }
    )
    ledger = config_ledger(config, tmp_path / "ledger.duckdb")
    try:
        with billing_thread(config, ledger) as billing:
            audit = audit_thread(config, billing, {"INFERMETER_INGEST_TOKEN": "im-demo-ingest"})
            port = free_port()
            server = dashboard_server(config, "127.0.0.1", port, billing, audit)
            thread = threading.Thread(target=server.serve, daemon=True)
            audit.start()
            thread.start()
            server.started.wait(10)
            url = f"http://127.0.0.1:{port}"
            try:
                assert sign_in(url, "im-wrong-key")["auth"]["data"] is None
                session = sign_in(url, ADMIN)["auth"]["data"]
                callback(
                    url,
                    SIGN_IN,
                    [
                        {"id": "logout", "property": "n_clicks", "value": 1},
                        {"id": "login-button", "property": "n_clicks", "value": 1},
                        {"id": "login-key", "property": "n_submit", "value": None},
                        {"id": "tick", "property": "n_intervals", "value": None},
                    ],
                    [
                        {"id": "login-key", "property": "value", "value": ""},
                        {"id": "auth", "property": "data", "value": session},
                    ],
                )
                deadline = time.monotonic() + 30
                while len(events := trail(billing)) < 3:
                    assert time.monotonic() < deadline, events
                    time.sleep(0.2)
            finally:
                server.stop()
                thread.join(10)
                audit.stop()
    finally:
        ledger.close()
    assert [(e["action"], e["actor"], e["why"], e["address"]) for e in events] == [
        ("signin.failed", "unknown", "unknown key", "127.0.0.1"),
        ("signin.succeeded", "@admin", "", "127.0.0.1"),
        ("signout", "@admin", "", "127.0.0.1"),
    ]
    assert {e["source"] for e in events} == {"@ingest"}
