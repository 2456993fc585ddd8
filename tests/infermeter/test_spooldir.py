"""A spool directory's lock: held by one process at a time, freed when its holder dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from infermeter.spooldir import LOCK, SpoolBusyError, SpoolLock


def test_the_lock_is_exclusive_while_held(tmp_path):
    """A second holder is refused until the first lets go."""
    first, second = SpoolLock(tmp_path / "pod"), SpoolLock(tmp_path / "pod")
    assert first.try_acquire()
    assert not second.try_acquire()
    first.release()
    assert second.try_acquire()
    second.release()


async def test_acquire_waits_a_bounded_time_and_names_the_directory(tmp_path):
    """A lock still held after the wait is an error naming the directory."""
    holder = SpoolLock(tmp_path / "pod")
    assert holder.try_acquire()
    started = time.monotonic()
    with pytest.raises(SpoolBusyError, match=str(tmp_path / "pod")):
        await SpoolLock(tmp_path / "pod").acquire(0.2)
    assert time.monotonic() - started >= 0.2
    holder.release()


async def test_acquire_gets_the_lock_once_its_holder_lets_go(tmp_path):
    """A waiter takes the lock as soon as it is released."""
    holder, waiter = SpoolLock(tmp_path / "pod"), SpoolLock(tmp_path / "pod")
    assert holder.try_acquire()
    asyncio.get_running_loop().call_later(0.1, holder.release)
    await waiter.acquire(5)
    assert waiter.held
    waiter.release()


async def test_a_waiter_on_a_removed_directory_starts_afresh(tmp_path):
    """A directory removed under its lock comes back, locked by the waiter, with a named lock file."""
    directory = tmp_path / "pod"
    holder, waiter = SpoolLock(directory), SpoolLock(directory)
    assert holder.try_acquire()
    waiting = asyncio.create_task(waiter.acquire(5))
    await asyncio.sleep(0.1)
    assert holder.remove_directory()
    await waiting
    assert (directory / LOCK).exists()
    assert not SpoolLock(directory).try_acquire()
    waiter.release()


def test_a_directory_that_holds_files_is_not_removed(tmp_path):
    """Removal keeps a directory with anything but the lock in it, and lets the lock go."""
    lock = SpoolLock(tmp_path / "pod")
    assert lock.try_acquire()
    (tmp_path / "pod" / "rejected.jsonl").write_text("{}\n")
    assert not lock.remove_directory()
    assert not lock.held
    assert (tmp_path / "pod" / "rejected.jsonl").exists()


def test_without_create_a_missing_directory_is_not_locked(tmp_path):
    """An adopter never makes the directory it looks for."""
    assert not SpoolLock(tmp_path / "gone").try_acquire(create=False)
    assert not (tmp_path / "gone").exists()


def test_the_lock_of_a_process_killed_with_sigkill_is_free(tmp_path):
    """The kernel lets go of a dead process's lock: its directory can be taken."""
    directory = tmp_path / "pod"
    code = (
        "import asyncio, sys, time; from pathlib import Path; "
        "from infermeter.spooldir import SpoolLock; "
        f"SpoolLock(Path({str(directory)!r})).try_acquire(); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"held\n"
        assert not SpoolLock(directory).try_acquire()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    lock = SpoolLock(directory)
    assert lock.try_acquire()
    lock.release()
