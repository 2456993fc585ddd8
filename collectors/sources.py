"""What a collector reads, and the two small interfaces its data sources implement.

A source is anything that can be asked, once per scrape, for readings: dcgm-exporter over HTTP,
NVML in-process, a vLLM replica's /metrics, or a fake in tests. Sources raise ``ScrapeError``
with a one-line reason for anything that went wrong on their side (down, garbage, no driver);
the loop marks the target down and backs off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

__all__ = [
    "EngineReading",
    "EngineSource",
    "GpuReading",
    "GpuSource",
    "ScrapeError",
    "screen_gpu_readings",
]


class ScrapeError(Exception):
    """A target could not be read; the message is one line naming the target and the reason."""


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU (or MIG slice) as a source saw it, before attribution and energy accounting.

    ``utilization`` is a ratio (0..1). ``energy_mj`` is the board's millijoule counter since boot,
    ``None`` when the source has no counter (then energy is integrated from power); a MIG slice
    has its board's, whole, and its ``share`` of the board's increase is its energy.
    """

    node: str
    gpu: str
    uuid: str
    model_name: str
    utilization: float
    power_watts: float
    energy_mj: float | None
    memory_used_mib: float
    memory_free_mib: float
    xid_errors: int = 0
    gr_engine_active: float | None = None
    mig_profile: str | None = None
    mig_instance: str | None = None
    hostname: str | None = None
    pod: str | None = None
    namespace: str | None = None
    container: str | None = None
    # The part of the board this reading stands for: 1 for a whole GPU, a MIG slice's compute
    # share of its board (its power and energy are that share of the board's).
    share: float = 1.0
    # Fields the page gave this GPU twice with different values (``<field> <a> and <b>``): which
    # is true cannot be told, so the reading is refused (``screen_gpu_readings``).
    conflicts: tuple[str, ...] = ()
    # Measures the page did not give this GPU (``power``, ``utilization``, ``UUID``): a zero in
    # their place would be invented, so the reading is refused (``screen_gpu_readings``).
    missing: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str, str]:
        """Identity across scrapes: node, board UUID and MIG GPU instance ('' for a whole GPU)."""
        return (self.node, self.uuid, self.mig_instance or "")

    @property
    def slot(self) -> str:
        """The GPU as named in samples: its index, or ``<index>/<GPU_I_ID>`` for a MIG slice."""
        return f"{self.gpu}/{self.mig_instance}" if self.mig_instance else self.gpu


@dataclass(frozen=True, slots=True)
class EngineReading:
    """A vLLM engine's state and counters from one /metrics scrape, summed over its engines."""

    requests_running: float
    requests_waiting: float
    kv_cache_usage: float
    prompt_tokens_total: float
    generation_tokens_total: float
    prefix_cache_queries_total: float
    prefix_cache_hits_total: float
    preemptions_total: float
    kv_cache_tokens: float | None = None  # the engine's KV-cache capacity, when it says


# The measures of a reading that must be finite and not negative to be believed.
_GPU_MEASURES = ("utilization", "power_watts", "memory_used_mib", "memory_free_mib")


def _believable(value: float) -> bool:
    return math.isfinite(value) and value >= 0.0


def screen_gpu_readings(readings: list[GpuReading]) -> tuple[list[GpuReading], list[str]]:
    """The readings fit to sample, and one line per value refused (``<node>/<gpu> field=value``).

    Every value a GPU reports is a gauge or counter that cannot be negative, and NaN or an
    infinity is no measurement at all. Taken as-is, one NaN power made the board's energy, and
    every running total it was added to, NaN for the rest of the process, and spooled as JSON
    null (energy "unknown" on a sample that says it is no gap); a negative energy counter read
    as a reset and gave negative energy. What is done instead is what tells the least untruth:

    - an energy counter refused is treated as missing: the board is measured from its power, as
      a board without a counter is, so its time and energy are still billed;
    - any other measure refused (power, utilization, memory), a utilization over 1, a field
      the page gave twice with different values (``conflicts``), or a power, utilization or
      UUID the page did not give at all (``missing``: dcgm-exporter leaves out a field DCGM
      returned blank, as on a faulty board), leaves the GPU out of this round.
      There is no "unknown" to put in its place, and a zero would be invented (a counter-less
      board's energy is integrated from its power). Its previous reading stays the baseline, so
      the next good reading measures the whole interval from the counter, or past the gap limit
      is a gap, as after any missed reading.
    """
    fit: list[GpuReading] = []
    refused: list[str] = []
    for r in readings:
        bad = [f"{f}={getattr(r, f)!r}" for f in _GPU_MEASURES if not _believable(getattr(r, f))]
        if _believable(r.utilization) and r.utilization > 1.0:
            bad.append(f"utilization={r.utilization!r} (over 1)")
        bad.extend(f"{c} (two series for one GPU)" for c in r.conflicts)
        bad.extend(f"{m} missing from the page" for m in r.missing)
        counter_bad = r.energy_mj is not None and not _believable(r.energy_mj)
        refused.extend(f"{r.node}/{r.slot} {b}" for b in bad)
        if counter_bad:
            refused.append(f"{r.node}/{r.slot} energy_mj={r.energy_mj!r}")
        if not bad:
            fit.append(replace(r, energy_mj=None) if counter_bad else r)
    return fit, refused


class GpuSource(Protocol):
    """A node's GPUs: dcgm-exporter, NVML, or a fake."""

    @property
    def target(self) -> str:
        """The target's name in logs and metrics (the node name)."""
        ...

    @property
    def kind(self) -> str:
        """``dcgm`` or ``nvml`` (or what a fake calls itself)."""
        ...

    async def read(self) -> list[GpuReading]:
        """Every GPU of the node now; ScrapeError if the node cannot be read."""
        ...


class EngineSource(Protocol):
    """One engine instance's state: vLLM /metrics, or a fake."""

    @property
    def target(self) -> str:
        """The instance id (the replica id for a fixed replica): names its state and samples."""
        ...

    @property
    def replica(self) -> str:
        """The replica group the engine is an instance of."""
        ...

    @property
    def instance(self) -> str | None:
        """The instance id, or None for a fixed replica (its own single instance)."""
        ...

    @property
    def node(self) -> str | None:
        """The node the engine runs on, when its discovery said (its samples carry it)."""
        ...

    @property
    def kind(self) -> str:
        """``vllm``."""
        ...

    async def read(self) -> EngineReading:
        """The engine's state now; ScrapeError if it cannot be read."""
        ...
