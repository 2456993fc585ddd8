"""Engine targets found at run time, over loopback: a fake Kubernetes API and a fake instance registry."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import certifi
import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from collectors.dcgm import DcgmSource
from collectors.discovery import PodWatcher, RegistryPoller
from collectors.loop import FleetCollector
from collectors.serve import build_collector, engine_sources, pod_watcher, registry_poller
from collectors.sources import EngineReading
from collectors.targets import EngineTarget
from infermeter.config import Config
from infermeter.kubernetes import KubernetesApiError, bearer, in_cluster_api
from simulator.dcgm import DcgmGpu, render
from tests.collectors.fakes import text_app
from tests.ports import off_demo_ports
from tests.servers import serving

VLLM_PAGE = b"""\
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_waiting{engine="0",model_name="m"} 2
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""
GONE = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "reason": "Expired",
    "code": 410,
    "message": "too old resource version: 100 (250)",
}


def pod(name: str, ip: str = "127.0.0.1", phase: str = "Running") -> dict[str, Any]:
    """A vLLM pod as the API server describes it."""
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": "inference",
            "labels": {"app.kubernetes.io/component": "vllm"},
        },
        "status": {"phase": phase, "podIP": ip},
    }


class FakeKubernetes:
    """The pods endpoint of the API server: a list, and watch streams the test scripts one by one.

    Each watch request takes the next answer from ``script``: a list of events streamed before the
    stream ends (as at the server's timeout), or an HTTP status to answer instead. Every event and
    every list carries a resourceVersion that grows, as etcd's does.
    """

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.version = 100
        self.script: asyncio.Queue[list[tuple[str, dict[str, Any]]] | int] = asyncio.Queue()
        self.requests: list[dict[str, Any]] = []

    def app(self) -> Starlette:
        """The ASGI app serving /api/v1/namespaces/{ns}/pods."""
        return Starlette(routes=[Route("/api/v1/namespaces/{ns}/pods", self.handle)])

    async def handle(self, request: Request) -> Response:
        """List or watch, recording what was asked."""
        query = dict(request.query_params)
        self.requests.append(
            {
                "namespace": request.path_params["ns"],
                "query": query,
                "authorization": request.headers.get("authorization"),
            }
        )
        if query.get("watch") != "1":
            return JSONResponse(
                {
                    "kind": "PodList",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": list(self.pods.values()),
                }
            )
        answer = await self._next(request)
        if answer is None:
            return Response(status_code=499)
        if isinstance(answer, int):
            return JSONResponse(GONE, status_code=answer)
        return StreamingResponse(self._stream(answer), media_type="application/json")

    async def _next(self, request: Request) -> list[tuple[str, dict[str, Any]]] | int | None:
        """The next scripted answer, or None once the watcher hung up waiting for it."""
        getter = asyncio.ensure_future(self.script.get())
        while not getter.done():
            if await request.is_disconnected():
                getter.cancel()
                return None
            await asyncio.wait({getter}, timeout=0.02)
        return getter.result()

    async def _stream(self, events: list[tuple[str, dict[str, Any]]]) -> AsyncIterator[bytes]:
        for kind, obj in events:
            if kind in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
                self.version += 10
                obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
            if kind in ("ADDED", "MODIFIED"):
                self.pods[obj["metadata"]["name"]] = obj
            if kind == "DELETED":
                self.pods.pop(obj["metadata"]["name"], None)
            yield orjson.dumps({"type": kind, "object": obj}) + b"\n"


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``predicate`` holds; fail the test after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running_task(coro: Awaitable[None]) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``coro`` as a task for the block; cancelled (and its connections closed) on the way out."""
    task = asyncio.ensure_future(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _k8s_config(config: Config, api_url: str, sidecar_port: int) -> Config:
    data = off_demo_ports(config.model_dump())  # the configured fleet: nothing listens there
    data["collector"].update(discovery="kubernetes", scrape_timeout_seconds=2.0)
    data["collector"]["kubernetes"].update(
        api_url=api_url, namespace="inference", sidecar_port=sidecar_port, retry_seconds=0.05
    )
    return Config.model_validate(data)


async def test_pod_watch_drives_the_target_set_and_relists_on_410(config):
    """Listed pods, then ADDED/MODIFIED/DELETED events, change the set; 410 Gone lists again."""
    fake = FakeKubernetes([pod("vllm-small-0-a")])
    sets: list[list[str]] = []
    async with serving(fake.app()) as api, httpx.AsyncClient() as client:
        watcher = PodWatcher(
            api,
            "inference",
            "app.kubernetes.io/component=vllm",
            client,
            config.replicas,
            lambda t: sets.append(sorted(t)),
            node_name="node-b",
            token="sa-token",
            retry_seconds=0.05,
        )
        async with running_task(watcher.run()):
            await until(lambda: sets == [["vllm-small-0-a"]])
            await fake.script.put([("ADDED", pod("vllm-small-1-b", ip="127.0.0.2"))])
            await until(lambda: "vllm-small-1-b" in watcher.targets)
            await fake.script.put(
                [
                    ("MODIFIED", pod("vllm-small-0-a")),  # unchanged target: no new set
                    ("BOOKMARK", {"kind": "Pod", "metadata": {}}),
                    ("DELETED", pod("vllm-small-0-a")),
                ]
            )
            await until(lambda: sorted(watcher.targets) == ["vllm-small-1-b"])
            # While the watch is down, b goes and c comes: only a fresh list can tell.
            fake.pods = {"vllm-small-0-c": pod("vllm-small-0-c", ip="127.0.0.3")}
            await fake.script.put([("ERROR", GONE)])
            await until(lambda: sorted(watcher.targets) == ["vllm-small-0-c"])
            await fake.script.put(410)
            await until(lambda: watcher.lists == 3)
    assert sets == [
        ["vllm-small-0-a"],
        ["vllm-small-0-a", "vllm-small-1-b"],
        ["vllm-small-1-b"],
        ["vllm-small-0-c"],
    ]
    assert watcher.targets["vllm-small-0-c"] == EngineTarget(
        "small-0", "http://127.0.0.3:9000/engine/metrics", "vllm-small-0-c", namespace="inference"
    )
    lists = [r for r in fake.requests if "watch" not in r["query"]]
    watches = [r["query"] for r in fake.requests if "watch" in r["query"]]
    assert {r["namespace"] for r in fake.requests} == {"inference"}
    assert {r["authorization"] for r in fake.requests} == {"Bearer sa-token"}
    assert lists[0]["query"] == {
        "labelSelector": "app.kubernetes.io/component=vllm",
        "fieldSelector": "spec.nodeName=node-b",
    }
    # Each watch resumes at the last version seen: the list's, ADDED's, the stream's last event's.
    assert [w["resourceVersion"] for w in watches[:3]] == ["100", "110", "140"]
    assert all(
        w["allowWatchBookmarks"] == "true" and w["fieldSelector"] == "spec.nodeName=node-b"
        for w in watches
    )


async def test_watched_pods_are_scraped_as_instances_and_vanished_ones_forgotten(config):
    """Each pod is read at its own IP; samples name the pod; a deleted pod's state is dropped."""
    fake = FakeKubernetes([pod("vllm-small-0-a"), pod("vllm-small-0-b")])
    async with serving(text_app(VLLM_PAGE)) as engine_url, serving(fake.app()) as api:
        cfg = _k8s_config(config, api, int(engine_url.rsplit(":", 1)[1]))
        async with httpx.AsyncClient() as client:
            collector = build_collector(cfg, client, environ={"INFERMETER_METRICS_TOKEN": "mt"})
            assert collector.engine_sources == []  # nothing is read until discovery names it

            def on_targets(targets: Mapping[str, EngineTarget]) -> None:
                collector.replace_engine_sources(engine_sources(cfg, targets, client, {}))

            watcher, api_client = pod_watcher(cfg, on_targets, environ={})
            async with api_client, running_task(watcher.run()):
                await until(lambda: len(collector.engine_sources) == 2)
                first = await collector.scrape_once()
                await fake.script.put([("DELETED", pod("vllm-small-0-a"))])
                await until(lambda: len(collector.engine_sources) == 1)
                second = await collector.scrape_once()
    assert sorted((e.instance, e.replica, e.model, e.requests_waiting) for e in first.engines) == [
        ("vllm-small-0-a", "small-0", "chat-small", 2.0),
        ("vllm-small-0-b", "small-0", "chat-small", 2.0),
    ]
    assert [e.instance for e in second.engines] == ["vllm-small-0-b"]
    assert first.engines[0].sample_id.endswith(f"/{first.engines[0].instance}")
    assert [k for k in collector.states if k[1] == "vllm"] == [("vllm-small-0-b", "vllm")]
    assert list(collector.engines) == ["vllm-small-0-b"]


async def test_an_instance_that_went_down_keeps_its_backoff_until_it_vanishes(config):
    """A target that stays keeps its failure count across a new set; one that goes takes it along."""
    collector = FleetCollector(config, [], [])
    async with httpx.AsyncClient() as client:
        dead = {
            "vllm-small-0-x": EngineTarget(
                "small-0", "http://127.0.0.1:9/metrics", "vllm-small-0-x"
            )
        }
        collector.replace_engine_sources(engine_sources(config, dead, client, {}))
        await collector.scrape_once()
        collector.replace_engine_sources(engine_sources(config, dead, client, {}))
        kept = collector.states[("vllm-small-0-x", "vllm")].failures
        collector.replace_engine_sources([])
    assert kept == 1
    assert collector.states == {}


class SlowEngine:
    """An instance whose read waits until the test lets it answer."""

    kind, replica = "vllm", "small-0"
    node: str | None = "node-b"

    def __init__(self, pod: str) -> None:
        self.target = self.instance = pod
        self.release = asyncio.Event()

    async def read(self) -> EngineReading:
        """An idle engine's reading, once released."""
        await self.release.wait()
        return EngineReading(0, 0, 0, 0, 0, 0, 0, 0)


async def test_a_target_that_vanishes_while_it_is_read_leaves_nothing_behind(config):
    """The reading taken is still a sample of the round; neither its state nor its view is kept."""
    engine = SlowEngine("vllm-small-0-z")
    collector = FleetCollector(config, [], [engine])
    round_ = asyncio.create_task(collector.scrape_once())
    await asyncio.sleep(0.05)
    collector.replace_engine_sources([])
    engine.release.set()
    batch = await round_
    assert [e.instance for e in batch.engines] == ["vllm-small-0-z"]
    assert (collector.states, collector.engines) == ({}, {})


class FakeRegistry:
    """Billing's ``GET /v1/instances`` as the contract describes it, over a mutable list."""

    def __init__(self, instances: list[dict[str, Any]]) -> None:
        self.instances = instances
        self.status = 200
        self.requests: list[dict[str, Any]] = []

    def app(self) -> Starlette:
        """The ASGI app serving /v1/instances."""
        return Starlette(routes=[Route("/v1/instances", self.handle)])

    async def handle(self, request: Request) -> Response:
        """Live instances (or all), optionally of one replica group; 401 without a token."""
        query = dict(request.query_params)
        self.requests.append(
            {"query": query, "authorization": request.headers.get("authorization")}
        )
        if request.headers.get("authorization") != "Bearer mt":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        if self.status != 200:
            return JSONResponse({"error": "unavailable"}, status_code=self.status)
        state = query.get("state", "live")
        found = [i for i in self.instances if state == "all" or i["state"] == state]
        if "replica" in query:
            found = [i for i in found if i["replica"] == query["replica"]]
        return JSONResponse({"instances": found})


def instance(name: str, replica: str, url: str, state: str = "live") -> dict[str, Any]:
    """One entry of the registry's answer, every field of the contract present."""
    return {
        "instance": name,
        "replica": replica,
        "model": "chat-small",
        "node": "node-b",
        "gpu_model": "L40S",
        "gpu_count": 1,
        "gpus": ["GPU-1"],
        "namespace": "inference",
        "pod_uid": f"uid-{name}",
        "engine_metrics_url": url,
        "started_at": 1.0,
        "last_seen": 2.0,
        "stopped_at": None if state == "live" else 2.0,
        "state": state,
    }


async def test_registry_drives_the_engines_and_an_outage_keeps_the_last_set(config):
    """Live instances are scraped as themselves; while billing fails, the last set stays."""
    async with serving(text_app(VLLM_PAGE)) as engine_url:
        page = f"{engine_url}/engine/metrics"
        registry = FakeRegistry(
            [
                instance("vllm-small-0-a", "small-0", page),
                instance("vllm-small-0-b", "small-0", page),
                instance("vllm-small-0-old", "small-0", page, state="stopped"),
            ]
        )
        async with serving(registry.app()) as billing_url, httpx.AsyncClient() as client:
            data = off_demo_ports(config.model_dump())  # nothing listens at the configured fleet
            data["collector"].update(discovery="registry", registry={"url": billing_url})
            cfg = Config.model_validate(data)
            env = {"INFERMETER_METRICS_TOKEN": "mt"}
            collector = build_collector(cfg, client, env)

            def on_targets(targets: Mapping[str, EngineTarget]) -> None:
                collector.replace_engine_sources(engine_sources(cfg, targets, client, env))

            poller = registry_poller(cfg, client, on_targets, env)
            assert await poller.poll_once()
            first = await collector.scrape_once()
            registry.instances.pop(0)
            assert await poller.poll_once()
            second = await collector.scrape_once()
            registry.status = 503
            assert not await poller.poll_once()
    assert sorted(e.instance or "" for e in first.engines) == ["vllm-small-0-a", "vllm-small-0-b"]
    assert [e.instance for e in second.engines] == ["vllm-small-0-b"]
    assert sorted(poller.targets) == ["vllm-small-0-b"]
    assert [s.target for s in collector.engine_sources] == ["vllm-small-0-b"]
    assert {(r["query"]["state"], r["authorization"]) for r in registry.requests} == {
        ("live", "Bearer mt")
    }


async def test_registry_that_refuses_the_token_changes_nothing(config):
    """A 401 is a failed poll: no targets are published, none are dropped."""
    registry = FakeRegistry([])
    published: list[Mapping[str, EngineTarget]] = []
    async with serving(registry.app()) as url, httpx.AsyncClient() as client:
        poller = RegistryPoller(url, client, config.replicas, published.append, token="wrong")
        assert not await poller.poll_once()
    assert published == []


def test_kubernetes_discovery_outside_a_cluster_says_what_to_set(config):
    """With no api_url and no in-cluster service, the collector stops with what to configure."""
    data = config.model_dump()
    data["collector"]["discovery"] = "kubernetes"
    with pytest.raises(KubernetesApiError, match="api_url"):
        pod_watcher(Config.model_validate(data), lambda t: None, environ={})


def test_the_in_cluster_service_account_is_used_without_an_api_url(tmp_path: Path) -> None:
    """In a pod: the API at KUBERNETES_SERVICE_HOST, the token file read per request, its CA."""
    (tmp_path / "token").write_text("projected\n")
    shutil.copy(certifi.where(), tmp_path / "ca.crt")  # any bundle stands in for the cluster's CA
    url, token_file, _ = in_cluster_api({"KUBERNETES_SERVICE_HOST": "fd00::1"}, tmp_path)
    assert (url, token_file) == ("https://[fd00::1]:443", tmp_path / "token")
    assert bearer(None, tmp_path / "token") == {"authorization": "Bearer projected"}
    assert bearer("static", None) == {"authorization": "Bearer static"}
    with pytest.raises(KubernetesApiError, match="service-account token"):
        bearer(None, tmp_path / "missing")


async def test_gpu_samples_name_the_pod_on_them_as_their_instance(config):
    """On a node-local dcgm-exporter page, a GPU held by a vLLM pod carries that pod as instance."""
    gpus = [
        DcgmGpu(
            0,
            "GPU-b0",
            "NVIDIA L40S",
            "node-b",
            40.0,
            200.0,
            1_000_000,
            1000.0,
            40000.0,
            pod=("vllm", "inference", "vllm-small-0-7d9f8-abcde"),
        ),
        DcgmGpu(
            5,
            "GPU-b5",
            "NVIDIA L40S",
            "node-b",
            0.0,
            30.0,
            2_000_000,
            0.0,
            46000.0,
            pod=("vllm", "inference", "vllm-small-1-5c6d7-fghij"),
        ),
        DcgmGpu(6, "GPU-b6", "NVIDIA L40S", "node-b", 0.0, 30.0, 2_000_000, 0.0, 46000.0),
    ]
    data = off_demo_ports(config.model_dump())  # nothing listens at the configured fleet
    data["collector"]["dcgm_exporter_url"] = "http://127.0.0.1:1/metrics"
    async with serving(text_app(render(gpus).encode())) as url, httpx.AsyncClient() as client:
        data["collector"]["dcgm_exporter_url"] = f"{url}/metrics"
        cfg = Config.model_validate(data)
        collector = build_collector(cfg, client, environ={"NODE_NAME": "node-b"})
        [source] = collector.gpu_sources
        assert isinstance(source, DcgmSource)
        batch = await collector.scrape_once()
    owners = {s.gpu: (s.replica, s.instance) for s in batch.gpus}
    assert owners == {
        "0": ("small-0", None),  # node-b's GPU 0 is small-0's by configuration: the fixed replica
        "5": ("small-1", "vllm-small-1-5c6d7-fghij"),
        "6": (None, None),
    }
    assert {s.node for s in batch.gpus} == {"node-b"}


def test_collect_outside_a_cluster_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    """``infermeter collect`` with Kubernetes discovery, no api_url and no cluster exits 2 with one line, spooling nothing."""
    from infermeter.serving import free_port
    from launcher.cli import main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("INFERMETER__COLLECTOR__DISCOVERY", "kubernetes")
    monkeypatch.setenv("INFERMETER__COLLECTOR__SPOOL_DIR", str(tmp_path / "spool"))
    assert main(["collect", "--listen", f"127.0.0.1:{free_port()}"]) == 2
    # (after the warning that the embedded demo configuration is in use)
    assert capsys.readouterr().err.splitlines()[-1:] == [
        "infermeter: collector.kubernetes: not in a cluster (no KUBERNETES_SERVICE_HOST): set an api_url"
    ]
    assert not (tmp_path / "spool").exists()
