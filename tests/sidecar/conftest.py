"""A simulated replica with a real sidecar in front of it, both on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop
import yaml
from prometheus_client.parser import text_string_to_metric_families

from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.serving import free_port
from sidecar.app import Sidecar
from simulator.replica import ReplicaSim, replica_spec
from tests.servers import serving

KEYS = {
    "search": "im-demo-search",
    "assistant": "im-demo-assistant",
    "analytics": "im-demo-analytics",
    "research": "im-demo-research",
}
METRICS_TOKEN = "im-demo-metrics"


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` with ``labels`` in a Prometheus page."""
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def make_config(upstream: str, **changes: Any) -> Config:
    """The demo config with replica small-0 at ``upstream``, fast timing and ``changes`` applied.

    ``changes`` keys are dotted paths: ``{"sidecar.read_timeout_seconds": 1}``.
    """
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for r in data["replicas"]:
        if r["id"] == "small-0":
            r["upstream_url"] = upstream
    data["simulator"]["engines"]["chat-small"].update(step_base_ms=3, step_per_seq_ms=0.02)
    # A billing made from it takes the shared ingest token the sidecar tests ship with.
    data["billing"]["shared_ingest_token"] = True
    for path, value in changes.items():
        node = data
        *parents, last = path.split(".")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        node[last] = value
    return Config.model_validate(data)


@dataclass
class Stack:
    """A running replica and sidecar, and handles to both."""

    sim: ReplicaSim
    sidecar: Sidecar
    url: str
    upstream: str
    spool: Path

    def client(self, team: str = "search", **kw: Any) -> httpx.AsyncClient:
        """An HTTP client authenticated as ``team``."""
        kw.setdefault("timeout", 60)
        return httpx.AsyncClient(
            base_url=self.url, headers={"authorization": f"Bearer {KEYS[team]}"}, **kw
        )

    async def records(self) -> list[dict[str, Any]]:
        """Every usage record in the spool, those of the requests ended so far written first
        (as the next tick would)."""
        from infermeter.spool import read_segment

        await self.sidecar.accounting.flush()

        out: list[dict[str, Any]] = []
        for path in sorted(self.spool.glob("seg-*.jsonl")):
            out += read_segment(path)[0]
        return out


StackFactory = Callable[..., Any]


@pytest.fixture
async def stack_factory(tmp_path: Path) -> AsyncIterator[StackFactory]:
    """Start a replica + sidecar with config changes; all are stopped at the end of the test."""
    import contextlib

    async with contextlib.AsyncExitStack() as stack:

        async def start(upstream_app: Any = None, **changes: Any) -> Stack:
            port = free_port()
            upstream = f"http://127.0.0.1:{port}"
            config = make_config(upstream, **changes)
            sim = ReplicaSim(replica_spec(config, "small-0"))
            await stack.enter_async_context(
                serving(upstream_app or sim, port, lifespan="off" if upstream_app else "on")
            )
            spool = tmp_path / f"spool-{port}"
            sidecar = Sidecar(config, "small-0", spool_dir=spool)
            url = await stack.enter_async_context(serving(sidecar, limits=sidecar.server_limits))
            return Stack(sim, sidecar, url, upstream, spool)

        yield start


@pytest.fixture
async def stack(stack_factory: StackFactory) -> Stack:
    """The default stack."""
    result: Stack = await stack_factory()
    return result


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests marked ``both_loops`` run once on each loop the sidecar may run on.

    The sidecar process runs on uvloop by default (``sidecar.event_loop``), whose transports
    differ from Python's in type and in when they call back; the relay's tests run on both.
    """
    if item.get_closest_marker("both_loops") is None:
        return {"asyncio": asyncio.new_event_loop}  # one factory: the test ids stay as they were
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
