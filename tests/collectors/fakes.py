"""Stand-ins for what has no loopback simulator: GPUs read in-process, and misbehaving servers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from collectors.sources import EngineReading, GpuReading, ScrapeError

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def reading(**kw: Any) -> GpuReading:
    """A GPU reading with plausible defaults; keywords override any field."""
    base: dict[str, Any] = {
        "node": "node-a",
        "gpu": "0",
        "uuid": "GPU-0000",
        "model_name": "NVIDIA H100",
        "utilization": 0.5,
        "power_watts": 300.0,
        "energy_mj": 1_000_000.0,
        "memory_used_mib": 1000.0,
        "memory_free_mib": 2000.0,
    }
    base.update(kw)
    return GpuReading(**base)


class FakeGpuSource:
    """A node whose readings come from a script: one list per read, or a ScrapeError."""

    def __init__(
        self, target: str, script: list[list[GpuReading] | ScrapeError], kind: str = "fake"
    ) -> None:
        self.target = target
        self.kind = kind
        self.script = script
        self.reads = 0

    async def read(self) -> list[GpuReading]:
        """The next scripted answer; the last one repeats."""
        answer = self.script[min(self.reads, len(self.script) - 1)]
        self.reads += 1
        if isinstance(answer, ScrapeError):
            raise answer
        return answer


async def hanging_app(scope: Scope, receive: Receive, send: Send) -> None:
    """An HTTP server that accepts the request and never answers."""
    if scope["type"] == "http":
        await asyncio.Event().wait()


def text_app(
    body: bytes, status: int = 200, content_type: bytes = b"text/plain"
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An HTTP server that answers every request with ``body`` (as ``content_type``)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", content_type)],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


class FakeEngine:
    """small-0's engine with a queue."""

    target, kind, replica = "small-0", "vllm", "small-0"
    instance: str | None = None
    node: str | None = "node-b"

    async def read(self) -> EngineReading:
        """A busy engine."""
        return EngineReading(
            requests_running=12,
            requests_waiting=5,
            kv_cache_usage=0.4,
            prompt_tokens_total=100,
            generation_tokens_total=50,
            prefix_cache_queries_total=10,
            prefix_cache_hits_total=5,
            preemptions_total=0,
        )


class FakeInstance(FakeEngine):
    """One instance (pod) of small-0, as a discovered engine."""

    def __init__(self, pod: str) -> None:
        self.target = self.instance = pod


def shared_board_page(energy_mj: int, mig: bool = False) -> str:
    """One board time-sliced by pods a and b, as dcgm-exporter with pod mapping writes it."""
    extra = ',GPU_I_PROFILE="1g.10gb",GPU_I_ID="1"' if mig else ""
    lines = []
    for pod in ("pod-a", "pod-b"):
        lab = f'gpu="3",UUID="GPU-3333",modelName="NVIDIA L40S"{extra},namespace="ns",pod="{pod}",container="vllm"'
        lines += [
            f"DCGM_FI_DEV_GPU_UTIL{{{lab}}} 80",
            f"DCGM_FI_DEV_POWER_USAGE{{{lab}}} 300",
            f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{lab}}} {energy_mj}",
        ]
    if mig:
        lab = 'gpu="3",UUID="GPU-3333",modelName="NVIDIA L40S",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2"'
        lines += [f"DCGM_FI_DEV_POWER_USAGE{{{lab}}} 300"]
    return "\n".join(lines) + "\n"
