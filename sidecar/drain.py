"""Graceful drain on SIGTERM: stop admitting, let streams finish, end the rest, ship, exit.

Kubernetes sends SIGTERM on every scale-down and rollout, then SIGKILL after the pod's
``terminationGracePeriodSeconds``. A server's usual answer to SIGTERM is to stop listening and
cancel whatever still runs after a short grace: streams cut with no SSE error and no usage
record. The sidecar's server hands the signal to ``drain`` instead
(``sidecar.http_server.HttpServer``'s ``on_signal``), which runs the sequence:

1. ``Drain.begin``: new requests get ``503 server_shutting_down`` with ``Retry-After`` and
   ``/readyz`` answers 503, while the server keeps listening (endpoints are removed from the
   Service asynchronously, so requests still arrive for a while).
2. Admitted requests run until they end, for at most ``sidecar.drain_seconds``; requests
   waiting for a fair batch slot are refused as slots come free.
3. ``Drain.cut``: the rest end now; each client gets an SSE error event (a non-streamed one a
   503) and each request its record, status ``interrupted``, with vLLM's counts up to the last
   chunk relayed.

Then the server is told to exit: it stops listening and, with nothing left running, its own
grace cuts nothing. The sidecar's shutdown (``Sidecar.shutdown``) follows: a request still unrecorded
(its handler did not finish within ``_SETTLE_SECONDS`` of the cut) is recorded from the admission
journal, and the spool is sealed and shipped to billing for at most
``sidecar.drain_ship_seconds``; what billing did not take stays on disk for the next start (or
the node's collector). A second signal skips the rest of the drain period (step 3 at once).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["CUT", "Cut", "Drain", "Draining", "drain"]


class Cut(Exception):
    """The drain's cut, as the result a watched future is given (``Drain.watch``; never raised)."""


# The one value of ``Cut`` the futures woken by the cut are given.
CUT = Cut("the drain period ran out")

log = logging.getLogger("infermeter.sidecar")

# How long ended requests may take to write their records before the journal stands in.
_SETTLE_SECONDS = 5.0
_POLL_SECONDS = 0.05


class Drain:
    """Whether the sidecar still admits requests, and the moment running ones must end."""

    def __init__(self) -> None:
        self.draining = False
        self._cut: asyncio.Future[None] | None = None
        # The futures ``until_first`` waits on and those ``watch`` watches: a set, where callbacks on
        # ``cut`` would be a list that every ending request scans (1,000 streams, 1,000 entries).
        self._waiters: set[asyncio.Future[Any]] = set()

    @property
    def cut(self) -> asyncio.Future[None]:
        """Done once running requests must end: one future every request waits on with its own."""
        if self._cut is None:
            self._cut = asyncio.get_running_loop().create_future()
        return self._cut

    def begin(self) -> None:
        """Admit nothing more."""
        self.draining = True

    def cut_now(self) -> None:
        """End every running request now."""
        self.draining = True
        if not self.cut.done():
            self.cut.set_result(None)
        for waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_result(CUT)

    def watch(self, future: asyncio.Future[Any]) -> bool:
        """Give ``future`` the result ``CUT`` when running requests must end; False (and nothing
        watched) when they already must. ``unwatch`` it once it is done or no longer awaited.

        For a future whose result tells how a wait ended (a stream's end, its client leaving):
        one set entry while it is awaited, where ``until_first`` takes a waiter, a callback on
        each future and a coroutine.
        """
        if self._cut is not None and self._cut.done() and not future.done():
            return False
        self._waiters.add(future)
        return True

    def unwatch(self, future: asyncio.Future[Any]) -> None:
        """Stop watching ``future``."""
        self._waiters.discard(future)

    async def until_first(self, *futures: asyncio.Future[Any]) -> None:
        """Return once one of ``futures`` is done or running requests must end (``cut``).

        What ``asyncio.wait(..., FIRST_COMPLETED)`` does for a request's end, its client and the
        cut, for half its cost per request: one waiter future, no sets, no task checks.
        """
        if (self._cut is not None and self._cut.done()) or any(f.done() for f in futures):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        wake = functools.partial(_wake, waiter)
        for future in futures:
            future.add_done_callback(wake)
        self._waiters.add(waiter)
        try:
            await waiter
        finally:
            self._waiters.discard(waiter)
            for future in futures:
                future.remove_done_callback(wake)


def _wake(waiter: asyncio.Future[None], _: object = None) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Requests(Protocol):
    """The admission journal, as the drain reads it: how many requests run."""

    @property
    def running(self) -> int: ...


class _Queue(Protocol):
    """The fair-share queue, as the drain reads it: how many requests wait for a slot."""

    def waiting(self) -> int: ...


class Draining(Protocol):
    """What ``drain`` reads of the sidecar (``sidecar.app.Sidecar``).

    A protocol, not the class: the application imports this module, and this module importing
    the application back would make the two one knot.
    """

    @property
    def drain(self) -> Drain: ...

    @property
    def journal(self) -> _Requests: ...

    @property
    def fair(self) -> _Queue | None: ...


async def drain(sidecar: Draining, drain_seconds: float) -> None:
    """Steps 1 to 3 of the module docstring; then the server may stop and the sidecar shut down."""
    state, journal, fair = sidecar.drain, sidecar.journal, sidecar.fair

    def idle() -> bool:
        # Requests waiting for a batch slot are refused (503) as soon as they get one, which
        # running requests free as they end: the drain waits for those answers too.
        return journal.running == 0 and (fair is None or fair.waiting() == 0)

    state.begin()
    log.warning("draining: %d request(s) running, up to %.0f s", journal.running, drain_seconds)
    await _until(idle, drain_seconds, state.cut)
    if journal.running:
        log.warning("drain period over: ending %d running request(s)", journal.running)
    state.cut_now()
    await _until(idle, _SETTLE_SECONDS, None)


async def _until(
    done: Callable[[], bool], seconds: float, stop: asyncio.Future[None] | None
) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline and not (stop is not None and stop.done()):
        await asyncio.sleep(_POLL_SECONDS)
