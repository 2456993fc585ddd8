"""Group commit: callers queued behind a transaction share the next one, each with its own answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from billing.group_commit import GroupCommit


class Recorder:
    """A ``run`` that records its groups; an item "bad" fails alone, "boom" fails its group."""

    def __init__(self) -> None:
        self.groups: list[list[str]] = []

    def __call__(self, items: Sequence[str]) -> list[str | BaseException]:
        if "boom" in items:
            raise RuntimeError("transaction failed")
        self.groups.append(list(items))
        return [ValueError(f"{i} refused") if i == "bad" else f"{i} kept" for i in items]


def _submit_while_locked(
    group: GroupCommit[str, str], lock: threading.Lock, items: list[tuple[str, int]]
) -> dict[str, str | BaseException]:
    """Submit ``items`` from threads while ``lock`` is held, release it, and collect answers."""
    answers: dict[str, str | BaseException] = {}

    def call(item: str, size: int) -> None:
        try:
            answers[item] = group.submit(item, size)
        except BaseException as exc:
            answers[item] = exc

    threads = [threading.Thread(target=call, args=item) for item in items]
    with lock:
        for t in threads:
            t.start()
            deadline = time.monotonic() + 10  # queue them in order
            while group.waiting < threads.index(t) + 1 and time.monotonic() < deadline:
                time.sleep(0.001)
    for t in threads:
        t.join(10)
    return answers


def test_callers_waiting_for_the_lock_share_one_group():
    """Three callers queued behind the lock: one run, three answers, in queue order."""
    run, lock = Recorder(), threading.Lock()
    group = GroupCommit(run, lock, max_size=100)
    answers = _submit_while_locked(group, lock, [("a", 1), ("b", 1), ("c", 1)])
    assert run.groups == [["a", "b", "c"]]
    assert answers == {"a": "a kept", "b": "b kept", "c": "c kept"}


def test_an_item_refused_by_run_fails_only_its_caller():
    """run's per-item exception reaches that caller alone; the others get their results."""
    run, lock = Recorder(), threading.Lock()
    answers = _submit_while_locked(
        GroupCommit(run, lock, 100), lock, [("a", 1), ("bad", 1), ("c", 1)]
    )
    assert isinstance(answers["bad"], ValueError)
    assert (answers["a"], answers["c"]) == ("a kept", "c kept")


def test_a_failed_transaction_fails_every_caller_in_it():
    """When run itself raises, nobody in the group is told their item was kept."""
    run, lock = Recorder(), threading.Lock()
    answers = _submit_while_locked(GroupCommit(run, lock, 100), lock, [("a", 1), ("boom", 1)])
    assert all(isinstance(a, RuntimeError) for a in answers.values())
    assert run.groups == []


def test_groups_stop_at_max_size_but_never_leave_an_item_out():
    """Sizes 6+5 exceed 10: two groups; a single item larger than the limit still goes alone."""
    run, lock = Recorder(), threading.Lock()
    answers = _submit_while_locked(
        GroupCommit(run, lock, 10), lock, [("a", 6), ("b", 5), ("c", 30)]
    )
    assert run.groups == [["a"], ["b"], ["c"]]
    assert set(answers.values()) == {"a kept", "b kept", "c kept"}


def test_an_uncontended_caller_commits_at_once():
    """No one else waiting: the caller runs its own group and returns its result."""
    run = Recorder()
    assert GroupCommit(run, threading.Lock(), 10).submit("solo") == "solo kept"
    assert run.groups == [["solo"]]


def test_many_concurrent_callers_each_get_exactly_their_answer():
    """Unsynchronised callers: every item is run exactly once and answered to its caller."""
    callers = 8
    run, lock = Recorder(), threading.Lock()
    group = GroupCommit(run, lock, 4)
    answers: dict[str, str] = {}

    def call(i: int) -> None:
        for k in range(50):
            item = f"{i}-{k}"
            answers[item] = group.submit(item)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ran = [item for g in run.groups for item in g]
    assert sorted(ran) == sorted(answers)
    assert len(ran) == callers * 50
    assert all(answers[i] == f"{i} kept" for i in answers)
    assert max(len(g) for g in run.groups) <= 4


def test_a_small_group_waits_for_an_announced_batch():
    """A batch still being parsed (announced) joins the group that was about to start without it."""
    run, lock = Recorder(), threading.Lock()
    group = GroupCommit(run, lock, max_size=100, target_size=10, max_wait=30.0)
    parsed, answers = threading.Event(), {}

    def late() -> None:
        with group.announce() as ticket:
            parsed.wait(10)  # "parsing"
            answers["late"] = ticket.submit("late", 1)

    thread = threading.Thread(target=late)
    thread.start()
    deadline = time.monotonic() + 10
    while not group._coming and time.monotonic() < deadline:  # the announcement is in
        time.sleep(0.001)
    threading.Timer(0.2, parsed.set).start()
    answers["early"] = group.submit("early", 1)
    thread.join(10)
    assert run.groups == [["early", "late"]]
    assert answers == {"early": "early kept", "late": "late kept"}


def test_a_withdrawn_announcement_does_not_hold_the_group():
    """A batch that failed to parse leaves the block without submitting: nobody waits for it."""
    run, lock = Recorder(), threading.Lock()
    group = GroupCommit(run, lock, max_size=100, target_size=10, max_wait=30.0)
    with pytest.raises(ValueError, match="unparseable"), group.announce():
        raise ValueError("unparseable")
    started = time.monotonic()
    assert group.submit("next") == "next kept"
    assert (
        time.monotonic() - started < 10
    )  # far below max_wait: it did not wait for the withdrawn one
