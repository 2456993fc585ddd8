"""The sidecar's GenAI metrics reach a real OTLP receiver and agree with its Prometheus page."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from infermeter.config import DEFAULT_CONFIG
from infermeter.otlp import GEN_AI_LATEST, OtlpSettings
from infermeter.serving import free_port
from sidecar.app import Sidecar
from sidecar.otel_metrics import DURATION_BOUNDS, TOKEN_BOUNDS, TPOT_BOUNDS, TTFT_BOUNDS
from simulator.replica import ReplicaSim, replica_spec
from tests.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver, Point
from tests.servers import serving, sidecar_process, stop_process
from tests.sidecar.conftest import KEYS, METRICS_TOKEN, make_config

CHAT = {
    "model": "chat-small",
    "messages": [{"role": "user", "content": "count please"}],
    "max_tokens": 8,
}
SERVER = (
    "gen_ai.operation.name",
    "gen_ai.provider.name",
    "gen_ai.request.model",
    "server.address",
    "server.port",
    "infermeter.team",
)
EXPECTED = {  # name: (unit, kind, bounds)
    "gen_ai.server.request.duration": ("s", "histogram", DURATION_BOUNDS),
    "gen_ai.server.time_to_first_token": ("s", "histogram", TTFT_BOUNDS),
    "gen_ai.server.time_per_output_token": ("s", "histogram", TPOT_BOUNDS),
    "gen_ai.client.token.usage": ("{token}", "histogram", TOKEN_BOUNDS),
}


def prometheus(text: str) -> dict[tuple[str, str, str], float]:
    """(sample name, team, model) -> value, summed over any other label."""
    out: dict[tuple[str, str, str], float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "team" in s.labels and "le" not in s.labels:
                out[(s.name, s.labels["team"], s.labels.get("model", ""))] += s.value
    return out


def otlp(points: list[Point], name: str, field: str, **match: str) -> dict[tuple[str, str], float]:
    """(team, model) -> the points' ``field`` (count, sum), summed over every other attribute."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for p in points:
        if p.name == name and all(p.attributes.get(k) == v for k, v in match.items()):
            out[(p.attributes["infermeter.team"], p.attributes["gen_ai.request.model"])] += getattr(
                p, field
            )
    return out


def prom(page: dict[tuple[str, str, str], float], name: str) -> dict[tuple[str, str], float]:
    """(team, model) -> the page's ``name`` samples, zeros left out."""
    return {(team, model): v for (n, team, model), v in page.items() if n == name and v}


async def traffic(url: str) -> None:
    """Six requests of two teams: streamed and whole chats, a text completion, an unknown model."""
    async with contextlib.AsyncExitStack() as stack:
        search, assistant = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=url, timeout=60, headers={"authorization": f"Bearer {KEYS[t]}"}
                )
            )
            for t in ("search", "assistant")
        ]
        for body in ({**CHAT, "stream": True}, CHAT):
            assert (await search.post("/v1/chat/completions", json=body)).status_code == 200
            assert (await assistant.post("/v1/chat/completions", json=body)).status_code == 200
        text = {"model": "chat-small", "prompt": "one two", "max_tokens": 5, "stream": True}
        assert (await assistant.post("/v1/completions", json=text)).status_code == 200
        refused = await search.post("/v1/chat/completions", json={**CHAT, "model": "no-such-model"})
        assert refused.status_code == 404


async def metrics_page(url: str) -> str:
    async with httpx.AsyncClient() as c:
        r = await c.get(f"{url}/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
    assert r.status_code == 200
    return r.text


def assert_agree(points: list[Point], page_text: str) -> None:
    """Counts and sums per team and model equal the Prometheus page's."""
    page = prometheus(page_text)
    duration = "gen_ai.server.request.duration"
    assert otlp(points, duration, "count") == prom(
        page, "infermeter_request_duration_seconds_count"
    )
    for field in ("count", "sum"):
        got = otlp(points, "gen_ai.server.time_to_first_token", field)
        want = prom(page, f"infermeter_time_to_first_token_seconds_{field}")
        assert got.keys() == want.keys()
        assert all(abs(got[k] - want[k]) < 1e-9 for k in want)
    got_duration = otlp(points, duration, "sum")
    want_duration = prom(page, "infermeter_request_duration_seconds_sum")
    assert all(abs(got_duration[k] - want_duration[k]) < 1e-9 for k in want_duration)
    tpot = otlp(points, "gen_ai.server.time_per_output_token", "count")
    assert tpot == prom(page, "infermeter_output_tokens_per_second_count")


@contextlib.contextmanager
def otel_sidecar(tmp_path: Path, upstream_port: int, env: dict[str, str]) -> Iterator[str]:
    """``infermeter sidecar`` in front of the replica at ``upstream_port``; yields its URL."""
    port = free_port()
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["replicas"][1].update(
        upstream_url=f"http://127.0.0.1:{upstream_port}", sidecar_listen=f"127.0.0.1:{port}"
    )
    data["sidecar"] = {"spool_dir": str(tmp_path / "spool")}
    config = tmp_path / "infermeter.yaml"
    config.write_text(yaml.safe_dump(data))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INFERMETER"))}
    url = f"http://127.0.0.1:{port}"
    proc = sidecar_process(str(config), url, env={**clean, **env})
    try:
        yield url
    finally:
        stop_process(proc, grace=30)


def replica(upstream_port: int) -> ReplicaSim:
    return ReplicaSim(replica_spec(make_config(f"http://127.0.0.1:{upstream_port}"), "small-0"))


@pytest.mark.timeout(120)
async def test_a_sidecar_started_with_the_otel_variables_pushes_the_genai_metrics(tmp_path):
    """As a user would run it: the standard variables, six requests, and the GenAI metrics on
    /v1/metrics (sent at exit, the interval being a minute), equal to /metrics'."""
    up = free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_METRICS_EXPORTER": "otlp"}
    with OtlpHttpReceiver() as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.url
        async with serving(replica(up), up):
            with otel_sidecar(tmp_path, up, env) as url:
                await traffic(url)
                page = await metrics_page(url)
                assert not receiver.metrics, "nothing is sent before the interval, but at exit"
            points = receiver.latest()
    assert {p.name for p in points} == set(EXPECTED)
    for p in points:
        unit, kind, bounds = EXPECTED[p.name]
        assert (p.unit, p.kind, p.cumulative, tuple(p.bounds)) == (unit, kind, True, bounds)
        assert set(SERVER) <= set(p.attributes), p
        assert p.attributes["gen_ai.provider.name"] == "vllm"
        assert p.attributes["server.port"] == up
        assert p.attributes["infermeter.team"] in {"search", "assistant"}
    assert {p.attributes["gen_ai.operation.name"] for p in points} == {"chat", "text_completion"}
    assert_agree(points, page)
    errors = [p for p in points if "error.type" in p.attributes]
    assert [(p.name, p.attributes["error.type"], p.count) for p in errors] == [
        ("gen_ai.server.request.duration", "rejected", 1)
    ]
    assert all(
        "error.type" not in p.attributes
        for p in points
        if p.name != "gen_ai.server.request.duration"
    )
    page_tokens = prometheus(page)
    for kind, family in (
        ("input", "infermeter_prompt_tokens_total"),
        ("output", "infermeter_completion_tokens_total"),
    ):
        got = otlp(points, "gen_ai.client.token.usage", "sum", **{"gen_ai.token.type": kind})
        assert got == prom(page_tokens, family)
    resource = receiver.resources()[-1]
    assert resource["service.name"] == "infermeter-sidecar-small-0"
    assert "service.instance.id" in resource
    assert receiver.scopes()[-1] == (
        "infermeter.sidecar",
        "https://opentelemetry.io/schemas/1.41.0",
    )


@contextlib.asynccontextmanager
async def in_process(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    receiver_url: str,
    config_changes: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[Sidecar, str]]:
    """A replica and an in-process sidecar exporting to ``receiver_url`` every 0.1 s
    (``config_changes``: as ``make_config`` takes them)."""
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver_url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.3")
    up = free_port()
    config = make_config(f"http://127.0.0.1:{up}", **(config_changes or {}))
    otlp_settings = OtlpSettings(
        **{"protocol": "http/protobuf", "interval_seconds": 0.1, **settings}
    )
    sidecar = Sidecar(config, "small-0", spool_dir=tmp_path / "spool", otlp=otlp_settings)
    async with serving(replica(up), up), serving(sidecar, limits=sidecar.server_limits) as url:
        yield sidecar, url


async def until(check: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.05)


async def test_gen_ai_latest_experimental_counts_tokens_with_the_latest_conventions(
    tmp_path, monkeypatch
):
    """With the opt-in, token usage is the genai repository's counters (input, output, cached),
    summing to the Prometheus token counters; the server histograms stay as they are."""
    with OtlpHttpReceiver() as receiver:
        async with in_process(
            tmp_path, monkeypatch, receiver.url, opt_in=frozenset({GEN_AI_LATEST})
        ) as (_, url):
            await traffic(url)
            page = await metrics_page(url)
            await until(
                lambda: (
                    sum(otlp(receiver.latest(), "gen_ai.server.request.duration", "count").values())
                    == 6
                )
            )
            points = receiver.latest()
    names = {p.name for p in points}
    assert "gen_ai.client.token.usage" not in names
    assert {"gen_ai.server.request.duration", "gen_ai.server.time_to_first_token"} <= names
    assert_agree(points, page)
    tokens = prometheus(page)
    for name, family in (
        ("input_tokens", "infermeter_prompt_tokens_total"),
        ("output_tokens", "infermeter_completion_tokens_total"),
    ):
        counter = [p for p in points if p.name == f"gen_ai.client.inference.usage.{name}"]
        assert counter
        assert all(p.kind == "sum" and p.monotonic and p.unit == "{token}" for p in counter)
        assert all(p.attributes["gen_ai.token.modality"] == "unknown" for p in counter)
        assert otlp(counter, counter[0].name, "value") == prom(tokens, family)
    assert receiver.scopes()[-1] == ("infermeter.sidecar", "")


async def test_an_export_has_the_requests_ended_before_it_without_a_tick(tmp_path, monkeypatch):
    """Requests' metrics wait for the tick (here, a minute away): the export settles them first,
    so the requests ended before an export are in it, as in a scrape."""
    with OtlpHttpReceiver() as receiver:
        no_tick = {"sidecar.journal_mark_millis": 60_000}
        async with in_process(tmp_path, monkeypatch, receiver.url, no_tick) as (sidecar, url):
            await traffic(url)
            await until(
                lambda: (
                    sum(otlp(receiver.latest(), "gen_ai.server.request.duration", "count").values())
                    == 6
                )
            )
            assert sidecar.accounting.unsettled == 0


async def test_grpc_carries_the_same_metrics(tmp_path, monkeypatch):
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc: the same points reach a gRPC receiver."""
    with OtlpGrpcReceiver() as receiver:
        async with in_process(tmp_path, monkeypatch, receiver.url, protocol="grpc") as (_, url):
            await traffic(url)
            page = await metrics_page(url)
            await until(
                lambda: (
                    sum(otlp(receiver.latest(), "gen_ai.server.request.duration", "count").values())
                    == 6
                )
            )
            points = receiver.latest()
    assert {p.name for p in points} == set(EXPECTED)
    assert_agree(points, page)


@pytest.mark.parametrize("failure", ["down", "status 500", "slow"])
async def test_a_failing_receiver_neither_slows_nor_fails_requests(
    tmp_path, monkeypatch, caplog, failure
):
    """Receiver down, answering 500 or too slowly: every request is served as quickly as
    without export, the outage is one log line (and its end one), and each failed export is
    counted on /metrics."""
    receiver = OtlpHttpReceiver()
    if failure == "status 500":
        receiver.status = 500
    elif failure == "slow":
        receiver.delay_seconds = 2.0  # past the exporter's timeout (0.3 s)
    if failure != "down":
        receiver.start()
    caplog.set_level(logging.INFO)
    try:
        async with in_process(tmp_path, monkeypatch, receiver.url) as (sidecar, url):
            export = sidecar.otlp
            assert export is not None
            async with httpx.AsyncClient(
                base_url=url, timeout=60, headers={"authorization": f"Bearer {KEYS['search']}"}
            ) as c:
                took = []
                for _ in range(12):
                    start = time.perf_counter()
                    r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
                    took.append(time.perf_counter() - start)
                    assert r.status_code == 200
                    assert r.text.rstrip().endswith("data: [DONE]")
                    await asyncio.sleep(0.05)
                await until(lambda: export.failures._value.get() >= 2)
                assert max(took) < 0.5, took  # a request takes ~50 ms on this engine
                failed = prometheus_value(
                    await metrics_page(url), "infermeter_otlp_export_failures_total"
                )
                assert failed >= 2
                # The receiver comes back: one line says so, and the totals arrive.
                receiver.status, receiver.delay_seconds = 200, 0.0
                if failure == "down":
                    receiver.start()
                await until(lambda: export.failing_since is None)
                await until(
                    lambda: (
                        sum(
                            otlp(
                                receiver.latest(), "gen_ai.server.request.duration", "count"
                            ).values()
                        )
                        == 12
                    )
                )
    finally:
        receiver.stop()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("opentelemetry") or r.name == "infermeter.otlp"
    ]
    assert len([m for m in lines if m.startswith("OTLP metric export failing")]) == 1, lines
    assert len([m for m in lines if m.startswith("OTLP metric export works again")]) == 1, lines
    assert len(lines) == 2, lines  # none of the exporter's own per-attempt lines


def prometheus_value(text: str, name: str) -> float:
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def test_with_export_off_no_sdk_is_loaded_and_nothing_kept():
    """No OTEL_* variable: serve's check loads neither the SDK nor the GenAI module, and a
    sidecar keeps no GenAI figures; asked for, the export loads them (a fresh interpreter)."""
    probe = textwrap.dedent(
        """
        import os, sys, tempfile
        from pathlib import Path
        import sidecar.serve
        from infermeter.config import DEFAULT_CONFIG, load_config
        from infermeter.otlp import metrics_export_configured, otlp_settings
        from sidecar.app import Sidecar
        config = load_config(DEFAULT_CONFIG, environ={})
        otlp = otlp_settings() if metrics_export_configured() else None
        app = Sidecar(config, "small-0", spool_dir=Path(tempfile.mkdtemp()), otlp=otlp)
        print(app.accounting.genai is None, app.otlp is None, " ".join(
            m for m in ("opentelemetry.sdk", "infermeter.otlp_export", "sidecar.otel_metrics")
            if m in sys.modules))
        """
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    root = Path(__file__).parents[2]
    off = subprocess.run(
        [sys.executable, "-c", probe],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=root,
    )
    assert off.stdout.split() == ["True", "True"]
    on = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=root,
        env={**clean, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert on.stdout.split() == [
        "False",
        "False",
        "opentelemetry.sdk",
        "infermeter.otlp_export",
        "sidecar.otel_metrics",
    ]


@pytest.mark.timeout(120)
def test_a_span_export_timeout_read_as_hours_stops_the_start(tmp_path):
    """Spans only, with the specification's 10000 for their timeout: the span exporter would read
    10,000 s, hold every later span behind one send to a silent receiver and the way out for
    the SDK's 30 s; the sidecar does not start, and its one line names the variable."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["replicas"][1].update(sidecar_listen=f"127.0.0.1:{free_port()}")
    data["sidecar"] = {"spool_dir": str(tmp_path / "spool")}
    config = tmp_path / "infermeter.yaml"
    config.write_text(yaml.safe_dump(data))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INFERMETER"))}
    env = {
        **clean,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "10000",
    }
    command = [sys.executable, "-m", "launcher", "sidecar", "--config", str(config)]
    proc = subprocess.Popen(
        [*command, "--replica", "small-0"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        stop_process(proc, grace=10)
        raise AssertionError("the sidecar started with a span export timeout of 10,000 s") from None
    assert proc.returncode == 2, err
    assert err.strip().splitlines()[-1] == (
        "infermeter: cannot export over OTLP: OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='10000': "
        "10000 s, longer than OTEL_BSP_EXPORT_TIMEOUT (30 s); the exporter reads seconds, not "
        "the specification's milliseconds"
    )
