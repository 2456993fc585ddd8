"""Start, watch and stop the processes of a local fleet (``simulate`` and ``demo``).

Children run in their own sessions so that Ctrl-C reaches only this supervisor, which then
stops them one at a time in reverse start order: traffic first, billing last, so nothing logs a
refused connection on the way down and every record shipped on the way down is taken.

A child that dies on its own (any exit but code 0, which says it finished its work, as the traffic
generator does after ``--duration``) is started again, after a delay that doubles with each exit
that follows too soon after its start (``RestartPolicy``), so a child that cannot start costs
little while the others go on. One that keeps dying is given up and the rest keep running. The decision
is the pure ``after_exit``; ``Supervisor`` owns the processes and says what it does in one line on
stderr per event, never with a traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import httpx

from infermeter.config import process_environment

__all__ = ["Child", "ChildFailedError", "ExitHistory", "RestartPolicy", "Supervisor", "after_exit"]


@dataclass(frozen=True)
class Child:
    """A process to run: its name, its command line and the URL that answers once it is up.

    ``env``: variables added to this child's environment only (the supervisor's own win).
    ``stop_signal``: what asks it to stop. SIGTERM for the servers (uvicorn and the sidecar
    drain on it); SIGINT for a plain ``asyncio.run`` program, which turns it into a cancellation
    of its main task, where SIGTERM would raise ``SystemExit`` inside whichever task was running.
    ``after_ready``: started only once every child before it answers on its ready URL (a
    client of the others, such as the traffic generator, whose first requests would otherwise
    find nothing listening yet).
    """

    name: str
    argv: Sequence[str]
    ready_url: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    stop_signal: signal.Signals = signal.SIGTERM
    after_ready: bool = False


class ChildFailedError(Exception):
    """A child could not start; the message names it and why."""


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited is started again, and when it is given up.

    The first restart waits ``first_delay_seconds``; each exit within ``stable_after_seconds`` of
    the child's start doubles the wait, up to ``max_delay_seconds``; a child that stayed up that
    long starts again from the first delay. ``give_up_exits`` exits within
    ``give_up_window_seconds`` give the child up: with the defaults, one that dies at once is
    given up after about 31 s of waits, one that runs for a minute each time after 6 minutes.
    """

    first_delay_seconds: float = 1.0
    max_delay_seconds: float = 30.0
    stable_after_seconds: float = 60.0
    give_up_exits: int = 6
    give_up_window_seconds: float = 600.0


@dataclass(frozen=True)
class ExitHistory:
    """What the policy remembers of one child: its recent exits and the last delay it gave."""

    exits: tuple[float, ...] = ()
    delay_seconds: float = 0.0


def after_exit(
    policy: RestartPolicy, history: ExitHistory, started_at: float, now: float
) -> tuple[float | None, ExitHistory]:
    """The delay before the exited child starts again (None: give it up), and its new history."""
    window = policy.give_up_window_seconds
    exits = (*(t for t in history.exits if now - t < window), now)
    if len(exits) >= policy.give_up_exits:
        return None, ExitHistory(exits, history.delay_seconds)
    if history.delay_seconds == 0 or now - started_at >= policy.stable_after_seconds:
        delay = policy.first_delay_seconds
    else:
        delay = min(2 * history.delay_seconds, policy.max_delay_seconds)
    return delay, ExitHistory(exits, delay)


@dataclass
class _Slot:
    """One child's place in the fleet: its process now, and when it is due to start again."""

    child: Child
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    history: ExitHistory = ExitHistory()
    restart_at: float | None = None
    given_up: bool = False
    finished: bool = False

    @property
    def ended(self) -> bool:
        """Nothing more will run here: the child finished, or was given up."""
        return self.given_up or self.finished


def _say(line: str) -> None:
    print(f"infermeter: {line}", file=sys.stderr, flush=True)


class Supervisor:
    """Runs children until a signal arrives, restarting each one that dies on its own.

    ``clock`` is the monotonic time the restart policy reads; ``say`` is where the one-line
    reports go (stderr, prefixed ``infermeter:``, like every message of the command).
    """

    def __init__(
        self,
        children: Sequence[Child],
        ready_timeout_seconds: float = 60.0,
        policy: RestartPolicy = RestartPolicy(),
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = _say,
    ) -> None:
        self.children = list(children)
        self.ready_timeout_seconds = ready_timeout_seconds
        self.policy = policy
        self.clock = clock
        self.say = say
        self._slots: list[_Slot] = []
        self._stop = False
        self._previous: dict[int, Any] = {}

    @property
    def processes(self) -> list[tuple[Child, subprocess.Popen[bytes]]]:
        """Each child's current process, in start order (a child waiting to restart has none)."""
        return [(s.child, s.proc) for s in self._slots if s.proc is not None]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop = True

    def start(self) -> None:
        """Start every child and wait until each answers on its ready URL.

        Signal handlers go in first: a SIGTERM that arrives while children start must stop them
        too, not kill this process and orphan them (they run in sessions of their own). A child
        that exits before it is ready is a failed start (a port taken, a bad file): not retried.
        """
        self._previous = {
            s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)
        }
        deadline = self.clock() + self.ready_timeout_seconds
        ready = 0  # the slots before this one found ready
        for child in self.children:
            if child.after_ready:
                self._wait_ready(self._slots[ready:], deadline)
                ready = len(self._slots)
                if self._stop:
                    return  # asked to stop while the others started: start nothing more
            slot = _Slot(child)
            self._spawn(slot)
            self._slots.append(slot)
        self._wait_ready(self._slots[ready:], deadline)

    def _wait_ready(self, slots: Sequence[_Slot], deadline: float) -> None:
        """Return once each of ``slots`` answers on its ready URL; ChildFailedError if one
        exits first or the deadline passes."""
        for slot in slots:
            child, proc = slot.child, slot.proc
            if child.ready_url is None or proc is None:
                continue
            while not _answers(child.ready_url) and not self._stop:
                if proc.poll() is not None:
                    raise ChildFailedError(
                        f"{child.name} exited with code {proc.returncode} while starting"
                    )
                if self.clock() > deadline:
                    raise ChildFailedError(f"{child.name} did not answer {child.ready_url} in time")
                time.sleep(0.1)

    def _spawn(self, slot: _Slot) -> None:
        child = slot.child
        env = {**child.env, **process_environment()} if child.env else None
        slot.proc = subprocess.Popen(list(child.argv), start_new_session=True, env=env)
        slot.started_at = self.clock()
        slot.restart_at = None

    def wait(self, poll_seconds: float = 0.2) -> int:
        """Block until Ctrl-C/SIGTERM (exit 0), restarting children that die on their own.

        Without a signal it returns once no child is left to run: 0 when each one finished,
        1 when one was given up.
        """
        while not self._stop:
            for slot in self._slots:
                self._check(slot)
            if all(s.ended for s in self._slots):
                given_up = [s.child.name for s in self._slots if s.given_up]
                if given_up:
                    self.say(f"nothing left running ({', '.join(given_up)} given up)")
                return 1 if given_up else 0
            time.sleep(poll_seconds)
        return 0

    def _check(self, slot: _Slot) -> None:
        """Notice one child's exit (report it, plan its restart) or start it when it is due."""
        now = self.clock()
        if slot.restart_at is not None and now >= slot.restart_at:
            self._spawn(slot)
            return
        if slot.proc is None or slot.proc.poll() is None:
            return
        code, name = slot.proc.returncode, slot.child.name
        how = _how_it_ended(code)
        _end_group(slot.proc.pid, signal.SIGTERM)  # its own children go with it
        slot.proc = None
        if code == 0:
            slot.finished = True
            self.say(f"{name} finished ({how})")
            return
        delay, slot.history = after_exit(self.policy, slot.history, slot.started_at, now)
        if delay is None:
            slot.given_up = True
            p = self.policy
            self.say(
                f"{name} {how}; giving it up after "
                f"{len(slot.history.exits)} exits within {p.give_up_window_seconds:g} s; "
                "the other children keep running"
            )
            return
        slot.restart_at = now + delay
        self.say(f"{name} {how}; restarting it in {delay:g} s")

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """Stop children one at a time in reverse start order: stop signal, then SIGKILL.

        Each child gets its ``stop_signal`` and ``timeout_seconds`` to exit before SIGKILL.

        One at a time, because the later children report to the earlier ones: a sidecar that
        stops ships its last records and its instance's stop to billing, which must still be up
        to take them (else they wait in the spool for the next start).
        """
        for slot in reversed(self._slots):
            slot.restart_at = None
            proc = slot.proc
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(slot.child.stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_seconds)
            if proc.poll() is None:
                # Each child leads its own process group: its own children (the autoscaler's
                # instances) go with it rather than outlive the fleet.
                _end_group(proc.pid, signal.SIGKILL)
                proc.wait()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _how_it_ended(code: int) -> str:
    """``exited with code 1``, or ``was killed by SIGKILL`` (Popen's negative return codes)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _end_group(pid: int, sig: signal.Signals) -> None:
    """Signal what is left of the process group a child led (none left is fine)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code < 500
    except httpx.HTTPError:
        return False
