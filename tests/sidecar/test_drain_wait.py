"""Drain.until_first and watch: a request's wait for its end, its client leaving or the cut."""

from __future__ import annotations

import asyncio
from typing import Any

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


async def test_a_watched_future_is_given_the_cut_and_an_ended_one_keeps_its_result() -> None:
    """A stream's own future is how its wait ends: its end, its client leaving, or the cut."""
    drain = Drain()
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in range(3)]
    assert all(drain.watch(f) for f in futures)
    futures[0].set_result("left")  # ended before the cut
    drain.cut_now()
    assert [f.result() for f in futures] == ["left", CUT, CUT]
    for f in futures:
        drain.unwatch(f)
    assert drain._waiters == set()


async def test_after_the_cut_nothing_more_is_watched() -> None:
    """A wait that begins after the cut does not begin: the caller ends the stream at once."""
    drain = Drain()
    loop = asyncio.get_running_loop()
    drain.cut_now()
    pending: asyncio.Future[int] = loop.create_future()
    assert not drain.watch(pending)
    assert not pending.done()
    done: asyncio.Future[int] = loop.create_future()
    done.set_result(7)
    assert drain.watch(done)  # an ended one is awaited at once, for its own result
    drain.unwatch(done)
    assert drain._waiters == set()
