"""One replica group goes 1 -> 3 -> 1 instances under traffic, and billing gets every one right.

Real processes over loopback: the billing service on a DuckDB file, the collector (discovering
engines from billing's instance registry, reading GPUs from the node's dcgm-exporter stand-in,
which labels lent boards with their pod), and the local scale hook starting and stopping
simulated instances (a simulated vLLM replica and a sidecar each). The ledger is then read
directly, once billing has stopped, and compared with what the simulator itself counted.

How the GPU-second windows are aligned: the simulator counts an instance's GPU-seconds as its
GPUs' wall time since its process began; billing counts each GPU sample as covering the
``interval_seconds`` before its ``timestamp``. The test reads the simulator's figures at two
moments ``a`` and ``b`` while the instance is in the instances file (so every scrape in between
sees its pod label, which places its GPU before the registry lists it): the simulator's
GPU-seconds for the window are the difference of the two.
Billing's for the same window are each of the instance's samples clipped to ``[a, b]`` (the
part of its interval inside the window), the same overlap the rollups use to spread a sample
over minute slots. Time before ``a`` (the process starting before its pod label shows) and
after ``b`` (stopping) is counted by neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import polars as pl
import pytest
import yaml

from alerts.autoscale.local import LocalScaleHook
from alerts.autoscale.policy import Decision
from billing import allocation_runs
from billing.chargeback import Chargeback, policy_from_config
from billing.serve import open_ledger
from infermeter.config import DEFAULT_CONFIG, Config, load_config
from infermeter.local_fleet import LocalInstance, read_fleet
from infermeter.serving import free_port
from infermeter.spool import read_segment
from infermeter.statement import Statement
from launcher.fleet import writer_environments
from simulator.dcgm import node_exporters
from tests.ports import off_demo_ports
from tests.servers import serving, stop_process

GROUP = "small-0"
OWNER = "research"  # the group's idle goes to its owner, a team that sends no traffic
KEYS = {
    "search": "im-demo-search",
    "assistant": "im-demo-assistant",
    "analytics": "im-demo-analytics",
}
ADMIN = {"authorization": "Bearer im-demo-admin"}
TOKENS = {
    "INFERMETER_METRICS_TOKEN": "im-demo-metrics",
}
# Billing, the collector and the hook (which issues its instances' credentials) get their part
# of what the demo hands its children (``writer_environments``).
WRITER_SECRET = b"the dynamic fleet's writer secret"
SCRAPE_SECONDS = 0.5
NAMES = [f"vllm-{GROUP}-{n}" for n in (1, 2, 3)]
WAIT_SECONDS = 90.0  # generous: the machine may be busy; every wait polls its condition


@dataclass(frozen=True)
class Window:
    """The simulator's figures for one instance at two moments, and when they were read."""

    instance: str
    a: float
    b: float
    gpu_seconds: float


def write_config(tmp_path: Path) -> tuple[Path, Config]:
    """The demo configuration cut to node-b and group small-0 (idle to its owner), fast timings."""
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    billing = f"127.0.0.1:{free_port()}"
    raw["replicas"] = [
        {**r, "idle_policy": "owner", "owner_team": OWNER}
        for r in raw["replicas"]
        if r["id"] == GROUP
    ]
    raw["nodes"] = [
        {
            "name": "node-b",
            "gpu_model": "L40S",
            "gpu_count": 4,
            "dcgm_exporter_url": f"http://127.0.0.1:{free_port()}/metrics",
        }
    ]
    raw["scaling"]["min_replicas"] = 1
    # The test starts three instances itself (no scaling decision asks for them): the ceiling the
    # configuration allows, past which billing's registry lists none (infermeter.fleet_bound).
    raw["scaling"]["max_replicas"] = len(NAMES)
    # A price that makes the few minutes of the test worth many cents, so rounding is exercised.
    raw["prices"]["usd_per_gpu_hour"]["L40S"] = 1600.0
    raw["sidecar"].update(
        spool_dir=str(tmp_path / "spool"),
        ingest_url=f"http://{billing}/v1/ingest",
        heartbeat_seconds=1.0,
        drain_seconds=5,
        drain_ship_seconds=5,
    )
    raw["billing"].update(
        listen=billing, url=f"http://{billing}", database=str(tmp_path / "ledger.duckdb")
    )
    raw["collector"] = {
        "listen": f"127.0.0.1:{free_port()}",
        "scrape_interval_seconds": SCRAPE_SECONDS,
        "gap_after_intervals": 20,
        "spool_dir": str(tmp_path / "collector-spool"),
        "ingest_url": f"http://{billing}/v1/ingest",
        "discovery": "registry",
        "registry": {"refresh_seconds": 1.0},
        "adopt_spools_dir": str(tmp_path / "spool"),
    }
    raw["simulator"]["instances_file"] = str(tmp_path / "instances.json")
    raw["autoscale"] = {
        "history_file": "",
        "local": {
            "enabled": True,
            "count_fixed_replicas": False,
            "groups": {"chat-small": GROUP},
            "ready_timeout_seconds": 60,
            "stop_timeout_seconds": 30,
        },
    }
    path = tmp_path / "infermeter.yaml"
    # What it left at the demo's addresses (small-0's own, the dashboard's) moves to free ports.
    path.write_text(yaml.safe_dump(off_demo_ports(raw)))
    return path, load_config(path, environ={})


def environ(config: Config | None = None, name: str = "") -> dict[str, str]:
    """This process's environment with the metrics token, and the writer credential or secret
    ``name`` (a child of the demo's) gets."""
    writers = writer_environments(config, WRITER_SECRET).get(name, {}) if config else {}
    return {**os.environ, **TOKENS, **writers}


@contextlib.contextmanager
def process(
    args: list[str], path: Path, config: Config | None = None, name: str = ""
) -> Iterator[subprocess.Popen[bytes]]:
    """``infermeter <args> --config <path>`` for the block, as demo child ``name`` would run;
    SIGTERM (then SIGKILL) after it."""
    argv = [sys.executable, "-m", "launcher", *args, "--config", str(path)]
    proc = subprocess.Popen(argv, env=environ(config, name))
    try:
        yield proc
    finally:
        stop_process(proc, grace=30)


async def until(what: str, check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``WAIT_SECONDS``."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def answers(client: httpx.AsyncClient, url: str) -> bool:
    """True once ``url`` answers below 500."""
    with contextlib.suppress(httpx.HTTPError):
        return (await client.get(url, timeout=2.0)).status_code < 500
    return False


async def chat(client: httpx.AsyncClient, sidecar_url: str, key: str, stream: bool) -> Counter[str]:
    """One chat through a sidecar: the prompt and completion tokens its answer reports."""
    body: dict[str, Any] = {
        "model": "chat-small",
        "max_tokens": 12,
        "stream": stream,
        "messages": [{"role": "user", "content": "count the GPUs"}],
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {key}"}
    url = f"{sidecar_url}/v1/chat/completions"
    usage: dict[str, int] = {}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        if not stream:
            usage = orjson.loads(await response.aread())["usage"]
        else:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = orjson.loads(line[6:]).get("usage") or usage
    return Counter(prompt=usage["prompt_tokens"], completion=usage["completion_tokens"])


async def traffic(
    client: httpx.AsyncClient, urls: list[str], seconds: float, tally: dict[str, Counter[str]]
) -> None:
    """Every team sends chats round-robin over ``urls`` for ``seconds``; tokens added to ``tally``."""
    deadline = time.monotonic() + seconds

    async def team(name: str, lane: int) -> None:
        n = lane
        while time.monotonic() < deadline:
            tally[name] += await chat(client, urls[n % len(urls)], KEYS[name], stream=lane == 0)
            n += 1

    # One request per team at a time: no instance has 60 in-flight seconds in a minute, so
    # every instance leaves idle capacity for its group's policy to charge.
    await asyncio.gather(*(team(name, lane) for lane, name in enumerate(KEYS)))


async def sim_usage(client: httpx.AsyncClient, upstream_url: str) -> tuple[float, dict[str, Any]]:
    """The simulator's own figures for an instance, and the wall time they were read at."""
    before = time.time()
    figures: dict[str, Any] = (await client.get(f"{upstream_url}/_sim/usage")).json()
    return (before + time.time()) / 2, figures


async def opened(
    client: httpx.AsyncClient, live: list[LocalInstance], starts: dict[str, tuple[float, float]]
) -> None:
    """Open a window for each live instance that has none: when, and its GPU-seconds then."""
    for inst in live:
        if inst.instance not in starts:
            t, figures = await sim_usage(client, inst.upstream_url)
            starts[inst.instance] = (t, figures["gpu_seconds_seen"])


async def closed(
    client: httpx.AsyncClient,
    live: list[LocalInstance],
    starts: dict[str, tuple[float, float]],
    out: list[Window],
) -> None:
    """Close the windows of ``live`` (still running): the simulator's GPU-seconds in each."""
    for inst in live:
        a, first = starts[inst.instance]
        b, figures = await sim_usage(client, inst.upstream_url)
        out.append(Window(inst.instance, a, b, figures["gpu_seconds_seen"] - first))


def sidecars(hook: LocalScaleHook) -> list[str]:
    """The sidecar URLs of the hook's live instances."""
    return [str(i.sidecar_url) for i in hook.instances()]


def decision(desired: int) -> Decision:
    return Decision("chat-small", 0.0, desired, desired, ("test",))


def spooled(root: Path, older_than: float | None = None) -> list[dict[str, Any]]:
    """Records still in the spools under ``root`` (those stamped at or before ``older_than``)."""
    records = []
    for seg in sorted(root.rglob("seg-*.jsonl")):
        # The shipper removes a segment billing acknowledged: listed, then gone, it is shipped.
        with contextlib.suppress(FileNotFoundError):
            records += read_segment(seg)[0]
    if older_than is None:
        return records
    return [r for r in records if r.get("timestamp", 0.0) <= older_than]


def ledger_gpu_seconds(config: Config, window: Window) -> float:
    """The instance's GPU samples in the ledger, each clipped to the window."""
    ledger = open_ledger(config)
    try:
        with ledger.reader() as con:
            row = con.execute(
                """SELECT sum(greatest(0.0, least("timestamp", $b)
                                    - greatest("timestamp" - interval_seconds, $a)))
                   FROM gpu_samples WHERE instance = $instance""",
                {"a": window.a, "b": window.b, "instance": window.instance},
            ).fetchone()
    finally:
        ledger.close()
    return float(row[0]) if row and row[0] is not None else 0.0


@dataclass(frozen=True)
class Run:
    """What one run of the scenario left: its configuration, ledger file and the figures to check."""

    config: Config
    windows: list[Window]
    tally: dict[str, Counter[str]]
    lifetimes: dict[str, dict[str, Any]]
    months: list[str]


async def scale_under_traffic(tmp_path: Path) -> Run:
    """Run the fleet through 1 -> 3 -> 1 instances under traffic; return once all is in the ledger."""
    path, config = write_config(tmp_path)
    first_month = time.strftime("%Y-%m", time.gmtime())
    tally: dict[str, Counter[str]] = {name: Counter() for name in KEYS}
    seen: list[Window] = []
    collector_spool = Path(config.collector.spool_dir)
    billing_url = config.billing.url
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=60.0))
        dcgm = node_exporters(config, client, Path(config.simulator.instances_file))["node-b"]
        dcgm_port = httpx.URL(str(config.nodes[0].dcgm_exporter_url)).port
        await stack.enter_async_context(serving(dcgm, dcgm_port))
        billing = stack.enter_context(process(["billing"], path, config, "billing"))
        await until("billing", lambda: answers(client, f"{billing_url}/healthz"))
        collector = stack.enter_context(process(["collect"], path, config, "collector"))
        await until(
            "the collector", lambda: answers(client, f"http://{config.collector.listen}/metrics")
        )
        hook = LocalScaleHook(config, path, client, environ=environ(config, "autoscaler"))
        starts: dict[str, tuple[float, float]] = {}
        try:
            await hook.publish(decision(1))
            await opened(client, hook.instances(), starts)
            await traffic(client, sidecars(hook), 4.0, tally)
            await hook.publish(decision(3))
            await opened(client, hook.instances(), starts)
            await traffic(client, sidecars(hook), 10.0, tally)
            # The newest two are stopped next: their windows end while they still run.
            await closed(client, hook.instances()[1:], starts, seen)
            await hook.publish(decision(1))
            await traffic(client, sidecars(hook), 4.0, tally)
            await closed(client, hook.instances(), starts, seen)
        finally:
            await hook.close()
        stopped_at = time.time()

        async def registry() -> dict[str, dict[str, Any]]:
            response = await client.get(
                f"{billing_url}/v1/instances", params={"state": "all"}, headers=ADMIN
            )
            return {i["instance"]: i for i in response.json()["instances"] if i["replica"] == GROUP}

        async def all_stopped() -> bool:
            rows = (await registry()).values()
            return len(rows) == 3 and all(i["state"] == "stopped" for i in rows)

        async def shipped() -> bool:
            # Every sidecar record is acknowledged, and the collector has scraped past the last
            # stop with nothing older left in its spool (a segment goes once billing keeps it).
            recent = spooled(collector_spool)
            return (
                not spooled(Path(config.sidecar.spool_dir))
                and any(r.get("timestamp", 0.0) > stopped_at for r in recent)
                and not spooled(collector_spool, older_than=stopped_at)
            )

        await until("every lifetime closed in the registry", all_stopped)
        await until("every record shipped", shipped)
        lifetimes = await registry()
        stop_process(collector, grace=30)
        stop_process(billing, grace=30)
    months = sorted({first_month, time.strftime("%Y-%m", time.gmtime(stopped_at))})
    return Run(config, seen, tally, lifetimes, months)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One run of the scenario, shared by the checks below (it takes about half a minute)."""
    return asyncio.run(scale_under_traffic(tmp_path_factory.mktemp("fleet")))


@pytest.fixture(scope="module")
def statements(run: Run) -> list[Statement]:
    """The statements of the months the run spanned (one, unless it crossed a month's end)."""
    ledger = open_ledger(run.config)
    try:
        return [Chargeback(ledger, run.config).statement(m) for m in run.months]
    finally:
        ledger.close()


def test_every_instance_has_a_closed_lifetime(run: Run) -> None:
    """The registry keeps all three instances, each stopped with a start before its stop."""
    assert sorted(run.lifetimes) == NAMES
    for life in run.lifetimes.values():
        assert life["state"] == "stopped", life
        assert life["started_at"] < life["stopped_at"], life


def test_gpu_seconds_per_instance_match_the_simulator(run: Run) -> None:
    """Each instance's GPU-seconds in the ledger are the simulator's own within 1%."""
    assert sorted(w.instance for w in run.windows) == NAMES
    for window in run.windows:
        billed = ledger_gpu_seconds(run.config, window)
        assert window.gpu_seconds > 2.0, window
        assert billed == pytest.approx(window.gpu_seconds, rel=0.01), window


def test_idle_is_charged_per_instance_by_the_group_policy(run: Run) -> None:
    """Every instance leaves idle, and all of the group's goes to its owner; spare boards to platform."""
    ledger = open_ledger(run.config)
    try:
        policy = policy_from_config(run.config)
        parts = pl.concat([allocation_runs.by_instance(ledger, policy, m) for m in run.months])
    finally:
        ledger.close()
    idle = parts.filter(pl.col("idle_microcents") > 0)
    # The fixed small-0's board (configured, never started) is the group's idle too.
    assert set(idle.filter(pl.col("replica") == GROUP)["team"]) == {OWNER}, idle
    assert set(idle.filter(pl.col("replica") == "")["team"]) == {"platform"}, idle
    for name in NAMES:
        assert idle.filter(pl.col("instance") == name)["team"].to_list() == [OWNER], idle


def test_teams_and_idle_add_up_to_the_fleet_cost_to_the_cent(statements: list[Statement]) -> None:
    """Every statement's lines, idle included, sum to the fleet's cost in cents."""
    for statement in statements:
        assert statement.reconciles, (statement.total_cents, statement.fleet_cents)
    assert sum(int(s.lines["idle_cents"].sum()) for s in statements) > 0


def test_tokens_per_team_are_the_engines_counters(run: Run, statements: list[Statement]) -> None:
    """Each team's tokens are what its answers reported, and all teams' are the engines' counters."""
    lines = pl.concat([s.lines for s in statements]).filter(pl.col("model") == "chat-small")
    billed = {
        team: Counter(prompt=p, completion=c)
        for team, p, c in lines.group_by("team")
        .agg(pl.col("prompt_tokens").sum(), pl.col("completion_tokens").sum())
        .iter_rows()
        if p or c
    }
    assert billed == run.tally
    engines: Counter[str] = Counter()
    for inst in read_fleet(Path(run.config.simulator.instances_file)).stopped:
        assert inst.usage is not None, inst
        engines += Counter(
            prompt=int(inst.usage["prompt_tokens"]), completion=int(inst.usage["generation_tokens"])
        )
    assert sum(run.tally.values(), Counter()) == engines
