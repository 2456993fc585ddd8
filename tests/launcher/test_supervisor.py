"""The local fleet's supervisor: children that die are restarted with back-off or given up; the
fleet stops one child at a time, the last started first."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from infermeter.serving import free_port
from launcher.supervisor import Child, ExitHistory, RestartPolicy, Supervisor, after_exit

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


# A server that starts answering a while after its start (as a sidecar loading its state does),
# and writes when it began to listen.
_SLOW_SERVER = """
import http.server, sys, time
time.sleep(1.0)
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)
open(sys.argv[2], "w").write(repr(time.time()))
server.serve_forever()
"""
# A client of it: writes when it started.
_STARTED = "import sys, time; open(sys.argv[1], 'w').write(repr(time.time())); time.sleep(60)"


def _server_and_client(listening: Path, started: Path, after_ready: bool) -> list[Child]:
    """A server ready after 1 s (writes to ``listening`` when), then a client of it (writes to
    ``started`` when)."""
    port = free_port()
    server = Child(
        "sidecar",
        [sys.executable, "-c", _SLOW_SERVER, str(port), str(listening)],
        ready_url=f"http://127.0.0.1:{port}/",
    )
    client = Child(
        "traffic", [sys.executable, "-c", _STARTED, str(started)], after_ready=after_ready
    )
    return [server, client]


@pytest.mark.parametrize("after_ready", [True, False])
def test_a_child_started_after_ready_waits_for_the_children_before_it(
    tmp_path: Path, after_ready: bool
) -> None:
    """The traffic generator's first request must find the sidecars listening."""
    listening, started = tmp_path / "listening", tmp_path / "started"
    supervisor = Supervisor(_server_and_client(listening, started, after_ready))
    try:
        supervisor.start()
        deadline = time.monotonic() + 30
        while not started.exists() or not started.read_text():
            assert time.monotonic() < deadline, "the client did not start"
            time.sleep(0.05)
    finally:
        supervisor.stop()
    waited = float(started.read_text()) > float(listening.read_text())
    assert waited is after_ready


def test_a_stop_asked_while_the_others_start_starts_no_child_after_them(tmp_path: Path) -> None:
    """Ctrl-C during start-up: the traffic generator is not started only to be stopped."""
    started = tmp_path / "started"
    supervisor = Supervisor(_server_and_client(tmp_path / "listening", started, after_ready=True))
    # Ctrl-C while the server is still starting (it listens after 1 s).
    threading.Timer(0.3, supervisor._on_signal, (signal.SIGINT, None)).start()
    try:
        supervisor.start()
        assert [child.name for child, _ in supervisor.processes] == ["sidecar"]
    finally:
        supervisor.stop()
    time.sleep(0.5)  # a client started anyway would have written by now
    assert not started.exists()


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    """A child that does not stop on SIGTERM is killed, and the next one is still stopped."""
    stubborn = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open(sys.argv[1], 'w').close(); time.sleep(60)"
    )
    mark, up = tmp_path / "billing", tmp_path / "stubborn.up"
    supervisor = Supervisor(
        [
            Child("billing", [sys.executable, "-c", _CHILD, str(mark)]),
            Child("stubborn", [sys.executable, "-c", stubborn, str(up)]),
        ]
    )
    supervisor.start()
    deadline = time.monotonic() + 30
    while not (mark.with_suffix(".up").exists() and up.exists()):
        assert time.monotonic() < deadline, "child did not start"
        time.sleep(0.05)
    supervisor.stop(timeout_seconds=0.5)
    assert all(proc.poll() is not None for _, proc in supervisor.processes)
    assert mark.exists()


# A child that notes each start (its time and pid, one line), then exits with the code the
# n-th start is given (argv[2:], the last one repeated); "up" stays up until SIGTERM.
_SCRIPTED = """
import sys, time, os
log = sys.argv[1]
starts = len(open(log).readlines()) if os.path.exists(log) else 0
with open(log, "a") as f:
    f.write(f"{time.monotonic()} {os.getpid()}\\n")
codes = sys.argv[2:]
code = codes[min(starts, len(codes) - 1)]
if code == "up":
    while True:
        time.sleep(0.05)
sys.exit(int(code))
"""

FAST = RestartPolicy(
    first_delay_seconds=0.1,
    max_delay_seconds=0.4,
    stable_after_seconds=30,
    give_up_exits=5,
    give_up_window_seconds=60,
)


def scripted(name: str, log: Path, *codes: str) -> Child:
    return Child(name, [sys.executable, "-c", _SCRIPTED, str(log), *codes])


def starts(log: Path) -> list[tuple[float, int]]:
    """(monotonic time, pid) of each start the child noted."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [(float(t), int(pid)) for t, pid in (line.split() for line in lines)]


def run_until(
    supervisor: Supervisor, lines: list[str], done: str, linger: float = 0.0, timeout: int = 30
) -> int:
    """Run ``wait`` until a reported line contains ``done``, then ``linger`` s more; SIGTERM ends it.

    The signal goes through the supervisor's own handler, as Ctrl-C or SIGTERM would.
    """
    end = threading.Timer(linger, os.kill, (os.getpid(), signal.SIGTERM))

    def say(line: str) -> None:
        lines.append(line)
        if done in line:
            end.start()

    supervisor.say = say
    alarm = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    signal.alarm(int(timeout))  # a test that never sees its line still ends
    try:
        return supervisor.wait(poll_seconds=0.02)
    finally:
        end.cancel()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, alarm)


@pytest.mark.parametrize(
    ("history", "started_at", "now", "delay", "exits"),
    [
        (ExitHistory(), 0.0, 5.0, 1.0, (5.0,)),  # the first exit: the first delay
        (ExitHistory((5.0,), 1.0), 6.0, 7.0, 2.0, (5.0, 7.0)),  # too soon again: doubled
        (ExitHistory((5.0,), 16.0), 6.0, 7.0, 30.0, (5.0, 7.0)),  # doubled, capped at 30 s
        (ExitHistory((5.0,), 16.0), 6.0, 66.0, 1.0, (5.0, 66.0)),  # stayed up 60 s: from 1 s
        # four exits, but ten minutes ago: forgotten, so this one does not give up
        (ExitHistory((1.0, 2.0, 3.0, 4.0), 8.0), 700.0, 701.0, 16.0, (701.0,)),
        # the sixth exit within 600 s: given up
        (ExitHistory((1.0, 2.0, 3.0, 4.0, 5.0), 16.0), 20.0, 21.0, None, (1, 2, 3, 4, 5, 21)),
    ],
)
def test_after_exit_doubles_caps_resets_and_gives_up(history, started_at, now, delay, exits):
    """The restart delay of the default policy, and its give-up after 6 exits in 600 s."""
    got, after = after_exit(RestartPolicy(), history, started_at, now)
    assert got == delay
    assert after.exits == exits


def test_a_child_that_dies_is_restarted_after_a_delay_and_the_others_keep_running(tmp_path):
    """One line names the child, its exit code and the delay; the next start waits that long."""
    flaky, steady = tmp_path / "flaky", tmp_path / "steady"
    supervisor = Supervisor(
        [scripted("steady", steady, "up"), scripted("flaky", flaky, "3", "up")], policy=FAST
    )
    supervisor.start()
    lines: list[str] = []
    try:
        assert run_until(supervisor, lines, "restarting", linger=0.5) == 0
        wait_for(lambda: len(starts(flaky)) == 2)  # restarted by now; noted once Python is up
        [(first, _), (second, pid)] = starts(flaky)
        assert second - first >= 0.1
        assert {c.name: p.pid for c, p in supervisor.processes}["flaky"] == pid
        assert all(p.poll() is None for _, p in supervisor.processes)
    finally:
        supervisor.stop()
    assert lines == ["flaky exited with code 3; restarting it in 0.1 s"]
    assert len(starts(steady)) == 1


def test_a_child_that_keeps_crashing_is_given_up_and_the_others_keep_running(tmp_path):
    """Delays double to the cap; after 5 exits within the window it is given up, and said so."""
    crash, steady = tmp_path / "crash", tmp_path / "steady"
    supervisor = Supervisor(
        [scripted("steady", steady, "up"), scripted("crash", crash, "1")], policy=FAST
    )
    supervisor.start()
    lines: list[str] = []
    try:
        assert run_until(supervisor, lines, "giving it up") == 0
        assert [c.name for c, p in supervisor.processes if p.poll() is None] == ["steady"]
    finally:
        supervisor.stop()
    assert lines == [
        *(f"crash exited with code 1; restarting it in {d:g} s" for d in (0.1, 0.2, 0.4, 0.4)),
        "crash exited with code 1; giving it up after 5 exits within 60 s; "
        "the other children keep running",
    ]
    times = [t for t, _ in starts(crash)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 5
    assert all(gap >= delay for gap, delay in zip(gaps, (0.1, 0.2, 0.4, 0.4), strict=True))
    assert len(starts(steady)) == 1


def test_a_child_that_finishes_is_not_restarted(tmp_path):
    """Exit code 0 is work done (traffic after --duration): said once, never started again."""
    done, steady = tmp_path / "done", tmp_path / "steady"
    supervisor = Supervisor(
        [scripted("steady", steady, "up"), scripted("traffic", done, "0")], policy=FAST
    )
    supervisor.start()
    lines: list[str] = []
    try:
        # Watched for 5 times the first restart delay after it finished.
        assert run_until(supervisor, lines, "finished", linger=0.5) == 0
    finally:
        supervisor.stop()
    assert lines == ["traffic finished (exited with code 0)"]
    assert len(starts(done)) == 1


def test_what_a_dead_child_started_is_stopped_with_it(tmp_path):
    """A child's own children (the autoscaler's instances) get SIGTERM when it dies."""
    grandchild = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(0.3); sys.exit(1)"
    )
    supervisor = Supervisor(
        [Child("parent", [sys.executable, "-c", script, str(grandchild)])],
        policy=RestartPolicy(first_delay_seconds=60),
    )
    supervisor.start()
    lines: list[str] = []
    try:
        assert run_until(supervisor, lines, "restarting") == 0
        pid = int(grandchild.read_text())
        wait_for(lambda: gone(pid))
    finally:
        supervisor.stop()


def gone(pid: int) -> bool:
    """True once ``pid`` is no process (or a zombie only its parent, now gone, could reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_each_child_is_stopped_with_its_own_signal(tmp_path):
    """A child that asks for SIGINT (an asyncio.run program) gets SIGINT; the others SIGTERM."""
    script = (
        "import signal, sys, time\n"
        "def note(signum, _):\n"
        "    open(sys.argv[1], 'w').write(signal.Signals(signum).name); sys.exit(0)\n"
        "signal.signal(signal.SIGINT, note); signal.signal(signal.SIGTERM, note)\n"
        "open(sys.argv[1] + '.up', 'w').close()\n"
        "time.sleep(600)\n"
    )
    server, traffic = tmp_path / "server", tmp_path / "traffic"
    supervisor = Supervisor(
        [
            Child("server", [sys.executable, "-c", script, str(server)]),
            Child(
                "traffic", [sys.executable, "-c", script, str(traffic)], stop_signal=signal.SIGINT
            ),
        ]
    )
    supervisor.start()
    wait_for(lambda: server.with_suffix(".up").exists() and traffic.with_suffix(".up").exists())
    supervisor.stop()
    assert (server.read_text(), traffic.read_text()) == ("SIGTERM", "SIGINT")
