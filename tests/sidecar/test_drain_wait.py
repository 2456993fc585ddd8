"""Drain.until_first and until_done: a request's wait for its end, its client leaving or the cut."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sidecar.drain import CUT, Drain


async def test_it_returns_when_one_future_is_done_and_leaves_no_waiter_behind() -> None:
    drain = Drain()
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    lost: asyncio.Future[None] = loop.create_future()
    waiting = loop.create_task(drain.until_first(ended, lost))
    await asyncio.sleep(0)
    assert not waiting.done()
    lost.set_result(None)
    await asyncio.wait_for(waiting, 1)
    assert not ended.done()
    # The drain keeps no waiter of an ended wait.
    ended.set_result(None)
    assert drain._waiters == set()


async def test_the_cut_ends_every_wait() -> None:
    drain = Drain()
    loop = asyncio.get_running_loop()
    pending = [loop.create_future() for _ in range(3)]
    waits = [loop.create_task(drain.until_first(f)) for f in pending]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waits)
    drain.cut_now()
    await asyncio.wait_for(asyncio.gather(*waits), 1)
    assert not any(f.done() for f in pending)
    assert drain.cut.done()
    # After the cut, a new wait returns at once.
    await asyncio.wait_for(drain.until_first(loop.create_future()), 1)


async def test_a_future_already_done_returns_at_once() -> None:
    drain = Drain()
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    await asyncio.wait_for(drain.until_first(done), 1)


async def test_a_cancelled_wait_unhooks_itself() -> None:
    drain = Drain()
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    waiting = loop.create_task(drain.until_first(ended))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert drain._waiters == set()
    ended.set_result(None)  # no waiter left to wake


async def test_until_done_gives_the_result_and_leaves_nothing_behind() -> None:
    """A stream's end, or its client leaving, is the result of the one future it waits on."""
    drain = Drain()
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[str] = loop.create_future()
    wait = drain.until_done(ended)
    waiting = loop.create_task(wait)
    await asyncio.sleep(0)
    assert not waiting.done()
    ended.set_result("left")
    assert await asyncio.wait_for(waiting, 1) == "left"
    assert drain._waiters == set()


async def test_the_cut_is_the_result_of_every_until_done_wait_and_of_later_ones() -> None:
    drain = Drain()
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in range(3)]
    coros = [drain.until_done(f) for f in futures]
    waits = [loop.create_task(c) for c in coros]
    await asyncio.sleep(0)
    drain.cut_now()
    assert await asyncio.wait_for(asyncio.gather(*waits), 1) == [CUT, CUT, CUT]
    # The future itself holds the cut, so whoever else reads it sees how the wait ended.
    assert [f.result() for f in futures] == [CUT, CUT, CUT]
    assert await drain.until_done(loop.create_future()) is CUT
    done: asyncio.Future[int] = loop.create_future()
    done.set_result(7)
    assert await drain.until_done(done) == 7  # what ended before the cut is not overwritten


async def test_cancelling_an_until_done_wait_cancels_its_future() -> None:
    """The relay closes the replica's connection when it sees its future cancelled."""
    drain = Drain()
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    wait = drain.until_done(ended)
    waiting = asyncio.get_running_loop().create_task(wait)
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert ended.cancelled()
    assert drain._waiters == set()
