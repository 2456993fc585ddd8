"""The local scale hook: a model's desired count, applied as simulated instances on this machine.

What Kubernetes does for the shipped manifests (start pods of a Deployment, stop the newest
first), this hook does for the simulated fleet of ``infermeter demo``: each instance of a replica
group is one simulated vLLM replica process and its sidecar process, on free loopback ports, on
spare GPUs of the configured nodes. The sidecar starts with ``INFERMETER_INSTANCE=vllm-<group>-<n>``
(and the node, GPUs and namespace a pod would have), so it meters as that instance of the group.
The name is a pod name of the shipped manifests' shape: the collector places a GPU whose pod
label reads ``vllm-<group>-...`` in that group (``collectors.attribution``), so the lent boards
the dcgm-exporter stand-in labels with the instance are billed to it.

Standing where the cluster would, the hook also hands each sidecar it starts its writer credential
(``infermeter.writers``: instance ``vllm-<group>-<n>`` of the group, at its listen address),
issued from the writer secret in its own environment (``billing.writer_secret_env``); neither the
secret nor the autoscaler's own credential reaches the processes it starts. Without the secret, a
sidecar starts with no credential (and ships with the shared ingest token, if it has one).

The hook writes the live instances to ``simulator.instances_file`` (``infermeter.local_fleet``):
the dcgm-exporter stand-in shows their GPUs with the pod labels, the traffic generator sends them
requests, and each stopped instance keeps the simulator's own figures (GPU-seconds busy and seen,
tokens) to compare with billing's.

Counting (pure, ``instances_wanted``): the model's desired replicas, less its configured replicas
when ``count_fixed_replicas`` (the fleet runs them beside), and never fewer than what
``min_replicas`` needs. Placing (pure, ``place``): a node with the group's GPU model and enough
GPUs that neither a configured replica nor a live instance holds, the group's own node first;
none: the hook logs it and counts it in ``infermeter_autoscale_local_unplaced{replica}``, and
never puts two instances on one GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import httpx
from prometheus_client import CollectorRegistry, Gauge

from alerts.autoscale.hooks import HookError
from alerts.autoscale.policy import Decision
from collectors.attribution import POD_PREFIX
from infermeter.config import Config, Replica, process_environment
from infermeter.local_fleet import LocalInstance, read_fleet, write_fleet
from infermeter.serving import free_port
from infermeter.writers import Writer, issue

__all__ = [
    "LocalScaleHook",
    "fixed_gpus",
    "group_of",
    "instances_wanted",
    "place",
]

log = logging.getLogger("infermeter.autoscale")


def group_of(config: Config, model: str) -> Replica | None:
    """The replica group the hook scales for ``model``: configured, else the model's first."""
    wanted = config.autoscale.local.groups.get(model)
    for r in config.replicas:
        if (r.id == wanted) if wanted else (r.model == model):
            return r
    return None


def instances_wanted(desired: int, fixed: int, min_replicas: int) -> int:
    """Instances the hook runs so the model has ``desired`` replicas beside ``fixed`` ones."""
    return max(desired - fixed, min_replicas - fixed, 0)


def fixed_gpus(config: Config) -> dict[str, set[int]]:
    """The GPU indices each node's configured replicas hold (as the dcgm stand-in assigns them)."""
    held: dict[str, set[int]] = {}
    for node in config.node_names():
        next_free = 0
        for r in (r for r in config.replicas if r.node == node):
            indices = [int(g) for g in r.gpus if str(g).isdigit()] or list(
                range(next_free, next_free + r.gpu_count)
            )
            next_free = max(indices) + 1
            held.setdefault(node, set()).update(indices)
    return held


def place(
    config: Config, group: Replica, lent: Mapping[str, set[int]]
) -> tuple[str, tuple[int, ...]] | None:
    """A node and ``group.gpu_count`` of its spare GPUs that no one holds; None if none has them."""
    held = fixed_gpus(config)
    nodes = sorted(config.nodes, key=lambda n: n.name != group.node)
    for node in nodes:
        if (node.gpu_model or "") != group.gpu_model:
            continue
        taken = held.get(node.name, set()) | lent.get(node.name, set())
        free = [i for i in range(node.gpu_count) if i not in taken]
        if len(free) >= group.gpu_count:
            return node.name, tuple(free[: group.gpu_count])
    return None


@dataclass
class _Running:
    """One live instance: its record and its two processes."""

    record: LocalInstance
    replica: subprocess.Popen[bytes]
    sidecar: subprocess.Popen[bytes]


class LocalScaleHook:
    """Starts and stops simulated instances so each scaled group has the instances wanted."""

    name: ClassVar[str] = "local"

    def __init__(
        self,
        config: Config,
        config_path: Path,
        client: httpx.AsyncClient,
        registry: CollectorRegistry | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.settings = config.autoscale.local
        self.config_path = config_path
        self.client = client
        self.path = Path(config.simulator.instances_file)
        environ = dict(process_environment() if environ is None else environ)
        secret = environ.get(config.billing.writer_secret_env, "")
        self._secret = secret.encode() or None
        # What the processes it starts inherit: never the secret nor the autoscaler's credential.
        for name in (
            config.billing.writer_secret_env,
            config.autoscale.credential_env,
            config.sidecar.credential_env,
        ):
            environ.pop(name, None)
        self.environ = environ
        self.running: dict[str, list[_Running]] = {}
        # Instances being stopped: out of the traffic, their GPUs still theirs (``_stop``).
        self._draining: list[LocalInstance] = []
        previous = read_fleet(self.path)
        # Instances an earlier run left live died with it (they run in its process group).
        now = time.time()
        self.stopped = [*previous.stopped, *(i.stopped(now, None) for i in previous.instances)]
        # Ids are never reused, even across restarts: billing keeps every instance's lifetime.
        self._serial: dict[str, int] = {}
        for inst in self.stopped:
            self._serial[inst.replica] = max(self._serial.get(inst.replica, 0), _serial(inst))
        self._write()
        registry = registry or CollectorRegistry()
        self.live = Gauge(
            "infermeter_autoscale_local_instances",
            "Simulated instances the local scale hook runs, by replica group.",
            ["replica"],
            registry=registry,
        )
        self.unplaced = Gauge(
            "infermeter_autoscale_local_unplaced",
            "Instances wanted that no spare GPU could take, by replica group.",
            ["replica"],
            registry=registry,
        )

    async def publish(self, decision: Decision) -> None:
        """Start or stop instances of the model's group until it has the number wanted."""
        group = group_of(self.config, decision.model)
        if group is None:
            return
        fixed = sum(r.model == decision.model for r in self.config.replicas)
        fixed = fixed if self.settings.count_fixed_replicas else 0
        wanted = instances_wanted(decision.desired, fixed, self.config.scaling.min_replicas)
        running = self.running.setdefault(group.id, [])
        self._reap(running)
        unplaced = 0
        while len(running) < wanted:
            spot = place(self.config, group, self._lent())
            if spot is None:
                unplaced = wanted - len(running)
                log.warning(
                    "autoscale: local: no spare %s GPUs for %d more instance(s) of %s",
                    group.gpu_model,
                    unplaced,
                    group.id,
                )
                break
            running.append(await self._start(group, *spot))
            self._write()
        while len(running) > wanted:
            await self._stop(running.pop())
            self._write()
        self.unplaced.labels(replica=group.id).set(unplaced)
        self.live.labels(replica=group.id).set(len(running))

    async def close(self) -> None:
        """Stop every instance, newest first (at once: the autoscaler is going, and so is what
        sent them traffic)."""
        for running in self.running.values():
            while running:
                await self._stop(running.pop(), delist_seconds=0.0)
                self._write()

    def instances(self) -> list[LocalInstance]:
        """The live instances, oldest first per group."""
        return [r.record for group in self.running.values() for r in group]

    def _lent(self) -> dict[str, set[int]]:
        lent: dict[str, set[int]] = {}
        for inst in [*self.instances(), *self._draining]:
            lent.setdefault(inst.node, set()).update(inst.gpus)
        return lent

    def _reap(self, running: list[_Running]) -> None:
        """Forget instances whose processes ended on their own (and stop their other half)."""
        for r in list(running):
            if r.replica.poll() is None and r.sidecar.poll() is None:
                continue
            log.error("autoscale: local: instance %s exited on its own", r.record.instance)
            for proc in (r.sidecar, r.replica):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            running.remove(r)
            self.stopped.append(r.record.stopped(time.time(), None))
            self._write()

    async def _start(self, group: Replica, node: str, gpus: tuple[int, ...]) -> _Running:
        self._serial[group.id] = self._serial.get(group.id, 0) + 1
        instance = f"{POD_PREFIX}{group.id}-{self._serial[group.id]}"
        upstream = f"http://127.0.0.1:{free_port()}"
        listen = f"127.0.0.1:{free_port()}"
        replica = self._spawn(
            ["simulate", "--replica", group.id, "--listen", upstream[7:], "--instance", instance],
            self.environ,
        )
        env = {
            **self.environ,
            "INFERMETER_INSTANCE": instance,
            "NODE_NAME": node,
            "NVIDIA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
            # The sidecar spools under <sidecar.spool_dir>/<instance>: a spool of its own.
            "POD_NAMESPACE": self.settings.namespace,
        }
        if self._secret is not None:
            writer = Writer.for_instance(group.id, instance, listen)
            env[self.config.sidecar.credential_env] = issue(self._secret, writer).token
        sidecar: subprocess.Popen[bytes] | None = None
        try:
            await self._ready(replica, f"{upstream}/health", instance)
            sidecar = self._spawn(
                ["sidecar", "--replica", group.id, "--listen", listen, "--upstream", upstream], env
            )
            await self._ready(sidecar, f"http://{listen}/healthz", instance)
        except BaseException:
            # A start that failed or was cancelled (the autoscaler is stopping) leaves nothing
            # behind; a process that is not ready yet has served nothing, so SIGKILL is safe.
            for proc in (sidecar, replica):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
            raise
        assert sidecar is not None
        record = LocalInstance(
            instance=instance,
            replica=group.id,
            model=group.model,
            node=node,
            gpus=gpus,
            namespace=self.settings.namespace,
            upstream_url=upstream,
            sidecar_url=f"http://{listen}",
            started_at=time.time(),
        )
        log.info(
            "autoscale: local: started %s on %s GPUs %s (sidecar http://%s)",
            instance,
            node,
            list(gpus),
            listen,
        )
        return _Running(record, replica, sidecar)

    async def _stop(self, running: _Running, delist_seconds: float | None = None) -> None:
        """Stop an instance (already out of ``running``) as a cluster stops a pod.

        Marked draining in the instances file first, so that its readers send it nothing new
        (its GPUs stay its own); the sidecar ``delist_seconds`` later (default: the settings'),
        by when they have read the file again (its requests end, its records are written);
        then the replica.
        """
        record = running.record
        draining = replace(record, draining=True)
        self._draining.append(draining)
        self._write()
        try:
            wait = self.settings.delist_seconds if delist_seconds is None else delist_seconds
            if wait > 0:
                await asyncio.sleep(wait)
            await self._terminate(running.sidecar)
            usage = await self._usage(record.upstream_url)
            await self._terminate(running.replica)
        finally:
            self._draining.remove(draining)
        self.stopped.append(record.stopped(time.time(), usage))
        log.info("autoscale: local: stopped %s", record.instance)

    def _spawn(self, args: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "launcher", *args, "--config", str(self.config_path)]
        # In this process's group: whoever kills the autoscaler's group takes its instances too.
        return subprocess.Popen(argv, env=dict(env))

    async def _ready(self, proc: subprocess.Popen[bytes], url: str, instance: str) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_seconds
        while True:
            if proc.poll() is not None:
                raise HookError(f"local: {instance} exited with code {proc.returncode} at start")
            with contextlib.suppress(httpx.HTTPError):
                if (await self.client.get(url, timeout=1.0)).status_code < 500:
                    return
            if time.monotonic() > deadline:
                raise HookError(f"local: {instance} did not answer {url} in time")
            await asyncio.sleep(0.1)

    async def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_seconds``; returns once it is gone."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.stop_timeout_seconds
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        await asyncio.to_thread(proc.wait)

    async def _usage(self, upstream: str) -> dict[str, float] | None:
        try:
            response = await self.client.get(f"{upstream}/_sim/usage", timeout=2.0)
            response.raise_for_status()
            data = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("autoscale: local: no figures from %s: %s", upstream, exc)
            return None
        return {k: float(v) for k, v in data.items() if isinstance(v, int | float)}

    def _write(self) -> None:
        write_fleet(self.path, [*self.instances(), *self._draining], self.stopped)


def _serial(inst: LocalInstance) -> int:
    """The ``<n>`` of an instance called ``vllm-<group>-<n>`` (or ``<group>-<n>``); else 0."""
    tail = inst.instance.removeprefix(POD_PREFIX).removeprefix(f"{inst.replica}-")
    return int(tail) if tail.isdigit() else 0
