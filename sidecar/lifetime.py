"""The sidecar as an instance: it owns its spool directory and announces its start, life and stop.

An instance of a replica group is billed only within its lifetime, so the lifetime must be as
durable as the usage: the events go through a spool of their own (``<spool>/instances``, shipped
as ``instances`` by the same process) and reach billing whenever billing can take them, even
after the pod is gone (the node's collector adopts the directory).

- ``start`` once the spools are open, before the first request is served;
- ``heartbeat`` every ``sidecar.heartbeat_seconds``; billing closes an instance silent for three
  heartbeats at its last event, so a pod killed with SIGKILL still has a lifetime with an end;
- ``stop`` at shutdown, once the in-flight requests have ended.

Events are written for fixed replicas too (``instance`` is then the replica id). A failure to write
one is logged, never fatal: the usage records are what the bill is made of.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from prometheus_client import CollectorRegistry, Gauge

from infermeter.identity import Identity
from infermeter.ids import sample_id
from infermeter.records import InstanceEvent, InstanceEventType
from infermeter.spool import Spool, SpoolError
from infermeter.spooldir import INSTANCES, SpoolLock

__all__ = [
    "EVENTS_MAX_BYTES",
    "LOCK_WAIT_SECONDS",
    "Lifetime",
    "engine_metrics_url",
    "instance_event",
    "resource_attributes",
]

log = logging.getLogger("infermeter.sidecar")

# How long a starting sidecar waits for its spool directory: the node's collector may be
# shipping it (a pod restarted with the same UID), and lets go between rounds.
LOCK_WAIT_SECONDS: Final = 30.0
# Unshipped lifetime events kept at most: about 150,000 events, 50 days of 30 s heartbeats.
EVENTS_MAX_BYTES: Final = 64 << 20
_WILDCARDS: Final = frozenset({"", "0.0.0.0", "::", "[::]"})


def engine_metrics_url(host: str, port: int, environ: Mapping[str, str], hostname: str) -> str:
    """Where the collector reads this sidecar's ``/engine/metrics``.

    In Kubernetes the pod's IP (``POD_IP`` from the downward API): the listen address there is a
    wildcard, and a Service would answer with a random pod. Elsewhere the listen address, or the
    host's name when that is a wildcard, which no one can connect to. An instance with a writer
    credential announces the address its credential names instead (``Writer.engine_metrics_url``),
    the only one billing takes from it.
    """
    address = environ.get("POD_IP", "").strip() or (hostname if host in _WILDCARDS else host)
    if ":" in address and not address.startswith("["):
        address = f"[{address}]"  # an IPv6 literal in a URL
    return f"http://{address}:{port}/engine/metrics"


def resource_attributes(identity: Identity) -> dict[str, str]:
    """OpenTelemetry resource attributes naming the instance (one set per process: bounded)."""
    attributes = {"service.instance.id": identity.instance, "k8s.node.name": identity.node}
    if identity.namespace:
        attributes["k8s.namespace.name"] = identity.namespace
    if identity.pod_uid:
        attributes["k8s.pod.uid"] = identity.pod_uid
    if identity.dynamic:
        attributes["k8s.pod.name"] = identity.instance
    return attributes


def instance_event(
    identity: Identity,
    event: InstanceEventType,
    timestamp: float,
    started_at: float,
    gpu_count: int,
    url: str | None,
) -> InstanceEvent:
    """The ``event`` of ``identity`` at ``timestamp``; ids sort by time, unique per instance."""
    return InstanceEvent(
        event_id=sample_id(timestamp, identity.instance, event.value),
        instance=identity.instance,
        replica=identity.replica,
        model=identity.model,
        event=event.value,
        timestamp=timestamp,
        started_at=started_at,
        node=identity.node,
        gpu_model=identity.gpu_model,
        gpu_count=gpu_count,
        gpus=",".join(identity.gpus),
        namespace=identity.namespace,
        pod_uid=identity.pod_uid,
        engine_metrics_url=url,
    )


class Lifetime:
    """The spool directory's lock, and the start, heartbeat and stop events in their spool."""

    def __init__(
        self,
        identity: Identity,
        directory: Path,
        heartbeat_seconds: float,
        gpu_count: int,
        engine_metrics_url: str | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        sealer: Callable[[bytes], bytes] | None = None,
    ) -> None:
        """``sealer``: the instance's seal on each event (``infermeter.writers.Sealer``)."""
        self.identity = identity
        self.lock = SpoolLock(directory)
        self.spool = Spool(directory / INSTANCES, max_bytes=EVENTS_MAX_BYTES, sealer=sealer)
        self.heartbeat_seconds = heartbeat_seconds
        self.gpu_count = gpu_count
        self.engine_metrics_url = engine_metrics_url
        self.clock = clock
        self.started_at: float | None = None
        self._beat: asyncio.Task[None] | None = None
        info = Gauge(
            "infermeter_sidecar_instance_info",
            "The instance this sidecar fronts (always 1): its id, replica group, node and pod.",
            ["instance", "replica", "node", "namespace", "pod_uid"],
            registry=registry,
        )
        info.labels(
            identity.instance,
            identity.replica,
            identity.node,
            identity.namespace or "",
            identity.pod_uid or "",
        ).set(1)

    async def claim(self, wait_seconds: float = LOCK_WAIT_SECONDS) -> None:
        """Take the spool directory's lock (SpoolBusyError if it stays held), open the spool."""
        await self.lock.acquire(wait_seconds)
        self.spool.open()

    async def start(self) -> None:
        """Announce the start and begin heartbeating."""
        self.started_at = self.clock()
        await self._announce(InstanceEventType.START, self.started_at)
        self._beat = asyncio.get_running_loop().create_task(self._heartbeats())

    async def stop(self) -> None:
        """Stop heartbeating and announce the stop (durable when this returns)."""
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
            self._beat = None
        if self.started_at is not None:
            await self._announce(InstanceEventType.STOP, self.clock())
            self.started_at = None

    async def close(self) -> None:
        """Close the events spool (the lock is kept: see ``release``)."""
        await self.spool.close()

    def release(self) -> None:
        """Let the spool directory go: from now on the node's collector may adopt it."""
        self.lock.release()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            await self._announce(InstanceEventType.HEARTBEAT, self.clock())

    async def _announce(self, event: InstanceEventType, timestamp: float) -> None:
        assert self.started_at is not None
        record = instance_event(
            self.identity,
            event,
            timestamp,
            self.started_at,
            self.gpu_count,
            self.engine_metrics_url,
        )
        try:
            await self.spool.append(record.to_json())
        except SpoolError as exc:
            log.error(
                "instance %s: %s event not recorded: %s", self.identity.instance, event.value, exc
            )
