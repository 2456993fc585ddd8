"""The local scale hook over real processes: instances of a group come and go under traffic."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from alerts.autoscale.local import LocalScaleHook, instances_wanted, place
from alerts.autoscale.policy import Decision
from infermeter.config import DEFAULT_CONFIG, Config, load_config
from infermeter.local_fleet import LocalInstance, read_fleet, write_fleet
from launcher.front_door import workers
from simulator.dcgm import node_exporters, render
from simulator.traffic import InstanceTargets
from tests.ports import off_demo_ports

GROUP = "small-0"


def write_config(tmp_path: Path, gpus: int = 5, delist_seconds: float = 0.0) -> tuple[Path, Config]:
    """The demo fleet with node-b holding ``gpus`` L40S (two fixed), its chat-small group scaled."""
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for node in raw["nodes"]:
        if node["name"] == "node-b":
            node["gpu_count"] = gpus
    raw["scaling"]["min_replicas"] = 1
    raw["sidecar"]["spool_dir"] = str(tmp_path / "spool")
    raw["simulator"]["instances_file"] = str(tmp_path / "instances.json")
    raw["autoscale"] = {
        "history_file": "",
        "local": {
            "enabled": True,
            "count_fixed_replicas": False,
            "groups": {"chat-small": GROUP},
            "stop_timeout_seconds": 5,
            "delist_seconds": delist_seconds,
        },
    }
    path = tmp_path / "infermeter.yaml"
    path.write_text(yaml.safe_dump(off_demo_ports(raw)))
    return path, load_config(path, environ={})


def decision(desired: int) -> Decision:
    return Decision("chat-small", 0.0, desired, desired, ("test",))


async def chat(client: httpx.AsyncClient, sidecar_url: str) -> None:
    """One streamed chat through an instance's sidecar, read to the end."""
    body = {
        "model": "chat-small",
        "stream": True,
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "count the GPUs"}],
    }
    headers = {"authorization": "Bearer im-demo-search"}
    url = f"{sidecar_url}/v1/chat/completions"
    async with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200
        async for _ in response.aiter_bytes():
            pass


async def usage(client: httpx.AsyncClient, upstream_url: str) -> dict[str, Any]:
    result: dict[str, Any] = (await client.get(f"{upstream_url}/_sim/usage")).json()
    return result


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_wanted_counts_fixed_replicas_and_keeps_the_minimum() -> None:
    """Desired replicas beyond the fixed ones, never below what min_replicas needs."""
    assert [instances_wanted(d, 2, 2) for d in (1, 2, 3, 5)] == [0, 0, 1, 3]
    assert [instances_wanted(d, 0, 1) for d in (0, 1, 3)] == [1, 1, 3]


def test_placement_takes_spare_gpus_only(tmp_path: Path) -> None:
    """Spare boards of a node with the group's GPU model, none held twice, None when all are."""
    _, config = write_config(tmp_path)
    group = config.replica(GROUP)
    assert place(config, group, {}) == ("node-b", (2,))
    assert place(config, group, {"node-b": {2, 3}}) == ("node-b", (4,))
    assert place(config, group, {"node-b": {2, 3, 4}}) is None


async def test_one_to_three_to_one_instances_under_traffic(tmp_path: Path) -> None:
    """Each instance serves traffic and draws its own GPU; scale-down stops the newest, processes and all."""
    path, config = write_config(tmp_path)
    registry = CollectorRegistry()
    async with httpx.AsyncClient(timeout=30.0) as client:
        hook = LocalScaleHook(config, path, client, registry)
        try:
            await hook.publish(decision(1))
            assert [i.instance for i in hook.instances()] == [f"vllm-{GROUP}-1"]
            await hook.publish(decision(3))
            live = hook.instances()
            assert [(i.instance, i.gpus) for i in live] == [
                (f"vllm-{GROUP}-1", (2,)),
                (f"vllm-{GROUP}-2", (3,)),
                (f"vllm-{GROUP}-3", (4,)),
            ]
            assert read_fleet(config_instances(config)).instances == tuple(live)
            for _ in range(3):
                await asyncio.gather(*(chat(client, str(i.sidecar_url)) for i in live))

            exporter = node_exporters(config, client, config_instances(config))["node-b"]
            page = render(await exporter.gpus())
            pods = gpu_pods(page)
            assert {pods[g] for g in ("2", "3", "4")} == {
                ("local", f"vllm-{GROUP}-{n}") for n in (1, 2, 3)
            }
            assert set(pods) == {"2", "3", "4"}  # the fixed replicas are not running here

            figures = [await usage(client, i.upstream_url) for i in live]
            for inst, fig in zip(live, figures, strict=True):
                assert fig["instance"] == inst.instance
                assert fig["generation_tokens"] > 0, fig
                assert fig["gpu_seconds_busy"] > 0, fig
            processes = [(r.replica.pid, r.sidecar.pid) for r in hook.running[GROUP]]

            await hook.publish(decision(1))
            assert [i.instance for i in hook.instances()] == [f"vllm-{GROUP}-1"]
            assert all(gone(pid) for pair in processes[1:] for pid in pair)
            assert not any(gone(pid) for pid in processes[0])
            fleet = read_fleet(config_instances(config))
            assert [i.instance for i in fleet.stopped] == [f"vllm-{GROUP}-3", f"vllm-{GROUP}-2"]
            for stopped in fleet.stopped:
                assert stopped.usage is not None
                assert stopped.usage["generation_tokens"] > 0
                assert stopped.stopped_at is not None
            get = registry.get_sample_value
            assert get("infermeter_autoscale_local_instances", {"replica": GROUP}) == 1
        finally:
            await hook.close()
    assert all(gone(pid) for pair in processes for pid in pair)
    assert read_fleet(config_instances(config)).instances == ()


async def test_a_stopping_instance_is_drained_before_its_sidecar_is_stopped(
    tmp_path: Path,
) -> None:
    """A scale-down marks the instance draining in the file ``delist_seconds`` before its
    sidecar gets SIGTERM: the traffic and the front door send it nothing new from then on, the
    dcgm-exporter stand-in still shows its GPU as its own, and its sidecar still serves."""
    path, config = write_config(tmp_path, delist_seconds=0.6)
    instances = config_instances(config)
    clock = asyncio.get_running_loop().time
    # When each instance was first marked draining, and what the readers saw at its SIGTERM.
    drained: dict[str, float] = {}
    at_sigterm: list[dict[str, Any]] = []
    sidecars: dict[int, LocalInstance] = {}
    async with httpx.AsyncClient(timeout=30.0) as client:
        hook = LocalScaleHook(config, path, client, CollectorRegistry())
        write, terminate = hook._write, hook._terminate

        def recording_write() -> None:
            write()
            for i in read_fleet(instances).instances:
                if i.draining:
                    drained.setdefault(i.instance, clock())

        async def recording_terminate(proc: Any) -> None:
            record = sidecars.pop(id(proc), None)
            if record is not None:
                fleet = read_fleet(instances)
                exporter = node_exporters(config, client, instances)[record.node]
                at_sigterm.append(
                    {
                        "instance": record.instance,
                        "when": clock(),
                        "draining": {i.instance: i.draining for i in fleet.instances},
                        "traffic": {t.base_url for t in InstanceTargets(config, instances, True)()},
                        "front door": set(workers(config, fleet)),
                        "gpus": gpu_pods(render(await exporter.gpus())),
                    }
                )
                await chat(client, str(record.sidecar_url))  # it still serves
            await terminate(proc)

        hook._write = recording_write  # type: ignore[method-assign]
        hook._terminate = recording_terminate  # type: ignore[method-assign]
        try:
            await hook.publish(decision(2))
            sidecars.update({id(r.sidecar): r.record for r in hook.running[GROUP]})
            oldest, newest = hook.instances()
            await hook.publish(decision(1))
        finally:
            sidecars.clear()
            await hook.close()
    assert len(at_sigterm) == 1
    seen = at_sigterm[0]
    assert seen["instance"] == newest.instance
    assert seen["draining"] == {oldest.instance: False, newest.instance: True}
    assert seen["traffic"] == {str(oldest.sidecar_url)}
    assert str(newest.sidecar_url) not in seen["front door"]
    assert str(oldest.sidecar_url) in seen["front door"]
    assert seen["gpus"][str(newest.gpus[0])] == ("local", newest.instance)
    assert seen["when"] - drained[newest.instance] >= 0.6
    assert read_fleet(instances).instances == ()


async def test_no_spare_gpu_is_said_and_never_oversubscribed(tmp_path: Path) -> None:
    """Asking for more instances than spare boards starts what fits and counts the rest."""
    path, config = write_config(tmp_path, gpus=3)
    registry = CollectorRegistry()
    earlier = LocalInstance(
        f"vllm-{GROUP}-7",
        GROUP,
        "chat-small",
        "node-b",
        (2,),
        "local",
        "http://127.0.0.1:1",
        None,
        0.0,
    )
    write_fleet(config_instances(config), [earlier], [])  # left by an autoscaler that died
    async with httpx.AsyncClient(timeout=30.0) as client:
        hook = LocalScaleHook(config, path, client, registry)
        try:
            await hook.publish(decision(3))
            # The dead autoscaler's instance holds nothing now, and its id is not used again.
            assert [(i.instance, i.gpus) for i in hook.instances()] == [(f"vllm-{GROUP}-8", (2,))]
            assert [i.instance for i in read_fleet(config_instances(config)).stopped] == [
                f"vllm-{GROUP}-7"
            ]
            get = registry.get_sample_value
            assert get("infermeter_autoscale_local_unplaced", {"replica": GROUP}) == 2
        finally:
            await hook.close()


def config_instances(config: Config) -> Path:
    return Path(config.simulator.instances_file)


def gpu_pods(page: str) -> dict[str, tuple[str, str]]:
    """GPU index -> (namespace, pod) for the boards the page shows a pod on."""
    pods = {}
    for family in text_string_to_metric_families(page):
        if family.name != "DCGM_FI_DEV_GPU_UTIL":
            continue
        for sample in family.samples:
            if "pod" in sample.labels:
                pods[sample.labels["gpu"]] = (sample.labels["namespace"], sample.labels["pod"])
    return pods
