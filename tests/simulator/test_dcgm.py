"""The dcgm-exporter stand-in writes what dcgm-exporter writes, driven by replica load."""

from __future__ import annotations

import asyncio
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from infermeter.config import load_config
from infermeter.local_fleet import LocalInstance, write_fleet
from infermeter.serving import free_port
from simulator.dcgm import DcgmGpu, node_exporters, render
from simulator.replica import ReplicaSim, replica_spec
from tests.ports import off_demo_ports
from tests.servers import serving

LINE = re.compile(r"^(?P<name>[A-Z_]+)\{(?P<labels>.*)\} (?P<value>\S+)$")


def _shape(text: str) -> list[tuple[str, ...]]:
    """Each line reduced to its kind, metric name, label names in order and value format."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            out.append(tuple(line.split(" ", 3)[:3]))
            continue
        m = LINE.match(line)
        assert m, line
        names = tuple(re.findall(r'(\w+)="', m["labels"]))
        fmt = (
            "float6"
            if re.fullmatch(r"\d+\.\d{6}", m["value"])
            else "int"
            if m["value"].isdigit()
            else "?"
        )
        out.append((m["name"], *names, fmt))
    return out


def _fixture_like(**kw: object) -> DcgmGpu:
    base = {
        "index": 0,
        "uuid": "GPU-a8394b51-c086-568a-9f1a-c1e1c934c44c",
        "model_name": "NVIDIA RTX 4000 Ada Generation",
        "hostname": "lke529760-766837-0a634ab30000",
        "utilization_pct": 0.0,
        "power_watts": 40.979,
        "energy_mj": 455497156,
        "memory_used_mib": 1,
        "memory_free_mib": 20015,
        "pod": ("cuda", "default", "cuda-75454ffb9f-8ljq7"),
        "pci_bus_id": "00000000:00:02.0",
    }
    base.update(kw)
    return DcgmGpu(**base)  # type: ignore[arg-type]


def test_exposition_has_the_capture_layout(fixture_text):
    """Same families in the same order, labels in dcgm-exporter's order, same number formats."""
    assert _shape(render([_fixture_like()])) == _shape(
        fixture_text("dcgm-exporter-rtx4000ada-k8s.prom")
    )


def test_key_lines_equal_the_capture_byte_for_byte(fixture_text):
    """With the capture's readings, power, energy and memory lines are identical."""
    ours = render([_fixture_like()]).splitlines()
    real = fixture_text("dcgm-exporter-rtx4000ada-k8s.prom").splitlines()
    for name in (
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_XID_ERRORS",
    ):
        assert [x for x in ours if x.startswith(name + "{")] == [
            x for x in real if x.startswith(name + "{")
        ]


def test_gpus_without_a_pod_carry_no_kubernetes_labels():
    """Pod labels appear only on boards that a pod holds, as with pod mapping on."""
    text = render([_fixture_like(pod=None)])
    assert "pod=" not in text
    assert "namespace=" not in text
    assert list(text_string_to_metric_families(text))


async def test_node_exporter_reports_replica_load_and_consistent_energy(config):
    """A loaded replica's GPUs show utilization; the energy counter matches the simulator's."""
    port = free_port()
    replica = config.replica("small-0")
    data = off_demo_ports(config.model_dump())  # the other replicas: nothing listens there
    for r in data["replicas"]:
        if r["id"] == "small-0":
            r["upstream_url"] = f"http://127.0.0.1:{port}"
    cfg = type(config).model_validate(data)
    sim = ReplicaSim(replica_spec(cfg, "small-0"))
    async with serving(sim, port) as url, httpx.AsyncClient(timeout=60) as client:
        exporters = node_exporters(cfg, client)
        node = exporters[replica.node]
        async with serving(node, lifespan="off") as dcgm_url:
            body = {"prompt": "p " * 50, "max_tokens": 120, "ignore_eos": True}
            load = [
                asyncio.create_task(client.post(f"{url}/v1/completions", json=body))
                for _ in range(16)
            ]
            await asyncio.sleep(1.2)
            busy_text = (await client.get(f"{dcgm_url}/metrics")).text
            await asyncio.gather(*load)
            truth = sim.gpu_readings()[0]["energy_joules"]
            text = (await client.get(f"{dcgm_url}/metrics")).text
            truth_after = sim.gpu_readings()[0]["energy_joules"]
    samples = {
        (s.name, s.labels["gpu"]): s
        for f in text_string_to_metric_families(busy_text)
        for s in f.samples
    }
    assert samples[("DCGM_FI_DEV_GPU_UTIL", "0")].value > 50
    assert samples[("DCGM_FI_DEV_POWER_USAGE", "0")].value > 35 * 1.5
    after = {
        (s.name, s.labels["gpu"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    offset = next(sl.boot_offset_mj for sl in node.slots if sl.index == 0)
    # prometheus-client's parser names counter samples with a _total suffix.
    reported_j = (after[("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total", "0")] - offset) / 1000
    assert truth <= reported_j <= truth_after + 1e-3
    # The spare-free node-b has two boards: the other replica's is idle (its process is not running).
    assert after[("DCGM_FI_DEV_GPU_UTIL", "1")] == 0


def test_every_configured_node_gets_an_exporter_with_all_its_boards():
    """node-a has its 2 H100s, node-b its 2 L40S, each with a stable UUID."""
    cfg = load_config(None, environ={})
    exporters = node_exporters(cfg, httpx.AsyncClient())
    assert {n: len(e.slots) for n, e in exporters.items()} == {"node-a": 2, "node-b": 2}
    again = node_exporters(cfg, httpx.AsyncClient())
    assert [s.uuid for s in exporters["node-a"].slots] == [s.uuid for s in again["node-a"].slots]


def _board(text: str, gpu: str) -> dict[str, tuple[float, dict[str, str]]]:
    """Each field of one board: its value and its labels."""
    return {
        s.name: (s.value, s.labels)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("gpu") == gpu
    }


async def test_a_board_lent_to_an_instance_follows_its_load_and_reads_idle_after(config, tmp_path):
    """A spare board shows the instance's load and pod while lent, idles after, and its energy never goes back."""
    data = off_demo_ports(config.model_dump())  # the fixed replicas: nothing listens there
    next(n for n in data["nodes"] if n["name"] == "node-b")["gpu_count"] = 3
    cfg = type(config).model_validate(data)
    instances = tmp_path / "instances.json"
    sim = ReplicaSim(replica_spec(cfg, "small-0", instance="small-0-1"))
    energy = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total"
    async with serving(sim) as url, httpx.AsyncClient(timeout=60) as client:
        node = node_exporters(cfg, client, instances)["node-b"]
        before = _board(render(await node.gpus()), "2")
        lent = LocalInstance(
            "small-0-1", "small-0", "chat-small", "node-b", (2,), "local", url, None, 0.0
        )
        write_fleet(instances, [lent], [])
        body = {"prompt": "p " * 50, "max_tokens": 400, "ignore_eos": True}
        load = [
            asyncio.create_task(client.post(f"{url}/v1/completions", json=body)) for _ in range(16)
        ]
        # Read the board while the load runs, until it shows it: how soon depends only on how
        # fast this machine runs the engine's first steps.
        busy = _board(render(await node.gpus()), "2")
        while busy["DCGM_FI_DEV_GPU_UTIL"][0] <= 50 and not all(t.done() for t in load):
            await asyncio.sleep(0.2)
            busy = _board(render(await node.gpus()), "2")
        await asyncio.gather(*load)
        write_fleet(instances, [], [lent.stopped(1.0, None)])
        after = _board(render(await node.gpus()), "2")
    assert "pod" not in before["DCGM_FI_DEV_GPU_UTIL"][1]
    value, labels = busy["DCGM_FI_DEV_GPU_UTIL"]
    assert value > 50
    assert (labels["pod"], labels["namespace"], labels["container"]) == (
        "small-0-1",
        "local",
        "vllm",
    )
    assert busy["DCGM_FI_DEV_POWER_USAGE"][0] > 35 * 1.5
    assert after["DCGM_FI_DEV_GPU_UTIL"][0] == 0
    assert "pod" not in after["DCGM_FI_DEV_GPU_UTIL"][1]
    assert before[energy][0] <= busy[energy][0] <= after[energy][0]
