"""KEDA's triggers as a real Prometheus answers them, while the autoscaler runs and while it is away.

Each ScaledObject's prometheus trigger is a PromQL query of the autoscaler's
``infermeter_desired_replicas{model}``. KEDA reads an empty answer as 0 unless told otherwise, and
the HPA takes 0 for ``minReplicaCount``; a target Prometheus can no longer scrape (the autoscaler
in a rollout, restarting, its node lost) answers nothing. So each query is run here against
Prometheus (Debian's ``/usr/bin/prometheus``, scraping every second) scraping a stand-in of the
autoscaler's ``/metrics``, before and after that stand-in stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from infermeter.serving import free_port
from tests.alerts.prometheus import running_prometheus

KUSTOMIZE = Path(__file__).parents[2] / "deploy" / "kubernetes"
SCALED_OBJECTS = KUSTOMIZE / "scaledobjects.yaml"


def _stalled_alert() -> dict[str, Any]:
    """The deployed PrometheusRule's alert on an autoscaler that no longer decides."""
    doc: dict[str, Any] = yaml.safe_load((KUSTOMIZE / "prometheusrule.yaml").read_text())
    found: list[dict[str, Any]] = [
        r
        for g in doc["spec"]["groups"]
        for r in g["rules"]
        if "infermeter_autoscale_last_tick_timestamp_seconds" in r["expr"] and "alert" in r
    ]
    assert found, "no deployed alert on the autoscaler KEDA follows"
    (alert,) = found
    return alert


def _triggers() -> dict[str, dict[str, Any]]:
    """Each ScaledObject's trigger metadata, by the model its query names."""
    out = {}
    for doc in yaml.safe_load_all(SCALED_OBJECTS.read_text()):
        if doc:
            (trigger,) = doc["spec"]["triggers"]
            meta: dict[str, Any] = trigger["metadata"]
            model = meta["query"].split('model="', 1)[1].split('"', 1)[0]
            out[model] = meta
    assert out
    return out


@pytest.fixture
def autoscaler_page() -> Iterator[tuple[int, ThreadingHTTPServer]]:
    """A stand-in of the autoscaler's /metrics: a desired count per model, 3, 4, ..., decided now."""
    desired = "".join(
        f'infermeter_desired_replicas{{model="{m}"}} {3 + i}\n' for i, m in enumerate(_triggers())
    )

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            page = f"{desired}infermeter_autoscale_last_tick_timestamp_seconds {time.time()}\n"
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(page.encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield port, server
    finally:
        server.shutdown()
        server.server_close()


def _answer(url: str, query: str) -> list[float]:
    data = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=10).json()
    assert data["status"] == "success", data
    return [float(r["value"][1]) for r in data["data"]["result"]]


def _until(check: Any, seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.5)
    pytest.fail(f"not within {seconds} s")


def test_every_trigger_keeps_the_last_desired_count_while_the_autoscaler_is_away(
    tmp_path: Path, autoscaler_page: tuple[int, ThreadingHTTPServer]
) -> None:
    """While the autoscaler's page is scraped each trigger reads its model's count; once it stops
    answering, each still reads that count, never nothing (which KEDA would scale to the minimum)."""
    port, server = autoscaler_page
    triggers = _triggers()
    scrape = [{"job_name": "autoscaler", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]
    with running_prometheus(tmp_path, scrape, []) as url:
        expected = {m: float(3 + i) for i, m in enumerate(triggers)}
        for model, meta in triggers.items():
            assert _until(lambda q=meta["query"]: _answer(url, q), 30) == [expected[model]]
        assert _answer(url, _stalled_alert()["expr"]) == []
        server.shutdown()
        # The next scrape fails: Prometheus marks the page's series stale at once.
        _until(lambda: not _answer(url, "infermeter_desired_replicas"), 30)
        for model, meta in triggers.items():
            assert _answer(url, meta["query"]) == [expected[model]], model
            # And nothing left to hold is an error for KEDA (its fallback), not a 0.
            assert meta["ignoreNullValues"] == "false"


def test_an_autoscaler_that_stops_deciding_is_alerted_on(
    tmp_path: Path, autoscaler_page: tuple[int, ThreadingHTTPServer]
) -> None:
    """The hold above hides an autoscaler that is gone, so the deployed rules alert on it: its
    expression is false while the page is scraped and decides, true once it is not scraped."""
    port, server = autoscaler_page
    alert = _stalled_alert()
    assert alert["labels"]["severity"] == "critical"
    scrape = [{"job_name": "autoscaler", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]
    with running_prometheus(tmp_path, scrape, []) as url:
        _until(lambda: _answer(url, "infermeter_autoscale_last_tick_timestamp_seconds"), 30)
        assert _answer(url, alert["expr"]) == []
        server.shutdown()
        assert _until(lambda: _answer(url, alert["expr"]), 30) == [1.0]


def test_while_prometheus_cannot_be_read_keda_keeps_the_replicas_running() -> None:
    """With Prometheus itself down every trigger errs, and after ``failureThreshold`` polls KEDA
    applies the fallback: its static default is ``replicas`` (min_replicas here), which would
    scale every model down at once because nothing can be seen. ``currentReplicasIfHigher``
    (KEDA 2.17) keeps what runs, and min_replicas when fewer run."""
    docs = [d for d in yaml.safe_load_all(SCALED_OBJECTS.read_text()) if d]
    assert docs
    for so in docs:
        spec = so["spec"]
        assert spec["fallback"].get("behavior") == "currentReplicasIfHigher", so["metadata"]["name"]
        assert spec["fallback"]["replicas"] == spec["minReplicaCount"]
        # KEDA takes a fallback only with an AverageValue trigger.
        assert any(t["metricType"] == "AverageValue" for t in spec["triggers"])
