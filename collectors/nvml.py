"""NVML (nvidia-ml-py) as a GPU source for the machine the collector runs on.

The library is imported on first use, not at import time, so the collector starts on machines
without it. A missing library, a missing driver or no GPU is a ``ScrapeError`` with one line
(``NVML unavailable: ...``): the target is marked down and retried, nothing crashes.
"""

from __future__ import annotations

import asyncio
import importlib
from types import ModuleType
from typing import Any

from collectors.sources import GpuReading, ScrapeError

__all__ = ["NvmlSource", "load_nvml"]


def load_nvml(module: str = "pynvml") -> ModuleType:
    """Import and initialise NVML; ScrapeError with a one-line reason when it cannot be."""
    try:
        nvml = importlib.import_module(module)
    except ImportError:
        raise ScrapeError(
            "NVML unavailable: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        ) from None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise ScrapeError(f"NVML unavailable: {exc}") from None
    return nvml


class NvmlSource:
    """Every GPU of this machine, read through NVML in a worker thread."""

    kind = "nvml"

    def __init__(self, node: str, module: str = "pynvml") -> None:
        self.target = node
        self.module = module
        self._nvml: ModuleType | None = None

    async def read(self) -> list[GpuReading]:
        """Read every device now."""
        return await asyncio.to_thread(self._read)

    def _read(self) -> list[GpuReading]:
        if self._nvml is None:
            self._nvml = load_nvml(self.module)
        nvml = self._nvml
        try:
            return [self._device(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as exc:
            raise ScrapeError(f"NVML read failed: {exc}") from None

    def _device(self, nvml: Any, index: int) -> GpuReading:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            energy_mj: float | None = float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        except nvml.NVMLError_NotSupported:  # pre-Volta boards have no energy counter
            energy_mj = None
        return GpuReading(
            node=self.target,
            gpu=str(index),
            uuid=str(nvml.nvmlDeviceGetUUID(handle)),
            model_name=str(nvml.nvmlDeviceGetName(handle)),
            utilization=nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
            power_watts=nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            energy_mj=energy_mj,
            memory_used_mib=memory.used / 2**20,
            memory_free_mib=memory.free / 2**20,
        )
