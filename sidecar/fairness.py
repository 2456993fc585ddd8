"""Fair sharing of one replica's batch slots between teams.

vLLM serves waiting requests first come, first served, so one team that floods a replica fills
every batch slot and everyone else waits for its requests to finish. The sidecar therefore keeps
the replica's in-flight requests at most ``capacity`` (its ``max_num_seqs``) and holds a few of
those slots (``headroom``) for teams that are below their fair share, so a newcomer's request
goes straight into the running batch. When nothing is free, requests wait here, per team, and
the team with the fewest requests in flight goes next. Work-conserving: a lone team can use
every slot but the headroom, which stays free for the first request of anyone else.

A slot is one sequence, as ``max_num_seqs`` counts them, not one request: a request of ``n``
choices, or a batch of prompts, is as many sequences in vLLM's batch, and takes as many slots
here (``acquire``'s ``weight``). Counted as one, two requests of ``n=64`` filled a replica of
128 and the next team's first request waited behind them in vLLM's queue. A request of more
sequences than a lone team may hold counts as that many, so it can still run. A request of
several sequences is not passed over for smaller ones: when the waiting team that goes next
needs more slots than are free, the slots freed next are kept for it (only a team below its fair
share may still start meanwhile, as the headroom promises), where before a stream of single
requests of a team above its share took each freed slot and the large request waited out its
timeout.

The wait is bounded twice: a team may have at most ``max_waiting_per_team`` requests queued
(one more is refused at once with ``QueueFull``, so a flood costs its sender, not the others),
and no request waits longer than ``wait_timeout_seconds`` (``WaitTimeout``).

``priorities`` (``teams[].priority``, lower is served first) orders the teams waiting for a freed
slot before their in-flight counts do: a waiting request of a priority-0 team goes ahead of every
waiting request of a priority-1 team. It orders waiting only; a team already running keeps its
slots, and the headroom still keeps the first request of any team from waiting behind a flood.
Between teams equal on both, the one whose requests have waited longest without a break goes
first.

Every admission and every freed slot runs on the event loop that relays every stream, so their
cost must not grow with the number of teams: the teams sharing the replica are counted as they
come and go (not found by a pass over every team ever seen), and a freed slot looks once at
each team with a request waiting. With two requests of each of 500 teams waiting, a freed slot
costs about 150 µs, where a pass over every team for each waiting team took about 11 ms of the
loop (``python -m bench.fair_share``, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["FairShare", "QueueFull", "Slot", "WaitTimeout"]


class QueueFull(Exception):
    """The team already has as many requests waiting as it may."""


class WaitTimeout(Exception):
    """No batch slot came free within the wait timeout."""


@dataclass(eq=False, slots=True)
class Slot:
    """One admitted request's hold on a batch slot; release it exactly once."""

    team: str
    owner: FairShare | None = None
    # The sequences it holds.
    weight: int = 1

    def release(self) -> None:
        """Give the slot back and let the next waiting request in."""
        if self.owner is not None:
            owner, self.owner = self.owner, None
            owner._release(self.team, self.weight)


@dataclass
class FairShare:
    """Admission to one replica: at most ``capacity`` in flight, shared fairly by team."""

    capacity: int
    headroom_share: float = 0.125
    max_waiting_per_team: int | None = None
    wait_timeout_seconds: float | None = None
    in_flight: dict[str, int] = field(default_factory=dict)
    priorities: dict[str, int] = field(default_factory=dict)
    # In flight per team on the other replicas of the group (``sidecar.shared_fairness``).
    remote_in_flight: dict[str, int] = field(default_factory=dict)
    # The queues of the teams with a request waiting (its grant and its weight), none empty, in
    # the order they began to wait (a queue that empties leaves, and joins at the end when it
    # fills again).
    _waiting: dict[str, deque[tuple[asyncio.Future[None], int]]] = field(default_factory=dict)
    # The teams with a request in flight here or waiting: those sharing the replica now.
    _active: set[str] = field(default_factory=set)
    _total: int = 0
    # The waiting request that goes next needs more slots than are free: freed slots are kept
    # for it, and only a team below its fair share starts before it.
    _held: bool = False

    @property
    def headroom(self) -> int:
        """Slots that only teams below their fair share may take."""
        return min(self.capacity - 1, math.ceil(self.capacity * self.headroom_share))

    def _may_start(self, team: str, weight: int) -> bool:
        if self._total + weight > self.capacity:
            return False
        if self._below_share(team):
            return True
        return self._total + weight <= self.capacity - self.headroom

    def _below_share(self, team: str) -> bool:
        # A team alone always has capacity / 1 as its share, so it may take the headroom only
        # when another team shares the replica; the newcomer itself counts as active.
        active = len(self._active) + (team not in self._active)
        return active > 1 and self.in_flight.get(team, 0) < self.capacity / active

    async def acquire(self, team: str, weight: int = 1) -> Slot:
        """Wait for ``weight`` slots (the request's sequences) for ``team``; FIFO within a team,
        then by priority and fewest in flight."""
        weight = max(1, min(weight, self.capacity - self.headroom))
        if (
            team not in self._waiting
            and self._may_start(team, weight)
            and (not self._held or self._below_share(team))
        ):
            self._start(team, weight)
            return Slot(team, self, weight)
        queue = self._waiting.get(team)
        waiting = 0 if queue is None else len(queue)
        if self.max_waiting_per_team is not None and waiting >= self.max_waiting_per_team:
            raise QueueFull(team)
        if queue is None:
            queue = self._waiting[team] = deque()
            self._active.add(team)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (future, weight)
        queue.append(entry)
        try:
            async with asyncio.timeout(self.wait_timeout_seconds):
                await future
        except TimeoutError:
            if future.done() and not future.cancelled():
                self._release(team, weight)  # granted in the same instant the wait ran out
            else:
                self._unqueue(team, entry)
            raise WaitTimeout(team) from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release(team, weight)  # granted just as the caller gave up
            else:
                self._unqueue(team, entry)
            raise
        return Slot(team, self, weight)

    def _unqueue(self, team: str, entry: tuple[asyncio.Future[None], int]) -> None:
        """Take a wait given up out of its team's queue (``_dispatch`` may have popped it)."""
        queue = self._waiting.get(team)
        if queue is None or entry not in queue:
            return
        queue.remove(entry)
        if not queue:
            del self._waiting[team]
            self._left(team)
        if self._held:
            # (It may have been the request the free slots were kept for.)
            self._dispatch()

    def _left(self, team: str) -> None:
        """``team`` has one request fewer here: no longer sharing once it has none."""
        if not self.in_flight.get(team) and team not in self._waiting:
            self._active.discard(team)

    def _rank(self, team: str) -> tuple[int, int]:
        """Lower priority value first, then fewest in flight across the replica group."""
        group = self.in_flight.get(team, 0) + self.remote_in_flight.get(team, 0)
        return self.priorities.get(team, 0), group

    def _start(self, team: str, weight: int) -> None:
        self.in_flight[team] = self.in_flight.get(team, 0) + weight
        self._total += weight
        self._active.add(team)

    def _release(self, team: str, weight: int) -> None:
        self.in_flight[team] -= weight
        self._total -= weight
        self._left(team)
        self._dispatch()

    def _dispatch(self) -> None:
        """Give freed slots to waiting requests: one pass over the teams waiting per slot.

        The team that goes next is the best ranked of those the share rules let take a slot;
        when its request needs more slots than are free, none is given: they are kept for it.
        """
        self._held = False
        while self._waiting and self._total < self.capacity:
            best: str | None = None
            best_rank = (0, 0)
            for team in self._waiting:
                if self._may_start(team, 1):
                    rank = self._rank(team)
                    if best is None or rank < best_rank:
                        best, best_rank = team, rank
            if best is None:
                return
            queue = self._waiting[best]
            future, weight = queue[0]
            if not future.done() and not self._may_start(best, weight):
                self._held = True
                return
            queue.popleft()
            if not queue:
                del self._waiting[best]
            if future.done():
                self._left(best)
                continue
            self._start(best, weight)
            future.set_result(None)

    def waiting(self, team: str | None = None) -> int:
        """Requests queued here (for one team, or all)."""
        if team is not None:
            return len(self._waiting.get(team, ()))
        return sum(len(q) for q in self._waiting.values())
