"""NVML on a machine without it: one clear line, and the collector carries on."""

from __future__ import annotations

import asyncio
import sys
import threading
import types

import pytest

from collectors.loop import FleetCollector
from collectors.nvml import NvmlSource, load_nvml
from collectors.sources import ScrapeError
from tests.collectors.fakes import FakeGpuSource, reading


def _driver_present() -> bool:
    try:
        load_nvml()
    except ScrapeError:
        return False
    return True


@pytest.mark.skipif(_driver_present(), reason="this machine has an NVIDIA driver")
def test_library_without_a_driver_is_a_one_line_error():
    """nvidia-ml-py is installed but there is no driver: NVMLError becomes one line."""
    with pytest.raises(ScrapeError) as info:
        load_nvml()
    assert str(info.value) == "NVML unavailable: NVML Shared Library Not Found"


def test_missing_library_names_the_package_to_install():
    """Without the Python package the message says which one to install."""
    with pytest.raises(ScrapeError) as info:
        load_nvml("infermeter_no_such_nvml_module")
    assert str(info.value) == (
        "NVML unavailable: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    )


@pytest.mark.skipif(_driver_present(), reason="this machine has an NVIDIA driver")
async def test_collector_marks_nvml_down_and_scrapes_the_rest(config):
    """The NVML target is down with its reason; another node is still read."""
    other = FakeGpuSource("node-b", [[reading(node="node-b")]])
    collector = FleetCollector(config, [NvmlSource("node-a"), other], [])
    batch = await collector.scrape_once()
    state = collector.states[("node-a", "nvml")]
    assert not state.up
    assert state.last_error == "NVML unavailable: NVML Shared Library Not Found"
    assert [s.node for s in batch.gpus] == ["node-b"]


async def test_a_driver_call_that_hangs_holds_one_thread_and_skips_reads(monkeypatch):
    """A board whose NVML call never returns (until released here): the scrape gives up at its
    timeout, and the next reads are refused at once while it hangs (each would have taken one
    more thread of the pool the shipper shares); once it returns, the GPUs are read again."""
    released = threading.Event()
    fake = types.ModuleType("infermeter_fake_nvml")

    class NVMLError(Exception):
        pass

    fake.NVMLError = NVMLError  # type: ignore[attr-defined]
    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]

    def count() -> int:
        released.wait()
        return 0

    fake.nvmlDeviceGetCount = count  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "infermeter_fake_nvml", fake)
    source = NvmlSource("node-a", "infermeter_fake_nvml")
    threads = threading.active_count()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(source.read(), 0.2)
    for _ in range(3):
        with pytest.raises(ScrapeError, match="the last read has not returned"):
            await source.read()
    assert threading.active_count() == threads + 1
    released.set()
    await asyncio.sleep(0.1)
    assert await asyncio.wait_for(source.read(), 5) == []
