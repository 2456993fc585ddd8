"""Group commit: batches that arrive while a transaction runs share the next one.

A DuckDB transaction has a cost that barely grows with its size up to a point and then drops
per row: an append of at least one row group (122,880 rows) is compressed straight into the
file instead of being logged first (``python -m bench.billing_scale --breakdown``). Shippers
send batches of a few thousand records, from many sidecars at once. So callers do not each run
their own transaction: each hands its batch to a queue and takes the writer lock; whoever gets
the lock first commits everything queued, and the others find their batch already done when
the lock comes to them. Under light load a batch is committed alone and at once; under heavy
load transactions grow by themselves, with no timer and no extra thread.

Every caller still returns only after the transaction holding its batch has committed, and
gets its own result or its own exception.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["GroupCommit", "Ticket"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class _Slot(Generic[T, R]):
    item: T
    size: int
    done: bool = False
    result: R | None = None
    error: BaseException | None = field(default=None)


class Ticket(Generic[T, R]):
    """An announced batch: submit it once through here (``GroupCommit.announce``)."""

    def __init__(self, group: GroupCommit[T, R]) -> None:
        self._group = group
        self.pending = True

    def submit(self, item: T, size: int = 1) -> R:
        """Hand in the announced batch; returns once the transaction holding it has committed."""
        announced, self.pending = self.pending, False
        return self._group._submit(item, size, announced)


class GroupCommit(Generic[T, R]):
    """Runs queued items in groups under ``lock`` with ``run``, which answers item for item.

    ``run(items)`` returns one result or exception per item, in order; an exception raised by
    ``run`` itself is every item's. A group holds at most ``max_size`` (by ``size``) unless its
    first item alone is larger; the rest wait for the next group.

    Callers that will submit soon (still parsing their batch) say so with ``announce()``. A
    caller about to run a group smaller than ``target_size`` waits up to ``max_wait`` seconds
    for the announced ones to arrive; when nobody is announced it does not wait at all.
    """

    def __init__(
        self,
        run: Callable[[Sequence[T]], Sequence[R | BaseException]],
        lock: threading.Lock,
        max_size: int,
        target_size: int = 0,
        max_wait: float = 0.0,
    ) -> None:
        self._run = run
        self._lock = lock
        self._max_size = max_size
        self._target_size = target_size
        self._max_wait = max_wait
        self._queue: list[_Slot[T, R]] = []
        self._queued_size = 0
        self._coming = 0
        self._leading = False  # someone is gathering or committing a group
        mutex = threading.Lock()
        self._arrived = threading.Condition(mutex)  # the leader waits here for more batches
        self._finished = threading.Condition(mutex)  # the others wait here for their group

    @property
    def waiting(self) -> int:
        """Items queued for the next transaction."""
        with self._arrived:
            return len(self._queue)

    @contextmanager
    def announce(self) -> Iterator[Ticket[T, R]]:
        """Say a batch is on its way (still arriving or being parsed); yields its ticket.

        Leaving the block without submitting through the ticket (the request failed, the batch
        did not parse) withdraws the announcement.
        """
        ticket: Ticket[T, R] = Ticket(self)
        with self._arrived:
            self._coming += 1
        try:
            yield ticket
        finally:
            if ticket.pending:
                ticket.pending = False
                with self._arrived:
                    self._coming -= 1
                    self._arrived.notify()

    def submit(self, item: T, size: int = 1) -> R:
        """Return ``item``'s result once the transaction holding it has committed."""
        return self._submit(item, size, announced=False)

    def _submit(self, item: T, size: int, announced: bool) -> R:
        slot: _Slot[T, R] = _Slot(item, size)
        with self._arrived:
            self._queue.append(slot)
            self._queued_size += size
            if announced:
                self._coming -= 1
            self._arrived.notify()
        while True:
            with self._finished:
                while self._leading and not slot.done:
                    self._finished.wait()
                if slot.done:
                    break
                self._leading = True
            try:
                with self._lock:
                    self._gather()
                    self._commit(self._take())
            finally:
                with self._finished:
                    self._leading = False
                    self._finished.notify_all()
        if slot.error is not None:
            raise slot.error
        assert slot.result is not None
        return slot.result

    def _gather(self) -> None:
        """Wait (bounded) for announced batches while the group is still small."""
        deadline = time.monotonic() + self._max_wait
        with self._arrived:
            while self._coming and self._queued_size < self._target_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._arrived.wait(remaining)

    def _take(self) -> list[_Slot[T, R]]:
        with self._arrived:
            taken, total = 0, 0
            for slot in self._queue:
                if taken and total + slot.size > self._max_size:
                    break
                taken, total = taken + 1, total + slot.size
            group, self._queue = self._queue[:taken], self._queue[taken:]
            self._queued_size -= total
        return group

    def _commit(self, group: list[_Slot[T, R]]) -> None:
        try:
            outcomes = self._run([s.item for s in group])
            assert len(outcomes) == len(group), "run must answer every item"
        except BaseException as exc:  # every caller in the group hears of it
            outcomes = [exc] * len(group)
        for slot, outcome in zip(group, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                slot.error = outcome
            else:
                slot.result = outcome
            slot.done = True
