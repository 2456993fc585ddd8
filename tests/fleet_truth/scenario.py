"""The fleet-truth scenario: the whole product on loopback, a dynamic fleet, faults, ground truth.

Real processes: billing on a DuckDB file, redis-server for the fleet-wide limits, the simulated
engines and dcgm-exporter stand-in (writing the ground-truth log), a sidecar in front of each
engine, the collector (engines found through billing's registry, spools of stopped instances
adopted), and the autoscaler with its local scale hook, which starts and stops instances of
``chat-small`` as the queue grows and drains. Four teams send streamed and whole requests, n=1
and n=2, some hanging up; one team's budget runs out. Faults on the way: kill -9 of a sidecar
with requests in flight (restarted as Kubernetes would), SIGTERM scale-down (the autoscaler's),
billing down 30 s, Redis paused 300 ms, the collector stopped and restarted late.

Times are compressed (a scrape every 0.5 s, heartbeats every second, scaling within seconds);
the run takes about three minutes. ``run_scenario`` returns once every record is in the ledger
and every process has stopped; the checks read the ledger file and the truth directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from infermeter.config import DEFAULT_CONFIG, Config, load_config
from infermeter.local_fleet import read_fleet
from infermeter.serving import free_port
from infermeter.spool import read_segment
from launcher.fleet import writer_environments
from simulator.truth import TruthWriter
from tests.fleet_truth.client import Ask, Client
from tests.redis_server import RedisServer

ADMIN = "im-demo-admin"
KEYS = {t: f"im-demo-{t}" for t in ("search", "assistant", "analytics", "research")}
# Every writer ships with a credential of its own, as in the demo (``writer_environments``).
WRITER_SECRET = b"the fleet-truth writer secret"
TOKENS = {
    "INFERMETER_METRICS_TOKEN": "im-demo-metrics",
    "INFERMETER_REGISTRY_TOKEN": "im-demo-metrics",
    "INFERMETER_SPEND_TOKEN": "im-demo-spend",
}
SCRAPE_SECONDS = 0.5
WAIT_SECONDS = 120.0
# Limits the scenario presses on: analytics's requests/min is exceeded on purpose.
ANALYTICS_RPM = 40
RESEARCH_BUDGET_USD = 25.0
BILLING_DOWN_SECONDS = 30.0
REDIS_PAUSE_MILLIS = 300


@dataclass
class Run:
    """What the scenario left behind, for the checks."""

    config: Config
    config_path: Path
    truth_dir: Path
    started: float
    ended: float
    months: list[str]
    events: dict[str, float] = field(default_factory=dict)  # fault -> when it happened
    max_small_instances: int = 0
    scaling_seen: list[dict[str, Any]] = field(default_factory=list)
    leftovers: list[dict[str, Any]] = field(default_factory=list)  # records still in spools
    fleet_view: dict[str, Any] = field(default_factory=dict)  # what the Fleet page's API said
    spend_failures: list[tuple[float, int, str]] = field(default_factory=list)  # billing's 5xx


def write_config(tmp: Path, redis_url: str) -> tuple[Path, Config]:
    """The demo configuration reshaped for the scenario (free ports, fast timings, tmp files)."""
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    billing = f"127.0.0.1:{free_port()}"
    for team in raw["teams"]:
        team["budget_usd_per_month"] = 1_000_000
        if team["name"] == "analytics":
            team["limits"] = {"requests_per_minute": ANALYTICS_RPM, "max_concurrent": 16}
        if team["name"] == "research":
            team["budget_usd_per_month"] = RESEARCH_BUDGET_USD
    large, small = (
        next(r for r in raw["replicas"] if r["id"] == i) for i in ("large-0", "small-0")
    )
    large.update(
        upstream_url=f"http://127.0.0.1:{free_port()}",
        idle_policy="spread",
        sidecar_listen=f"127.0.0.1:{free_port()}",
    )
    small.update(
        upstream_url=f"http://127.0.0.1:{free_port()}",
        idle_policy="platform",
        sidecar_listen=f"127.0.0.1:{free_port()}",
        max_num_seqs=4,
    )
    raw["replicas"] = [large, small]
    raw["nodes"] = [
        {
            "name": "node-a",
            "gpu_model": "H100",
            "gpu_count": 3,
            "dcgm_exporter_url": f"http://127.0.0.1:{free_port()}/metrics",
        },
        {
            "name": "node-b",
            "gpu_model": "L40S",
            "gpu_count": 4,
            "dcgm_exporter_url": f"http://127.0.0.1:{free_port()}/metrics",
        },
    ]
    # Prices that make a few minutes worth many dollars, so rounding and budgets are exercised.
    raw["prices"]["usd_per_gpu_hour"].update(H100=3600.0, L40S=1600.0)
    raw["scaling"].update(
        min_replicas=1,
        max_replicas=3,
        scale_up_queue_depth=2,
        scale_up_after_seconds=2,
        scale_down_after_seconds=6,
        scale_down_gpu_utilization=0.6,
        cooldown_seconds=3,
        startup_seconds=40,
    )
    raw["sidecar"].update(
        spool_dir=str(tmp / "spool"),
        ingest_url=f"http://{billing}/v1/ingest",
        heartbeat_seconds=3.0,
        drain_seconds=3,
        drain_ship_seconds=3,
        shared_limits={
            "redis_url": redis_url,
            "timeout_millis": 100,
            "retry_seconds": 0.5,
            "registry_url": f"http://{billing}",
            "instances_refresh_seconds": 2,
        },
        budgets={"spend_url": f"http://{billing}", "refresh_seconds": 1},
    )
    raw["billing"].update(
        listen=billing, url=f"http://{billing}", database=str(tmp / "ledger.duckdb")
    )
    raw["collector"] = {
        "listen": f"127.0.0.1:{free_port()}",
        "scrape_interval_seconds": SCRAPE_SECONDS,
        "gap_after_intervals": 80,
        "spool_dir": str(tmp / "collector-spool"),
        "ingest_url": f"http://{billing}/v1/ingest",
        "discovery": "registry",
        "registry": {"refresh_seconds": 1.0},
        "adopt_spools_dir": str(tmp / "spool"),
    }
    raw["simulator"].update(
        instances_file=str(tmp / "instances.json"), truth_dir=str(tmp / "truth")
    )
    raw["autoscale"] = {
        "listen": f"127.0.0.1:{free_port()}",
        "interval_seconds": 1,
        "history_file": "",
        "spool_dir": str(tmp / "autoscale-spool"),
        "ingest_url": f"http://{billing}/v1/ingest",
        "local": {
            "enabled": True,
            "count_fixed_replicas": True,
            "groups": {"chat-small": "small-0"},
            "ready_timeout_seconds": 60,
            "stop_timeout_seconds": 30,
        },
    }
    raw["dashboard"] = {**raw.get("dashboard", {}), "listen": f"127.0.0.1:{free_port()}"}
    path = tmp / "infermeter.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, load_config(path, environ={})


class Processes:
    """The scenario's long-running processes by name: start, kill -9, stop, restart."""

    def __init__(self, config_path: Path, log_dir: Path, config: Config) -> None:
        self.config_path = config_path
        self.log_dir = log_dir
        self.writers = writer_environments(config, WRITER_SECRET)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.args: dict[str, list[str]] = {}

    def start(self, name: str, args: list[str]) -> None:
        """Start ``infermeter <args> --config <path>`` as ``name``."""
        argv = [sys.executable, "-m", "launcher", *args, "--config", str(self.config_path)]
        log = (self.log_dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            argv,
            env={**os.environ, **TOKENS, **self.writers.get(name, {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.args[name] = args

    def kill(self, name: str) -> None:
        """SIGKILL, as the OOM killer or a crash would."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def stop(self, name: str, timeout: float = 30.0) -> None:
        """SIGTERM and wait; SIGKILL the whole group if it does not end in time."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self, name: str) -> None:
        """Start ``name`` again with the same arguments."""
        self.start(name, self.args[name])

    def stop_all(self) -> None:
        """Stop every process, newest first."""
        for name in reversed(list(self.procs)):
            self.stop(name)


async def until(
    what: str, check: Callable[[], Awaitable[bool]], seconds: float = WAIT_SECONDS
) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def answers(client: httpx.AsyncClient, url: str) -> bool:
    """True once ``url`` answers below 500."""
    with contextlib.suppress(httpx.HTTPError):
        return (await client.get(url, timeout=2.0)).status_code < 500
    return False


async def up(client: httpx.AsyncClient, what: str, url: str) -> None:
    """Wait until ``url`` answers."""
    await until(what, lambda: answers(client, url))


async def watch_spend(client: httpx.AsyncClient, config: Config, run: Run) -> None:
    """Read billing's spend every second, as budgets do; keep every 5xx answer."""
    headers = {"authorization": f"Bearer {ADMIN}"}
    while True:
        with contextlib.suppress(httpx.HTTPError):
            response = await client.get(f"{config.billing.url}/v1/spend", headers=headers)
            if response.status_code >= 500:
                run.spend_failures.append((time.time(), response.status_code, response.text[:300]))
        await asyncio.sleep(1.0)


def spooled(root: Path) -> list[dict[str, Any]]:
    """Records still in the spools under ``root`` (listed again when the collector removed a
    directory it adopted while it was being listed)."""
    while True:
        try:
            return [r for seg in sorted(root.rglob("seg-*.jsonl")) for r in read_segment(seg)[0]]
        except FileNotFoundError:
            continue


@dataclass
class Traffic:
    """The scenario's clients: lanes of requests that run until told to stop."""

    client: Client
    config: Config
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    outcomes: list[dict[str, Any]] = field(default_factory=list)

    def targets(self, model: str) -> list[str]:
        """The sidecars serving ``model`` now: the fixed one and the live instances'."""
        urls = [
            f"http://{r.sidecar_listen}"
            for r in self.config.replicas
            if r.model == model and r.sidecar_listen
        ]
        for inst in read_fleet(Path(self.config.simulator.instances_file)).instances:
            if inst.model == model and inst.sidecar_url:
                urls.append(inst.sidecar_url)
        return urls

    async def lane(self, asks: list[Ask], pause: float = 0.0) -> None:
        """Send ``asks`` round-robin (over targets too), one at a time, until stopped."""
        n = 0
        while not self.stop.is_set():
            ask = asks[n % len(asks)]
            urls = self.targets(ask.model)
            outcome = await self.client.send(urls[n % len(urls)], ask)
            self.outcomes.append(outcome)
            n += 1
            # A refused client waits, as the OpenAI SDK's own retry would.
            await asyncio.sleep(1.0 if outcome["status"] == 429 else pause)


def steady_lanes(traffic: Traffic) -> list[Coroutine[Any, Any, None]]:
    """Every team's everyday work: streamed and whole, n=1 and n=2, some hang-ups."""
    small, large = "chat-small", "chat-large"
    return [
        traffic.lane(
            [
                Ask("search", small, stream=True),
                Ask("search", small, stream=True, n=2),
                Ask("search", small, stream=False),
            ]
        ),
        traffic.lane(
            [
                Ask("assistant", small, stream=True, max_tokens=40),
                Ask("assistant", small, stream=True, max_tokens=60, hang_up_after_tokens=7),
                Ask("assistant", large, stream=False, n=2),
            ]
        ),
        traffic.lane(
            [
                Ask("analytics", large, stream=False, completions=True, words=200),
                Ask("analytics", large, stream=False, max_tokens=200, give_up_after_seconds=0.4),
            ],
            pause=0.2,
        ),
        traffic.lane(
            [
                Ask("research", large, stream=True, max_tokens=30),
                Ask("research", small, stream=False, completions=True, n=2),
            ]
        ),
    ]


async def burst(traffic: Traffic, until: asyncio.Event, streams: int = 16) -> None:
    """Long streams on chat-small, ``streams`` at a time, until ``until`` is set: the queue
    builds and the autoscaler adds instances."""

    async def one() -> None:
        while not until.is_set():
            urls = traffic.targets("chat-small")
            ask = Ask("search", "chat-small", stream=True, max_tokens=300)
            traffic.outcomes.append(
                await traffic.client.send(urls[len(traffic.outcomes) % len(urls)], ask)
            )

    await asyncio.gather(*(one() for _ in range(streams)))


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[RedisServer]:
    """A redis-server of the scenario's own."""
    server = RedisServer(tmp / "redis")
    (tmp / "redis").mkdir(exist_ok=True)
    server.start()
    try:
        yield server
    finally:
        server.kill()


async def kill_mid_stream(procs: Processes, traffic: Traffic, sidecar: str, url: str) -> float:
    """Start long requests on one sidecar, kill -9 it while they run, restart it; when killed."""
    asks = [
        Ask("search", "chat-small", stream=True, max_tokens=400),
        Ask("assistant", "chat-small", stream=True, n=2, max_tokens=400),
        Ask("search", "chat-small", stream=False, max_tokens=400),
        Ask("assistant", "chat-small", stream=False, completions=True, n=2, max_tokens=400),
    ]
    sends = [asyncio.create_task(traffic.client.send(url, ask)) for ask in asks]
    await asyncio.sleep(1.5)
    procs.kill(sidecar)
    killed = time.time()
    traffic.outcomes.extend(await asyncio.gather(*sends))
    procs.restart(sidecar)
    return killed


async def live_small(http: httpx.AsyncClient, config: Config) -> int:
    """How many chat-small instances run now (the fixed one included), from the instances file."""
    hook = [
        i
        for i in read_fleet(Path(config.simulator.instances_file)).instances
        if i.model == "chat-small"
    ]
    return 1 + len(hook)


async def run_scenario(tmp: Path) -> Run:
    """Run the whole scenario; return once everything is in the ledger and every process ended."""
    logs = tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with redis_server(tmp) as redis:
        path, config = write_config(tmp, redis.url)
        procs = Processes(path, logs, config)
        run = Run(config, path, Path(config.simulator.truth_dir), time.time(), 0.0, [])
        try:
            async with httpx.AsyncClient(timeout=10.0) as http:
                await _start(procs, http, config)
                await _drive(procs, http, config, redis, run)
                await _finish(procs, http, config, run)
        finally:
            procs.stop_all()
    run.ended = time.time()
    run.months = sorted({time.strftime("%Y-%m", time.gmtime(t)) for t in (run.started, run.ended)})
    return run


async def _start(procs: Processes, http: httpx.AsyncClient, config: Config) -> None:
    procs.start("billing", ["billing"])
    await up(http, "billing", f"{config.billing.url}/healthz")
    procs.start("dcgm", ["simulate", "--dcgm"])
    for node in config.nodes:
        url = str(node.dcgm_exporter_url)
        await up(http, f"dcgm {node.name}", url)
    for r in config.replicas:
        procs.start(f"replica {r.id}", ["simulate", "--replica", r.id])
        await up(http, f"replica {r.id}", f"{r.upstream_url}/health")
        procs.start(f"sidecar {r.id}", ["sidecar", "--replica", r.id])
        await up(http, f"sidecar {r.id}", f"http://{r.sidecar_listen}/healthz")
    procs.start("collector", ["collect"])
    await up(http, "collector", f"http://{config.collector.listen}/healthz")
    procs.start("autoscaler", ["autoscale", "run"])
    await up(http, "autoscaler", f"http://{config.autoscale.listen}/healthz")


async def _drive(
    procs: Processes, http: httpx.AsyncClient, config: Config, redis: RedisServer, run: Run
) -> None:
    client = Client(KEYS, TruthWriter(run.truth_dir, "clients"))
    traffic = Traffic(client, config)
    lanes = [asyncio.create_task(lane) for lane in steady_lanes(traffic)]
    watcher = asyncio.create_task(watch_spend(http, config, run))
    calm = asyncio.Event()
    try:
        await asyncio.sleep(10)
        lanes.append(asyncio.create_task(burst(traffic, calm)))

        async def scaled_up() -> bool:
            run.max_small_instances = max(run.max_small_instances, await live_small(http, config))
            return run.max_small_instances >= 3

        await until("chat-small scaled to 3 instances", scaled_up)
        await until(
            "the fleet view shows chat-small's 3 instances", lambda: fleet_view(http, config, run)
        )
        small = next(r for r in config.replicas if r.id == "small-0")
        run.events["kill"] = await kill_mid_stream(
            procs, traffic, "sidecar small-0", f"http://{small.sidecar_listen}"
        )
        await up(http, "the killed sidecar back", f"http://{small.sidecar_listen}/healthz")
        run.events["redis_pause"] = time.time()
        redis_cli(redis, "CLIENT", "PAUSE", str(REDIS_PAUSE_MILLIS))
        procs.stop("billing")
        run.events["billing_down"] = time.time()
        await asyncio.sleep(BILLING_DOWN_SECONDS)
        procs.restart("billing")
        await up(http, "billing back", f"{config.billing.url}/healthz")
        calm.set()
        await until("chat-small scaled back to 1", lambda: _is(live_small(http, config), 1))
        run.events["scaled_down"] = time.time()
        procs.stop("collector")
        run.events["collector_down"] = time.time()
        await asyncio.sleep(10)
        procs.restart("collector")
        await up(http, "collector back", f"http://{config.collector.listen}/healthz")
        await asyncio.sleep(5)
    finally:
        traffic.stop.set()
        calm.set()
        watcher.cancel()
        await asyncio.gather(*lanes, watcher, return_exceptions=True)
        await client.close()


async def fleet_view(http: httpx.AsyncClient, config: Config, run: Run) -> bool:
    """Keep what billing's fleet route (the Fleet page's data) says; True once it shows the
    group at 3 live instances and the autoscaler's desired 3."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = await http.get(
            f"{config.billing.url}/v1/fleet", headers={"authorization": f"Bearer {ADMIN}"}
        )
        run.fleet_view = response.json()
        return _fleet_shows(run.fleet_view, "small-0", "chat-small", 3)
    return False


def _fleet_shows(view: dict[str, Any], group: str, model: str, count: int) -> bool:
    groups = {g.get("replica"): g for g in view.get("groups", [])}
    models = {m.get("model"): m for m in view.get("models", [])}
    live = groups.get(group, {}).get("live")
    desired = models.get(model, {}).get("desired")
    return bool(live == count and desired == count)


async def _is(value: Awaitable[int], wanted: int) -> bool:
    return await value == wanted


def redis_cli(redis: RedisServer, *args: str) -> None:
    """One command to the scenario's redis-server through redis-cli."""
    subprocess.run(["redis-cli", "-p", str(redis.port), *args], check=True, capture_output=True)


async def _finish(procs: Processes, http: httpx.AsyncClient, config: Config, run: Run) -> None:
    """Stop the fleet in the order a rollout would, then wait until billing holds everything."""
    procs.stop("autoscaler")  # its hook drains and stops the instances it started
    for r in config.replicas:
        procs.stop(f"sidecar {r.id}")
    stopped = time.time()
    spool, collector_spool = Path(config.sidecar.spool_dir), Path(config.collector.spool_dir)

    async def shipped() -> bool:
        recent = spooled(collector_spool)
        return (
            not spooled(spool)
            and any(r.get("timestamp", 0.0) > stopped + 2 for r in recent)
            and not [r for r in recent if r.get("timestamp", 0.0) <= stopped + 2]
        )

    await until("every record shipped", shipped)
    for r in config.replicas:
        procs.stop(f"replica {r.id}")
    procs.stop("collector")
    procs.stop("dcgm")
    run.leftovers = spooled(spool) + spooled(collector_spool)
    procs.stop("billing")
