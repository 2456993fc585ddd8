"""DiskThread: blocking calls run off the loop, one at a time, in order; results and errors come back."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest

from infermeter.disk_thread import DiskThread


async def test_calls_run_in_another_thread_one_at_a_time_in_order() -> None:
    disk = DiskThread("test")
    order: list[int] = []
    busy = threading.Lock()

    def call(i: int) -> int:
        assert busy.acquire(blocking=False), "two calls ran at once"
        try:
            time.sleep(0.002)
            order.append(i)
            return threading.get_ident()
        finally:
            busy.release()

    idents = await asyncio.gather(*(disk.run(functools.partial(call, i)) for i in range(20)))
    assert order == list(range(20))
    assert set(idents) != {threading.get_ident()}
    assert len(set(idents)) == 1
    disk.stop()


async def test_an_exception_is_raised_in_the_caller_and_the_thread_goes_on() -> None:
    disk = DiskThread("test")

    def fail() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        await disk.run(fail)
    assert await disk.run(lambda: 7) == 7
    disk.stop()


async def test_an_idle_thread_ends_and_the_next_call_starts_another() -> None:
    disk = DiskThread("test", idle_seconds=0.05)
    first = await disk.run(threading.get_ident)
    assert disk.running
    assert await _ended(disk)
    second = await disk.run(threading.get_ident)
    assert second != threading.get_ident()
    assert disk.running
    disk.stop()
    assert not disk.running
    assert first != threading.get_ident()


async def _ended(disk: DiskThread) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not disk.running:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_calls_made_before_stop_are_served() -> None:
    disk = DiskThread("test")
    done: list[int] = []
    pending = [asyncio.ensure_future(disk.run(functools.partial(done.append, i))) for i in range(5)]
    await asyncio.sleep(0)
    disk.stop()
    await asyncio.gather(*pending)
    assert done == [0, 1, 2, 3, 4]
    assert await disk.run(lambda: "again") == "again"
    disk.stop()
