"""The local fleet's supervisor stops its children one at a time, the last started first."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from infermeter.supervisor import Child, Supervisor

# A child that, on SIGTERM, takes a moment to stop (as a sidecar shipping its last records
# does), then writes when it stopped.
_CHILD = """
import signal, sys, time
def stop(*_):
    time.sleep(0.3)
    open(sys.argv[1], "w").write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".up", "w").close()
while True:
    time.sleep(0.05)
"""


def test_children_stop_one_at_a_time_in_reverse_start_order(tmp_path: Path) -> None:
    """Each child gets SIGTERM only once the child started after it has exited."""
    marks = [tmp_path / name for name in ("billing", "sidecar", "traffic")]
    supervisor = Supervisor([Child(m.name, [sys.executable, "-c", _CHILD, str(m)]) for m in marks])
    supervisor.start()
    deadline = time.monotonic() + 30
    while not all(m.with_suffix(".up").exists() for m in marks):
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.05)
    supervisor.stop()
    stopped = [float(m.read_text()) for m in marks]
    # traffic stopped first, then the sidecar, billing last: each 0.3 s after the one before.
    assert stopped[2] + 0.25 < stopped[1]
    assert stopped[1] + 0.25 < stopped[0]


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    """A child that does not stop on SIGTERM is killed, and the next one is still stopped."""
    stubborn = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "open(sys.argv[1], 'w').close(); time.sleep(60)")  # fmt: skip
    mark, up = tmp_path / "billing", tmp_path / "stubborn.up"
    supervisor = Supervisor([Child("billing", [sys.executable, "-c", _CHILD, str(mark)]),
                             Child("stubborn", [sys.executable, "-c", stubborn, str(up)])])  # fmt: skip
    supervisor.start()
    deadline = time.monotonic() + 30
    while not (mark.with_suffix(".up").exists() and up.exists()):
        assert time.monotonic() < deadline, "child did not start"
        time.sleep(0.05)
    supervisor.stop(timeout_seconds=0.5)
    assert all(proc.poll() is not None for _, proc in supervisor._procs)
    assert mark.exists()
