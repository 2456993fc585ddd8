"""Start, watch and stop the processes of a local fleet (``simulate`` and ``demo``).

Children run in their own sessions so that Ctrl-C reaches only this supervisor, which then
stops them one at a time in reverse start order: traffic first, billing last, so nothing logs a
refused connection on the way down and every record shipped on the way down is taken.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import httpx

__all__ = ["Child", "ChildFailedError", "Supervisor"]


@dataclass(frozen=True)
class Child:
    """A process to run: its name, its command line and the URL that answers once it is up.

    ``env``: variables added to this child's environment only (the supervisor's own win).
    """

    name: str
    argv: Sequence[str]
    ready_url: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)


class ChildFailedError(Exception):
    """A child exited on its own; the message names it and its exit code."""


class Supervisor:
    """Runs children until a signal arrives or one of them dies."""

    def __init__(self, children: Sequence[Child], ready_timeout_seconds: float = 60.0) -> None:
        self.children = list(children)
        self.ready_timeout_seconds = ready_timeout_seconds
        self._procs: list[tuple[Child, subprocess.Popen[bytes]]] = []
        self._stop = False
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop = True

    def start(self) -> None:
        """Start every child and wait until each answers on its ready URL.

        Signal handlers go in first: a SIGTERM that arrives while children start must stop them
        too, not kill this process and orphan them (they run in sessions of their own).
        """
        self._previous = {
            s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)
        }
        for child in self.children:
            env = {**child.env, **os.environ} if child.env else None
            proc = subprocess.Popen(list(child.argv), start_new_session=True, env=env)
            self._procs.append((child, proc))
        deadline = time.monotonic() + self.ready_timeout_seconds
        for child, proc in self._procs:
            if child.ready_url is None:
                continue
            while not _answers(child.ready_url) and not self._stop:
                if proc.poll() is not None:
                    raise ChildFailedError(
                        f"{child.name} exited with code {proc.returncode} while starting"
                    )
                if time.monotonic() > deadline:
                    raise ChildFailedError(f"{child.name} did not answer {child.ready_url} in time")
                time.sleep(0.1)

    def wait(self) -> int:
        """Block until Ctrl-C/SIGTERM (exit 0) or a child dies (exit 1)."""
        while not self._stop:
            for child, proc in self._procs:
                if proc.poll() is not None:
                    print(
                        f"infermeter: {child.name} exited with code {proc.returncode}; stopping",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(0.2)
        return 0

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """Stop children one at a time in reverse start order: SIGTERM, SIGKILL after the timeout.

        One at a time, because the later children report to the earlier ones: a sidecar that
        stops ships its last records and its instance's stop to billing, which must still be up
        to take them (else they wait in the spool for the next start).
        """
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_seconds)
            if proc.poll() is None:
                # Each child leads its own process group: its own children (the autoscaler's
                # instances) go with it rather than outlive the fleet.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code < 500
    except httpx.HTTPError:
        return False
