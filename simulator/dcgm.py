"""A dcgm-exporter stand-in: one /metrics endpoint per node, in dcgm-exporter's exact format.

The text is written by hand rather than through prometheus-client because dcgm-exporter is a Go
program with its own habits that scrapers meet in the field: labels in a fixed order (not sorted),
integers without a decimal point, ratios and watts with six decimals, the energy counter in
millijoules since boot, Kubernetes pod labels only on GPUs that a pod holds. ``render`` is pure;
``NodeExporter`` gathers readings from the simulated replicas that own the node's GPUs.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from infermeter.asgi import Receive, Scope, Send, respond
from infermeter.config import Config, GpuProfile
from infermeter.local_fleet import read_fleet
from simulator.gpu import GpuMeter

__all__ = ["Board", "DcgmGpu", "NodeExporter", "gpu_uuid", "node_exporters", "render"]

DRIVER_VERSION = "580.95.05"

# (field, help, type, decimals) in the order dcgm-exporter's default counters file lists them.
FIELDS: tuple[tuple[str, str, str, int], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "gauge", 0),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "gauge", 0),
    ("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", "gauge", 0),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "gauge", 0),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "gauge", 6),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "Total energy consumption since boot (in mJ).",
        "counter",
        0,
    ),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries.", "counter", 0),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gauge", 0),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "gauge", 0),
    ("DCGM_FI_DEV_ENC_UTIL", "Encoder utilization (in %).", "gauge", 0),
    ("DCGM_FI_DEV_DEC_UTIL", "Decoder utilization (in %).", "gauge", 0),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "gauge", 0),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "gauge", 0),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "gauge", 0),
    ("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory reserved (in MiB).", "gauge", 0),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "Number of remapped rows for uncorrectable errors",
        "counter",
        0,
    ),
    (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "Number of remapped rows for correctable errors",
        "counter",
        0,
    ),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed", "gauge", 0),
    (
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "Total number of NVLink bandwidth counters for all lanes.",
        "counter",
        0,
    ),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "vGPU License status", "gauge", 0),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active.", "gauge", 6),
    (
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
        "gauge",
        6,
    ),
    (
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
        "gauge",
        6,
    ),
    (
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        "gauge",
        0,
    ),
    (
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        "gauge",
        0,
    ),
)


def gpu_uuid(seed: int, node: str, index: int) -> str:
    """A stable, realistic-looking GPU UUID for a simulated board."""
    h = hashlib.blake2b(f"{seed}/{node}/{index}".encode(), digest_size=16).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(frozen=True)
class DcgmGpu:
    """One GPU's labels and readings at one scrape."""

    index: int
    uuid: str
    model_name: str
    hostname: str
    utilization_pct: float
    power_watts: float
    energy_mj: int
    memory_used_mib: float
    memory_free_mib: float
    pod: tuple[str, str, str] | None = None  # (container, namespace, pod)
    xid: int = 0
    pci_bus_id: str = ""

    def values(self) -> dict[str, float]:
        """Field values; the ones a simulation cannot know get plausible constants."""
        util = self.utilization_pct / 100.0
        return {
            "DCGM_FI_DEV_SM_CLOCK": 1980 if util > 0 else 345,
            "DCGM_FI_DEV_MEM_CLOCK": 2619,
            "DCGM_FI_DEV_MEMORY_TEMP": round(38 + 20 * util),
            "DCGM_FI_DEV_GPU_TEMP": round(34 + 40 * util),
            "DCGM_FI_DEV_POWER_USAGE": self.power_watts,
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": self.energy_mj,
            "DCGM_FI_DEV_GPU_UTIL": round(self.utilization_pct),
            "DCGM_FI_DEV_MEM_COPY_UTIL": round(45 * util),
            "DCGM_FI_DEV_XID_ERRORS": self.xid,
            "DCGM_FI_DEV_FB_FREE": round(self.memory_free_mib),
            "DCGM_FI_DEV_FB_USED": round(self.memory_used_mib),
            "DCGM_FI_DEV_FB_RESERVED": 457,
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": util * 0.97,
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": util * 0.41,
            "DCGM_FI_PROF_DRAM_ACTIVE": util * 0.63,
            "DCGM_FI_PROF_PCIE_TX_BYTES": round(2e6 + 6e7 * util),
            "DCGM_FI_PROF_PCIE_RX_BYTES": round(1e6 + 4e7 * util),
        }

    def labels(self, xid: bool) -> str:
        """The label set in dcgm-exporter's order."""
        parts = [
            f'gpu="{self.index}"',
            f'UUID="{self.uuid}"',
            f'pci_bus_id="{self.pci_bus_id or f"00000000:{0x18 + self.index * 0x10:02X}:00.0"}"',
            f'device="nvidia{self.index}"',
            f'modelName="{self.model_name}"',
            f'Hostname="{self.hostname}"',
            f'DCGM_FI_DRIVER_VERSION="{DRIVER_VERSION}"',
        ]
        k8s = []
        if self.pod is not None:
            container, namespace, pod = self.pod
            k8s = [
                f'container="{container}"',
                f'namespace="{namespace}"',
                f'pod="{pod}"',
                'pod_uid=""',
            ]
        if xid:
            code = "0" if self.xid == 0 else str(self.xid)
            msg = "No Error" if self.xid == 0 else "Graphics Engine Exception"
            k8s = [*k8s, f'err_code="{code}"', f'err_msg="{msg}"']
            k8s.sort(key=lambda item: item.split("=", 1)[0])
        return ",".join(parts + k8s)


def render(gpus: list[DcgmGpu]) -> str:
    """dcgm-exporter's /metrics text for these GPUs."""
    out: list[str] = []
    rows = [(g, g.values()) for g in gpus]
    for name, doc, kind, decimals in FIELDS:
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")
        for gpu, values in rows:
            value = values.get(name, 0)
            text = f"{value:.{decimals}f}" if decimals else str(round(value))
            out.append(f"{name}{{{gpu.labels(name == 'DCGM_FI_DEV_XID_ERRORS')}}} {text}\n")
    return "".join(out)


@dataclass
class _Slot:
    """One board: owned by a fixed replica, lent to a simulated instance, or spare.

    Owned and lent boards are read over HTTP from their engine's process; a spare board (or one
    whose process does not answer) idles on the meter here, its counter going on from where it
    was.
    """

    index: int
    uuid: str
    profile: GpuProfile
    replica_url: str | None
    replica_gpu: int
    pod: tuple[str, str, str] | None
    spare: GpuMeter
    boot_offset_mj: int
    last_energy_j: float = 0.0
    spare_base_j: float = 0.0
    last_busy_s: float = 0.0
    busy_base_s: float = 0.0  # the board's busy counter less the instance's when lent
    instance: str | None = None  # the simulated instance the board was last lent to
    instance_base_j: float = 0.0  # the board's counter less the instance's meter when lent
    owner: str | None = None  # the fixed replica the configuration gives the board to
    gpu_model: str = ""  # the configuration's name of the board's model (prices are by it)


@dataclass(frozen=True)
class _Lent:
    """A board lent to a simulated instance for this scrape."""

    url: str
    gpu: int
    instance: str
    namespace: str
    replica: str


@dataclass(frozen=True)
class Board:
    """One board at one reading: what dcgm-exporter shows, and what only the simulation knows.

    ``holder`` is the instance the board is lent to or the fixed replica that owns it (None:
    spare), ``replica`` the holder's group; ``energy_j`` and ``busy_s`` are the board's counters
    since the stand-in began (the ground-truth log's GPU side).
    """

    gpu: DcgmGpu
    gpu_model: str
    holder: str | None
    replica: str | None
    energy_j: float
    busy_s: float


class NodeExporter:
    """The ASGI app of one node's dcgm-exporter."""

    def __init__(
        self,
        node: str,
        slots: list[_Slot],
        client: httpx.AsyncClient,
        instances_file: Path | None = None,
    ) -> None:
        self.node = node
        self.slots = slots
        self.client = client
        self.instances_file = instances_file
        # A scrape and the ground-truth log may read at once; the boards' counters are kept
        # across reads, so one reading at a time.
        self._lock = asyncio.Lock()

    def _lent(self) -> dict[int, _Lent]:
        """This node's boards that the live simulated instances hold, by index."""
        if self.instances_file is None:
            return {}
        lent = {}
        for inst in read_fleet(self.instances_file).instances:
            if inst.node != self.node:
                continue
            for local, index in enumerate(inst.gpus):
                url = inst.upstream_url.rstrip("/")
                lent[index] = _Lent(url, local, inst.instance, inst.namespace, inst.replica)
        return lent

    async def gpus(self) -> list[DcgmGpu]:
        """Read every board now."""
        return [board.gpu for board in await self.boards()]

    async def boards(self) -> list[Board]:
        """Read every board now, with its holder and counters."""
        async with self._lock:
            return await self._boards()

    async def _boards(self) -> list[Board]:
        now = time.monotonic()
        cache: dict[str, list[dict[str, float]]] = {}
        lent = self._lent()
        out = []
        for slot in self.slots:
            borrower = lent.get(slot.index) if slot.replica_url is None else None
            url = slot.replica_url or (borrower.url if borrower else None)
            gpu = borrower.gpu if borrower else slot.replica_gpu
            reading = None
            if url is not None:
                if url not in cache:
                    cache[url] = await self._fetch(url)
                rows = cache[url]
                reading = rows[gpu] if gpu < len(rows) else None
            spare = slot.spare.read(now)
            idle_energy_j = slot.last_energy_j + spare.energy_joules - slot.spare_base_j
            if reading is None:
                util, power = spare.utilization_pct, spare.power_watts
                energy_j = idle_energy_j
                used, free = 0.0, float(slot.profile.memory_mib)
                busy_s = slot.last_busy_s
            else:
                util, power = reading["utilization_pct"], reading["power_watts"]
                energy_j = reading["energy_joules"]
                busy_s = slot.busy_base_s + reading["busy_seconds"]
                if borrower is not None:
                    # The instance's meter started with its process: from the scrape that first
                    # sees it lent, the board's counter goes on by what that meter adds.
                    if slot.instance != borrower.instance:
                        slot.instance = borrower.instance
                        slot.instance_base_j = idle_energy_j - energy_j
                        slot.busy_base_s = slot.last_busy_s - reading["busy_seconds"]
                        busy_s = slot.last_busy_s
                    energy_j += slot.instance_base_j
                slot.last_energy_j = energy_j
                slot.last_busy_s = busy_s
                slot.spare_base_j = spare.energy_joules
                used, free = reading["memory_used_mib"], reading["memory_free_mib"]
            pod = slot.pod
            holder, group = slot.owner, slot.owner
            if borrower is not None:
                pod = ("vllm", borrower.namespace, borrower.instance)
                # A lent board is its instance's while the instance's engine answers for it:
                # the span dcgm-exporter shows it with the pod's labels.
                if reading is not None:
                    holder, group = borrower.instance, borrower.replica
            shown = DcgmGpu(
                index=slot.index,
                uuid=slot.uuid,
                model_name=slot.profile.product_name,
                hostname=self.node,
                utilization_pct=util,
                power_watts=power,
                energy_mj=slot.boot_offset_mj + round(energy_j * 1000),
                memory_used_mib=used,
                memory_free_mib=free,
                pod=pod if reading is not None else None,
            )
            out.append(Board(shown, slot.gpu_model, holder, group, energy_j, busy_s))
        return out

    async def _fetch(self, url: str) -> list[dict[str, float]]:
        try:
            response = await self.client.get(f"{url}/_sim/gpus", timeout=2.0)
            response.raise_for_status()
            rows: list[dict[str, float]] = orjson.loads(response.content)
            return rows
        except (httpx.HTTPError, orjson.JSONDecodeError):
            return []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve /metrics; everything else is 404, as on dcgm-exporter."""
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics":
            status, body = 200, render(await self.gpus()).encode()
        else:
            status, body = 404, b"404 page not found\n"
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        await respond(send, status, body, headers)


def node_exporters(
    config: Config, client: httpx.AsyncClient, instances_file: Path | None = None
) -> dict[str, NodeExporter]:
    """One exporter per node of the configuration, its boards assigned to their replicas.

    With ``instances_file``, spare boards lent to simulated instances (see
    ``infermeter.local_fleet``) show their instance's readings and its pod, read at each scrape.
    """
    seed = config.simulator.seed
    now = time.monotonic()
    result = {}
    for node_name in config.node_names():
        node = next((n for n in config.nodes if n.name == node_name), None)
        replicas = [r for r in config.replicas if r.node == node_name]
        owners: dict[int, tuple[str, int, str, str]] = {}
        next_free = 0
        for r in replicas:
            indices = [int(g) for g in r.gpus if str(g).isdigit()] or list(
                range(next_free, next_free + r.gpu_count)
            )
            next_free = max(indices) + 1
            for local, index in enumerate(indices):
                owners[index] = (r.upstream_url.rstrip("/"), local, r.gpu_model, r.id)
        count = max([*(i + 1 for i in owners), node.gpu_count if node else 0])
        slots = []
        for index in range(count):
            owner = owners.get(index)
            gpu_model = owner[2] if owner else (node.gpu_model if node and node.gpu_model else "")
            profile = config.simulator.gpus.get(gpu_model) or GpuProfile(
                idle_watts=60, max_watts=400, memory_mib=81920, product_name=f"NVIDIA {gpu_model}"
            )
            pod = ("vllm", "inference", f"vllm-{owner[3]}-0") if owner else None
            offset = int.from_bytes(
                hashlib.blake2b(f"{seed}{node_name}{index}".encode(), digest_size=4).digest(), "big"
            )
            slots.append(
                _Slot(
                    index=index,
                    uuid=gpu_uuid(seed, node_name, index),
                    profile=profile,
                    replica_url=owner[0] if owner else None,
                    replica_gpu=owner[1] if owner else 0,
                    pod=pod,
                    spare=GpuMeter(profile, now, memory_fraction=0.0),
                    boot_offset_mj=offset,
                    owner=owner[3] if owner else None,
                    gpu_model=gpu_model,
                )
            )
        result[node_name] = NodeExporter(node_name, slots, client, instances_file)
    return result
