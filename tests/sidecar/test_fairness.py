"""FairShare shares one replica's batch slots between teams and keeps headroom for newcomers."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import pytest

from sidecar.fairness import FairShare, QueueFull, Slot, WaitTimeout

Spawn = Callable[[FairShare, str], asyncio.Task[Slot]]


async def idle() -> None:
    """Let every runnable task take its next step."""
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
async def spawn() -> AsyncIterator[Spawn]:
    """Start ``fair.acquire(team)`` as a task; tasks still waiting are cancelled at the end."""
    tasks: list[asyncio.Task[Slot]] = []

    def start(fair: FairShare, team: str) -> asyncio.Task[Slot]:
        task = asyncio.create_task(fair.acquire(team))
        tasks.append(task)
        return task

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def requests(spawn: Spawn, fair: FairShare, team: str, n: int) -> list[asyncio.Task[Slot]]:
    """``n`` requests of ``team``, started in order and given a chance to be admitted."""
    tasks = []
    for _ in range(n):
        tasks.append(spawn(fair, team))
        await idle()
    return tasks


def granted(tasks: list[asyncio.Task[Slot]]) -> int:
    """How many of ``tasks`` hold a slot."""
    return sum(t.done() and not t.cancelled() for t in tasks)


@pytest.mark.parametrize(
    ("capacity", "teams"),
    [(1, ["a", "b"]), (4, ["a", "b", "c"]), (8, ["a", "b"]), (16, ["a", "b", "c", "d", "e"])],
)
async def test_capacity_is_never_exceeded(spawn, capacity, teams):
    """However many teams ask, at most ``capacity`` requests are in flight and the rest wait."""
    fair = FairShare(capacity)
    for team in teams:
        await requests(spawn, fair, team, capacity)
    assert sum(fair.in_flight.values()) == capacity
    assert fair.waiting() == capacity * len(teams) - capacity


@pytest.mark.parametrize(
    ("capacity", "headroom_share", "usable"),
    [(8, 0.125, 7), (4, 0.25, 3), (16, 0.125, 14), (8, 0.3, 5), (8, 0.0, 8), (1, 0.125, 1)],
)
async def test_lone_team_uses_every_slot_but_the_headroom(spawn, capacity, headroom_share, usable):
    """A team alone gets ``capacity - headroom`` slots at once and waits for more."""
    fair = FairShare(capacity, headroom_share)
    tasks = await requests(spawn, fair, "a", capacity + 2)
    assert (granted(tasks), fair.waiting("a")) == (usable, capacity + 2 - usable)


async def test_newcomer_gets_a_headroom_slot_while_another_team_has_a_backlog(spawn):
    """A team below its fair share starts at once in the headroom, ahead of the other's queue."""
    fair = FairShare(8)
    await requests(spawn, fair, "a", 10)
    (newcomer,) = await requests(spawn, fair, "b", 1)
    assert newcomer.done()
    assert (fair.in_flight, fair.waiting("a")) == ({"a": 7, "b": 1}, 3)


async def test_team_at_its_fair_share_cannot_take_the_headroom(spawn):
    """Once two teams share the replica, one at or above its share waits instead of filling up."""
    fair = FairShare(8)
    await requests(spawn, fair, "a", 6)
    await requests(spawn, fair, "b", 1)
    (extra,) = await requests(spawn, fair, "a", 1)
    assert not extra.done()


async def test_freed_slot_goes_to_the_waiting_team_with_fewest_in_flight(spawn):
    """When a slot frees, the team with fewer requests in flight goes next, whoever queued first."""
    fair = FairShare(4, headroom_share=0.0)
    await requests(spawn, fair, "a", 2)
    (other,) = await requests(spawn, fair, "c", 1)
    await requests(spawn, fair, "b", 1)
    (a_waiting,) = await requests(spawn, fair, "a", 1)
    (b_waiting,) = await requests(spawn, fair, "b", 1)
    other.result().release()
    await idle()
    assert (b_waiting.done(), a_waiting.done()) == (True, False)


async def test_requests_of_one_team_are_served_in_order(spawn):
    """Within a team, waiting requests get slots first come, first served."""
    fair = FairShare(1)
    holder, *queued = await requests(spawn, fair, "a", 4)
    order: list[int] = []
    slot = holder.result()
    for _ in queued:
        slot.release()
        await idle()
        (turn,) = [i for i, task in enumerate(queued) if task.done() and i not in order]
        order.append(turn)
        slot = queued[turn].result()
    assert order == [0, 1, 2]


async def _cancel_while_waiting(waiter: asyncio.Task[Slot], holder: Slot) -> None:
    waiter.cancel()
    await idle()
    holder.release()


async def _cancel_as_slot_frees(waiter: asyncio.Task[Slot], holder: Slot) -> None:
    waiter.cancel()
    holder.release()  # the freed slot meets the cancelled waiter before it has run


async def _cancel_just_after_grant(waiter: asyncio.Task[Slot], holder: Slot) -> None:
    holder.release()  # grants the waiter's slot ...
    waiter.cancel()  # ... but the waiter gives up before it runs


@pytest.mark.parametrize(
    "cancel", [_cancel_while_waiting, _cancel_as_slot_frees, _cancel_just_after_grant]
)
async def test_cancelled_waiter_leaves_nothing_behind(spawn, cancel):
    """However a waiting request's cancellation meets a freed slot, no slot or queue entry leaks."""
    fair = FairShare(1)
    (holder,) = await requests(spawn, fair, "a", 1)
    (waiter,) = await requests(spawn, fair, "b", 1)
    await cancel(waiter, holder.result())
    await asyncio.gather(waiter, return_exceptions=True)
    assert waiter.cancelled()
    assert (sum(fair.in_flight.values()), fair.waiting()) == (0, 0)


async def test_slot_freed_by_a_cancelled_grant_goes_to_the_next_waiter(spawn):
    """A slot granted to a request that gave up passes straight on to the next one waiting."""
    fair = FairShare(1)
    (holder,) = await requests(spawn, fair, "a", 1)
    quitter, patient = await requests(spawn, fair, "b", 2)
    holder.result().release()
    quitter.cancel()
    await asyncio.gather(quitter, return_exceptions=True)
    await idle()
    assert patient.done()
    assert fair.in_flight == {"a": 0, "b": 1}


async def test_releasing_a_slot_twice_is_harmless(spawn):
    """A second release of the same slot frees nothing more."""
    fair = FairShare(2)
    first, _ = await requests(spawn, fair, "a", 2)
    first.result().release()
    first.result().release()
    assert fair.in_flight == {"a": 1}


async def test_second_release_does_not_take_the_next_waiters_slot(spawn):
    """Releasing twice after the slot passed to a waiter leaves that waiter holding it."""
    fair = FairShare(1)
    (holder,) = await requests(spawn, fair, "a", 1)
    (waiter,) = await requests(spawn, fair, "b", 1)
    holder.result().release()
    holder.result().release()
    await idle()
    assert waiter.done()
    assert fair.in_flight == {"a": 0, "b": 1}


async def test_a_team_past_its_queue_bound_is_refused_at_once(spawn):
    """With max_waiting_per_team queued, one more request of that team raises QueueFull; others still queue."""
    fair = FairShare(capacity=1, headroom_share=0, max_waiting_per_team=1)
    await requests(spawn, fair, "a", 2)
    with pytest.raises(QueueFull):
        await fair.acquire("a")
    other = spawn(fair, "b")
    await idle()
    assert (fair.waiting("a"), fair.waiting("b"), other.done()) == (1, 1, False)


async def test_a_wait_past_the_timeout_leaves_the_queue(spawn):
    """A request not granted within wait_timeout_seconds raises WaitTimeout and no longer waits."""
    fair = FairShare(capacity=1, headroom_share=0, wait_timeout_seconds=0.05)
    await requests(spawn, fair, "a", 1)
    with pytest.raises(WaitTimeout):
        await fair.acquire("b")
    assert fair.waiting() == 0
    assert fair.in_flight == {"a": 1}


async def test_a_freed_slot_goes_to_the_waiting_team_of_lower_priority_value(spawn):
    """Priority 0 is served before priority 1 even when it has more requests in flight."""
    fair = FairShare(2, headroom_share=0.0, priorities={"urgent": 0, "batch": 1})
    running = await requests(spawn, fair, "urgent", 2)
    batch = await requests(spawn, fair, "batch", 1)
    urgent = await requests(spawn, fair, "urgent", 1)
    assert granted(batch) == granted(urgent) == 0
    running[0].result().release()
    await idle()
    assert granted(urgent) == 1
    assert granted(batch) == 0


async def test_without_priorities_the_team_with_fewer_in_flight_goes_next(spawn):
    """Equal priorities fall back to fewest in flight."""
    fair = FairShare(2, headroom_share=0.0)
    running = await requests(spawn, fair, "a", 2)
    a_more = await requests(spawn, fair, "a", 1)
    b = await requests(spawn, fair, "b", 1)
    running[0].result().release()
    await idle()
    assert granted(b) == 1
    assert granted(a_more) == 0


async def test_a_freed_slot_goes_to_the_team_with_fewer_in_flight_across_the_group(spawn):
    """Counts from the other replicas of the group decide who goes next among equals."""
    fair = FairShare(2, headroom_share=0.0, remote_in_flight={"a": 5})
    running = await requests(spawn, fair, "b", 2)
    a = await requests(spawn, fair, "a", 1)
    b_more = await requests(spawn, fair, "b", 1)
    running[0].result().release()
    await idle()
    assert granted(b_more) == 1
    assert granted(a) == 0


async def test_between_equal_teams_the_one_waiting_longest_goes_first(spawn):
    """Equal priority and in-flight counts: the freed slot goes to the team that began waiting
    first in this wait, not to one that happened to wait first long before."""
    fair = FairShare(2, headroom_share=0.0)
    c1, c2 = await requests(spawn, fair, "c", 2)
    (b_early,) = await requests(spawn, fair, "b", 1)  # b waits first of all...
    c1.result().release()
    await idle()
    b_early.result().release()  # ...is served, and leaves
    await idle()
    await requests(spawn, fair, "c", 1)
    (a,) = await requests(spawn, fair, "a", 1)  # now a waits first
    (b,) = await requests(spawn, fair, "b", 1)
    c2.result().release()
    await idle()
    assert (a.done(), b.done()) == (True, False)


class Reference:
    """The rules of ``FairShare`` written as plainly as they read, with no bookkeeping: each
    decision counts the teams sharing the replica and looks at every waiting team afresh."""

    def __init__(self, fair: FairShare) -> None:
        self.fair = fair  # (capacity, headroom, bounds, priorities and remote counts read live)
        self.in_flight: dict[str, int] = {}
        # Waiting request ids per team, in the order the teams began to wait; none empty.
        self.queues: dict[str, list[int]] = {}
        self.granted: set[int] = set()

    @property
    def total(self) -> int:
        return sum(self.in_flight.values())

    def may_start(self, team: str) -> bool:
        capacity = self.fair.capacity
        if self.total >= capacity:
            return False
        active = {t for t, n in self.in_flight.items() if n > 0} | set(self.queues) | {team}
        if len(active) > 1 and self.in_flight.get(team, 0) < capacity / len(active):
            return True
        return self.total < capacity - self.fair.headroom

    def rank(self, team: str) -> tuple[int, int]:
        group = self.in_flight.get(team, 0) + self.fair.remote_in_flight.get(team, 0)
        return self.fair.priorities.get(team, 0), group

    def acquire(self, team: str, rid: int) -> bool:
        """False: refused (the team's queue is full)."""
        if team not in self.queues and self.may_start(team):
            self.in_flight[team] = self.in_flight.get(team, 0) + 1
            self.granted.add(rid)
            return True
        bound = self.fair.max_waiting_per_team
        if bound is not None and len(self.queues.get(team, ())) >= bound:
            return False
        self.queues.setdefault(team, []).append(rid)
        return True

    def release(self, team: str) -> None:
        self.in_flight[team] -= 1
        while True:
            candidates = [t for t in self.queues if self.may_start(t)]
            if not candidates:
                return
            best = min(candidates, key=self.rank)  # (the first of equals: waiting longest)
            rid = self.queues[best].pop(0)
            if not self.queues[best]:
                del self.queues[best]
            self.in_flight[best] = self.in_flight.get(best, 0) + 1
            self.granted.add(rid)

    def cancel(self, team: str, rid: int) -> None:
        self.queues[team].remove(rid)
        if not self.queues[team]:
            del self.queues[team]


@pytest.mark.parametrize("seed", range(12))
async def test_every_decision_matches_the_rules_written_plainly(spawn, seed):
    """Random arrivals, releases, cancellations and changes of the group's counts: the same
    requests hold slots, and the same wait, as under the plain rules (``Reference``) after
    every step, with several teams queued at once."""
    rng = random.Random(seed)
    teams = [f"t{i}" for i in range(rng.randint(3, 9))]
    fair = FairShare(
        rng.randint(2, 10),
        headroom_share=rng.choice([0.0, 0.125, 0.3]),
        max_waiting_per_team=rng.choice([None, 2, 4]),
        priorities={t: rng.randint(0, 1) for t in teams},
    )
    ref = Reference(fair)
    tasks: dict[int, tuple[str, asyncio.Task[Slot]]] = {}
    released: set[int] = set()
    for rid in range(400):
        roll = rng.random()
        holding = [r for r in ref.granted if r not in released]
        waiting = [r for q in ref.queues.values() for r in q]
        if roll < 0.5 or not (holding or waiting):
            team = rng.choice(teams)
            task = spawn(fair, team)
            await idle()
            if ref.acquire(team, rid):
                tasks[rid] = (team, task)
            else:
                with pytest.raises(QueueFull):
                    task.result()
        elif roll < 0.85 and holding:
            r = rng.choice(holding)
            team, task = tasks[r]
            released.add(r)
            task.result().release()
            ref.release(team)
            await idle()
        elif roll < 0.95 and waiting:
            r = rng.choice(waiting)
            team, task = tasks[r]
            task.cancel()
            ref.cancel(team, r)
            await idle()
        else:
            fair.remote_in_flight = {t: rng.randint(0, 3) for t in teams}
        held = {r for r, (_, t) in tasks.items() if t.done() and not t.cancelled()}
        assert held == ref.granted, f"step {rid}"
        assert {t: n for t, n in fair.in_flight.items() if n} == {
            t: n for t, n in ref.in_flight.items() if n
        }
        assert {t: fair.waiting(t) for t in teams} == {t: len(ref.queues.get(t, ())) for t in teams}


async def test_a_request_of_several_sequences_takes_as_many_slots():
    """``weight`` slots per request (its sequences): on 16 slots (2 of headroom), a lone team's
    second request of 8 waits, another team's request of 1 starts, and one of more than a lone
    team may hold counts as that many, so it can still run alone."""
    fair = FairShare(16)
    first = await fair.acquire("a", 8)
    second = asyncio.ensure_future(fair.acquire("a", 8))
    await idle()
    assert (fair.in_flight["a"], fair.waiting("a"), second.done()) == (8, 1, False)
    other = await fair.acquire("b", 1)
    assert fair.in_flight == {"a": 8, "b": 1}
    first.release()
    await idle()
    assert second.done()
    assert fair.in_flight["a"] == 8
    second.result().release()
    other.release()
    huge = await asyncio.wait_for(fair.acquire("c", 1000), 1)
    assert (huge.weight, fair.in_flight["c"]) == (14, 14)
    huge.release()
    assert sum(fair.in_flight.values()) == 0


async def test_a_request_of_several_sequences_is_not_passed_over_by_single_ones():
    """On 16 slots (2 of headroom) a team holds 14 single requests and sends a new one as each
    ends; another team's request of 8 waits for 8 free slots. The slots freed are kept for it,
    so it starts once 8 are free, where a team above its share taking each freed slot at once
    would keep it waiting until its timeout. Meanwhile the first team's new requests wait."""
    fair = FairShare(16)
    held = [await fair.acquire("b") for _ in range(14)]
    large = asyncio.ensure_future(fair.acquire("a", 8))
    await idle()
    assert not large.done()
    refills: list[asyncio.Future[Slot]] = []
    for _ in range(10):
        held.pop(0).release()
        refills.append(asyncio.ensure_future(fair.acquire("b")))
        await idle()
        if large.done():
            break
    assert large.done(), "the request of 8 was passed over by every freed slot"
    assert fair.in_flight == {"a": 8, "b": 8}
    assert not any(r.done() for r in refills)
    large.result().release()
    await idle()
    assert sum(r.done() for r in refills) == len(refills)
    for slot in [*held, *(r.result() for r in refills)]:
        slot.release()
    assert sum(fair.in_flight.values()) == 0


async def test_a_team_below_its_share_still_starts_while_slots_are_kept_for_a_large_request():
    """The headroom's promise holds while freed slots are kept for a request of several
    sequences: a third team's first request goes straight in."""
    fair = FairShare(16)
    held = [await fair.acquire("b") for _ in range(14)]
    large = asyncio.ensure_future(fair.acquire("a", 8))
    await idle()
    held.pop().release()
    await idle()
    assert not large.done()
    newcomer = await asyncio.wait_for(fair.acquire("c"), 1)
    assert fair.in_flight == {"b": 13, "c": 1}
    newcomer.release()
    large.cancel()
    await asyncio.gather(large, return_exceptions=True)
    for slot in held:
        slot.release()
    assert sum(fair.in_flight.values()) == 0
