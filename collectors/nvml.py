"""NVML (nvidia-ml-py) as a GPU source for the machine the collector runs on.

The library is imported on first use, not at import time, so the collector starts on machines
without it. A missing library, a missing driver or no GPU is a ``ScrapeError`` with one line
(``NVML unavailable: ...``): the target is marked down and retried, nothing crashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import threading
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


def _settle(
    future: asyncio.Future[list[GpuReading]],
    result: list[GpuReading] | None,
    error: BaseException | None,
) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result or [])


class NvmlSource:
    """Every GPU of this machine, read through NVML in a worker thread."""

    kind = "nvml"

    def __init__(self, node: str, module: str = "pynvml") -> None:
        self.target = node
        self.module = module
        self._nvml: ModuleType | None = None
        self._running: asyncio.Future[list[GpuReading]] | None = None

    async def read(self) -> list[GpuReading]:
        """Read every device now, in a thread of its own; ScrapeError while an earlier read has
        not returned.

        A driver call that hangs (a faulty board) holds that one thread, a daemon's, so the
        process still stops: in the shared pool, a read given up on by the scrape's timeout
        went on holding a thread, each retry took another, and once the pool was full nothing
        else ran in it (the shipper, the baseline file), nor could the process exit.
        """
        if self._running is not None and not self._running.done():
            raise ScrapeError("NVML: the last read has not returned (a driver call hangs)")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[GpuReading]] = loop.create_future()

        def work() -> None:
            try:
                outcome: tuple[list[GpuReading] | None, BaseException | None] = (self._read(), None)
            except BaseException as exc:  # handed to the awaiting task, which raises it
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed while the call hung
                loop.call_soon_threadsafe(_settle, future, *outcome)

        self._running = future
        threading.Thread(target=work, name=f"nvml-{self.target}", daemon=True).start()
        # Shielded: a timeout gives up waiting, and the read stays the one running.
        return await asyncio.shield(future)

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
