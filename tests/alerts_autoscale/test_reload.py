"""A running ``infermeter autoscale run`` reloads its configuration on SIGHUP and on a change of
the file: a new ``min_replicas`` decides from the next tick, a file that changes what only a
restart takes (or that is invalid) is refused and the policy in force keeps deciding, and each
reload and refusal reaches billing's audit trail, sent with the autoscaler's writer credential.

Real processes on loopback: billing on a DuckDB file, the autoscaler reading a collector page
served by a small HTTP server in this process. The tests run in order on one autoscaler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from alerts.autoscale.reload import restart_needed
from infermeter.audit_spool import AUDIT_DIR
from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from infermeter.writers import Writer, issue
from tests.alerts_autoscale.test_inputs import COLLECTOR_PAGE
from tests.servers import stop_process

ROOT = Path(__file__).parents[2]
ADMIN = {"authorization": "Bearer im-demo-admin"}
SECRET = "a writer secret of this test only"


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = COLLECTOR_PAGE.encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class Running:
    """The autoscaler and billing, the autoscaler's file and the data it was written from."""

    autoscaler: subprocess.Popen[str]
    metrics: str
    billing: str
    path: Path
    data: dict[str, Any]
    spool: Path


def write(path: Path, data: dict[str, Any], *, unseen: bool = False) -> None:
    """Replace the file whole, as a ConfigMap update does (a new file renamed into place).

    ``unseen``: with the old file's modification time, so that only a SIGHUP takes it.
    """
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(yaml.safe_dump(data))
    if unseen:
        old = path.stat()
        os.utime(tmp, ns=(old.st_atime_ns, old.st_mtime_ns))
    os.replace(tmp, path)


def wait_for(what: str, ok: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def start(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", *argv],
        cwd=cwd,
        env=env,
        stderr=subprocess.DEVNULL,
        text=True,
    )


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """Billing and the autoscaler, each on a file of its own, sharing a writer secret only: the
    autoscaler ships with its writer credential, no ingest token."""
    tmp = tmp_path_factory.mktemp("autoscale-reload")
    page = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    billing_port, port = free_port(), free_port()
    billing = f"http://127.0.0.1:{billing_port}"
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["billing"].update(
        listen=f"127.0.0.1:{billing_port}", url=billing, database=str(tmp / "ledger.duckdb")
    )
    data["autoscale"] = {
        "listen": f"127.0.0.1:{port}",
        "interval_seconds": 0.3,
        "collector_url": f"http://127.0.0.1:{page.server_port}/metrics",
        "sidecar_urls": [],
        "history_file": "",
        "predictive": False,
        "ingest_url": f"{billing}/v1/ingest",
        "spool_dir": str(tmp / "autoscale-spool"),
    }
    # The collector page's replicas: no sidecar pages to read.
    for replica in data["replicas"]:
        replica.pop("sidecar_listen", None)
    # Billing reloads its own file: its events are not the autoscaler's.
    write(tmp / "billing.yaml", data)
    path = tmp / "infermeter.yaml"
    write(path, data)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "INFERMETER_WRITER_SECRET": SECRET,
        "INFERMETER_WRITER_CREDENTIAL": issue(SECRET.encode(), Writer.for_autoscaler()).token,
    }
    bill = start(["billing", "--config", str(tmp / "billing.yaml")], tmp, env)
    scaler = start(["autoscale", "run", "--config", str(path)], tmp, env)
    try:
        wait_for("billing did not start", lambda: healthy(billing), 60)
        wait_for("the autoscaler did not start", lambda: healthy(f"http://127.0.0.1:{port}"), 60)
        yield Running(
            scaler, f"http://127.0.0.1:{port}/metrics", billing, path, data, tmp / "autoscale-spool"
        )
    finally:
        stop_process(scaler, grace=15)
        stop_process(bill, grace=15)
        page.shutdown()
        page.server_close()


def desired(running: Running, model: str) -> float | None:
    """The autoscaler's ``infermeter_desired_replicas`` of ``model`` (None before a decision)."""
    text = httpx.get(running.metrics, timeout=5).text
    prefix = f'infermeter_desired_replicas{{model="{model}"}} '
    values = [float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else None


def trail(running: Running) -> list[dict[str, Any]]:
    """Billing's audit events of configuration reloads, oldest first."""
    events: list[dict[str, Any]] = httpx.get(
        f"{running.billing}/v1/audit", headers=ADMIN, timeout=5
    ).json()["events"]
    return sorted(
        (e for e in events if e["action"].startswith("config.")), key=lambda e: e["occurred_at"]
    )


def test_a_higher_min_replicas_decides_after_sighup(running: Running) -> None:
    """chat-large serves one replica: min_replicas 2 asks for 2; after SIGHUP, 3 asks for 3."""
    wait_for("no first decision", lambda: desired(running, "chat-large") == 2)
    running.data["scaling"]["min_replicas"] = 3
    write(running.path, running.data, unseen=True)
    time.sleep(2.5)  # the file watch does not take it
    assert desired(running, "chat-large") == 2
    running.autoscaler.send_signal(signal.SIGHUP)
    wait_for("min_replicas 3 did not decide", lambda: desired(running, "chat-large") == 3, 10)
    assert desired(running, "chat-small") == 3


def test_a_file_needing_a_restart_or_invalid_is_refused_and_the_old_policy_decides(
    running: Running,
) -> None:
    """A new listen address with min_replicas 4 is refused whole (by the file watch); so are a
    negative min_replicas and, with the demo's public key hashes, a dashboard listening on every
    interface; the policy in force keeps asking for 3."""
    changed = yaml.safe_load(yaml.safe_dump(running.data))
    changed["autoscale"]["listen"] = f"127.0.0.1:{free_port()}"
    changed["scaling"]["min_replicas"] = 4
    write(running.path, changed)
    wait_for("the refusal is not on the trail", lambda: len(trail(running)) >= 2)
    changed = yaml.safe_load(yaml.safe_dump(running.data))
    changed["scaling"]["min_replicas"] = -1
    time.sleep(1.1)  # a modification time the watch sees as new on any file system
    write(running.path, changed)
    wait_for("the second refusal is not on the trail", lambda: len(trail(running)) >= 3)
    changed = yaml.safe_load(yaml.safe_dump(running.data))
    changed.setdefault("dashboard", {})["listen"] = f"0.0.0.0:{free_port()}"
    changed["scaling"]["min_replicas"] = 4
    time.sleep(1.1)
    write(running.path, changed)
    wait_for("the third refusal is not on the trail", lambda: len(trail(running)) >= 4)
    time.sleep(1.0)  # ticks of the policy in force
    assert desired(running, "chat-large") == 3
    assert running.autoscaler.poll() is None


def test_each_reload_and_refusal_is_on_billings_audit_trail(running: Running) -> None:
    """In order: reloaded (SIGHUP), refused naming autoscale.listen, refused naming min_replicas,
    refused naming the public key hash; sent by the autoscaler's writer through its own audit
    spool."""
    events = trail(running)
    assert [(e["action"], e["actor"], e["outcome"]) for e in events] == [
        ("config.reloaded", "operator (SIGHUP)", "ok"),
        ("config.refused", "operator (file change)", "refused"),
        ("config.refused", "operator (file change)", "refused"),
        ("config.refused", "operator (file change)", "refused"),
    ]
    assert "autoscale.listen" in events[1]["why"]
    assert "restart" in events[1]["why"]
    assert "min_replicas" in events[2]["why"]
    assert "is the hash of a public demo key and dashboard.listen" in events[3]["why"]
    assert {e["source"] for e in events} == {Writer.for_autoscaler().principal}
    assert {e["target"] for e in events} == {f"file:{running.path}"}
    assert (running.spool / AUDIT_DIR).is_dir()  # its segments deleted once billing had them


def _changed(config: Config, sla: float | None = None, **sections: dict[str, Any]) -> Config:
    data = config.model_dump()
    if sla is not None:
        data["models"][0]["sla"]["ttft_p95_seconds"] = sla
    for section, values in sections.items():
        data[section].update(values)
    return Config.model_validate(data)


def test_the_policy_reloads_and_what_the_process_was_built_from_does_not(config: Config) -> None:
    """Scaling, SLAs and the predictive knobs reload; hooks, inputs and the interval are named."""
    policy = _changed(
        config,
        0.1,
        scaling={"min_replicas": 5, "cooldown_seconds": 1},
        autoscale={"predictive": False, "target_gpu_utilization": 0.5},
    )
    assert policy.models[0].sla != config.models[0].sla
    assert restart_needed(config, policy) == []
    built = _changed(config, autoscale={"interval_seconds": 1, "webhook_url": "http://h/x"})
    assert [p.split(":")[0] for p in restart_needed(config, built)] == [
        "autoscale.interval_seconds",
        "autoscale.webhook_url",
    ]


def test_a_command_line_flag_makes_the_files_value_irrelevant(config: Config) -> None:
    """With --listen given, a new autoscale.listen in the file is no reason to refuse it."""
    moved = _changed(config, autoscale={"listen": "127.0.0.1:1"})
    assert restart_needed(config, moved, listen="127.0.0.1:2") == []
    assert restart_needed(config, moved)[0].startswith("autoscale.listen:")


def test_inputs_derived_from_other_sections_are_checked_when_the_pages_are_read(
    config: Config,
) -> None:
    """No collector_url: the collector's listen address is what is read; with Prometheus, not."""
    moved = _changed(config, collector={"listen": "127.0.0.1:1"})
    assert [p.split(":")[0] for p in restart_needed(config, moved)] == ["collector.listen"]
    assert restart_needed(config, moved, prometheus_url="http://prometheus:9090") == []
