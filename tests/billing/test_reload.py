"""A running billing process reloads its configuration on SIGHUP and on a change of the file:
teams, budgets and prices change without a restart, an invalid file is refused with its error and
the configuration in force stays, and every reload is on the audit trail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from infermeter.config import DEFAULT_CONFIG, hash_key
from infermeter.serving import free_port
from tests.billing.conftest import batch, gpu_samples, usage

ROOT = Path(__file__).parents[2]
ADMIN, INGEST = "im-demo-admin", "im-demo-ingest"
NEW_KEY = "a key of the new team ml"


def ingest(url: str, body: bytes) -> dict[str, Any]:
    """POST one batch to billing's ingest with the writer's token; its 200 answer."""
    answer = httpx.post(
        f"{url}/v1/ingest",
        content=body,
        timeout=30,
        headers={"authorization": f"Bearer {INGEST}"},
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def write(path: Path, data: dict[str, Any]) -> None:
    """Replace the file whole, as a ConfigMap update does (a new file renamed into place)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)


@pytest.fixture
def billing(tmp_path: Path) -> Iterator[tuple[str, Path, dict[str, Any], subprocess.Popen[str]]]:
    """``infermeter billing`` on a config file of its own; its URL, the file, its data, the process."""
    port = free_port()
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["billing"].update(
        listen=f"127.0.0.1:{port}",
        url=f"http://127.0.0.1:{port}",
        database=str(tmp_path / "ledger.duckdb"),
        shared_ingest_token=True,
    )
    path = tmp_path / "infermeter.yaml"
    write(path, data)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher", "billing", "--config", str(path)],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "billing did not start"
            time.sleep(0.1)
        yield url, path, data, process
    finally:
        process.terminate()
        process.wait(30)


def get(url: str, path: str, key: str = ADMIN) -> httpx.Response:
    return httpx.get(url + path, headers={"authorization": f"Bearer {key}"}, timeout=30)


def until(check: Any, seconds: float = 10.0) -> float:
    """Seconds until ``check()`` is true; fails past ``seconds``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < seconds, "not within the bound"
        time.sleep(0.1)
    return time.monotonic() - start


def test_sighup_reloads_teams_budgets_and_prices_and_refuses_an_invalid_file(billing):
    """A new team's key, a budget and a price take effect on SIGHUP; a file with a typo is
    refused naming the key, and what was in force stays; both are audited."""
    url, path, data, process = billing
    now = time.time()
    records = batch("usage", [usage("search", now - 600, 60)])
    samples = batch("gpu_samples", gpu_samples(start=now - 900, seconds=600))
    for body in (records, samples):
        ingest(url, body)
    month = time.strftime("%Y-%m", time.gmtime(now))
    before = get(url, f"/v1/chargeback/{month}").json()["fleet_cents"]
    assert get(url, "/v1/spend", NEW_KEY).status_code == 401

    data["teams"].append(
        {"name": "ml", "api_key_sha256": [hash_key(NEW_KEY)], "budget_usd_per_month": 50}
    )
    data["teams"][0]["budget_usd_per_month"] = 12345
    data["prices"]["usd_per_gpu_hour"]["L40S"] *= 10
    write(path, data)
    process.send_signal(signal.SIGHUP)
    until(lambda: get(url, "/v1/spend", NEW_KEY).status_code == 200)
    spend = {r["team"]: r["budget_usd"] for r in get(url, "/v1/spend").json()}
    assert spend[data["teams"][0]["name"]] == 12345
    assert spend["ml"] == 50
    after = get(url, f"/v1/chargeback/{month}").json()["fleet_cents"]
    assert after > 5 * before > 0

    write(path, {**data, "teems": []})
    process.send_signal(signal.SIGHUP)
    until(
        lambda: any(e["action"] == "config.refused" for e in get(url, "/v1/audit").json()["events"])
    )
    assert get(url, "/v1/spend", NEW_KEY).status_code == 200  # the configuration in force stayed
    events = [
        e for e in get(url, "/v1/audit").json()["events"] if e["action"].startswith("config.")
    ]
    assert [e["action"] for e in events] == ["config.reloaded", "config.refused"]  # each read once
    assert "teems" in events[1]["why"]
    assert events[0]["actor"] == "operator (SIGHUP)"


def test_a_changed_file_is_reloaded_without_a_signal(billing):
    """A ConfigMap update (the file replaced) is taken within the watch interval."""
    url, path, data, _ = billing
    data["teams"].append({"name": "ml", "api_key_sha256": [hash_key(NEW_KEY)]})
    write(path, data)
    took = until(lambda: get(url, "/v1/spend", NEW_KEY).status_code == 200)
    assert took < 5
    [event] = [
        e for e in get(url, "/v1/audit").json()["events"] if e["action"] == "config.reloaded"
    ]
    assert event["actor"] == "operator (file change)"


def test_a_setting_billing_cannot_change_running_is_refused_whole(billing):
    """A new ledger path is refused (a restart takes it), and the new team beside it is not taken."""
    url, path, data, process = billing
    data["teams"].append({"name": "ml", "api_key_sha256": [hash_key(NEW_KEY)]})
    data["billing"]["database"] = str(path.with_name("other.duckdb"))
    write(path, data)
    process.send_signal(signal.SIGHUP)
    until(
        lambda: any(e["action"] == "config.refused" for e in get(url, "/v1/audit").json()["events"])
    )
    assert get(url, "/v1/spend", NEW_KEY).status_code == 401
    [event] = [e for e in get(url, "/v1/audit").json()["events"] if e["action"] == "config.refused"]
    assert "billing.database" in event["why"]


def test_sighup_changes_which_projects_a_usage_record_may_carry(billing):
    """The service started without projects quarantines a record of project beta; after a
    reload that gives search beta, the same project's next record is kept."""
    url, path, data, process = billing
    now = time.time()

    def send() -> dict[str, Any]:
        return ingest(url, batch("usage", [usage("search", now - 600, 60, project="beta")]))

    before = send()
    data["teams"][0]["projects"] = ["alpha", "beta"]
    write(path, data)
    process.send_signal(signal.SIGHUP)
    until(
        lambda: any(
            e["action"] == "config.reloaded" for e in get(url, "/v1/audit").json()["events"]
        )
    )
    after = send()
    assert (before["accepted"], [q["reason"] for q in before["quarantined"]]) == (
        0,
        ['project "beta" is not one team "search" allows'],
    )
    assert (after["accepted"], after["quarantined"]) == (1, [])
