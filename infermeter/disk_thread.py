"""One long-lived thread for a writer's blocking disk calls (write, fsync), off the event loop.

``asyncio.to_thread`` goes through the loop's default executor: a concurrent future wrapped in an
asyncio one, a context copy and a work queue with its semaphore, per call. Measured on two cores
with uvloop, a round trip through it costs about 120 µs of CPU for a call that does nothing,
where a queue this thread reads and ``call_soon_threadsafe`` to answer cost about 56 µs
(``python -m bench.disk_thread``). A spool makes one such call per group commit, so the saving
is paid back on every batch of usage records.

Calls run one at a time, in the order they were made; an exception is raised in the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["DiskThread"]

_T = TypeVar("_T")
_Job = tuple[Callable[[], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class DiskThread:
    """A daemon thread running blocking calls for coroutines: started on first use, ended after
    ``idle_seconds`` without a call (or by ``stop``), started again by the next call."""

    def __init__(self, name: str, idle_seconds: float = 30.0) -> None:
        self.name = name
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        # The running thread's queue; None while no thread runs.
        self._jobs: queue.SimpleQueue[_Job | None] | None = None

    @property
    def running(self) -> bool:
        """True while a thread is serving this writer."""
        return self._jobs is not None

    async def run(self, call: Callable[[], _T]) -> _T:
        """Run ``call()`` in the thread and return its result (or raise its exception)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve, args=(self._jobs,), name=self.name, daemon=True
                ).start()
            self._jobs.put((call, future, loop))
        return await future

    def stop(self) -> None:
        """Let the thread finish the calls already made, then end (it is not waited for)."""
        with self._lock:
            if self._jobs is not None:
                self._jobs.put(None)
                self._jobs = None

    def _serve(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        while True:
            try:
                job = jobs.get(timeout=self.idle_seconds)
            except queue.Empty:
                with self._lock:
                    # A call queued meanwhile is served; else this thread is done.
                    if not jobs.empty():
                        continue
                    if self._jobs is jobs:
                        self._jobs = None
                    return
            if job is None:
                return
            call, future, loop = job
            try:
                result, error = call(), None
            except BaseException as exc:  # handed to the caller, whatever it is
                result, error = None, exc
            # A loop closed meanwhile has no one left to tell.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, result, error)
