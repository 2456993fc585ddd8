"""An instance's spool directory: its layout, and the lock that says a live process owns it.

Layout, under ``sidecar.spool_dir``, one directory per instance, named by its ``spool_key`` (the
pod UID in Kubernetes, else the instance id, which for a fixed replica is the replica id):

    <spool_key>/seg-<n>.jsonl              usage records (``usage``)
    <spool_key>/instances/seg-<n>.jsonl    the instance's start, heartbeats and stop (``instances``)
    <spool_key>/rejected.jsonl             records billing refused, with the reason
    <spool_key>/gateway-nonces/            the signed gateway requests served (``sidecar.nonces``)
    <spool_key>/.lock                      held (``flock``) by the sidecar while it runs

The sidecar holds an exclusive ``flock`` on ``.lock`` for as long as it runs; the kernel releases
it when the process ends, however it ends (kill -9 included). So a directory whose lock can be
taken has no live owner: it is an orphan, and the node's collector adopts it and ships what it
holds. The lock is advisory and local: the spool root must be a local filesystem (a hostPath),
not NFS.

Taking the lock checks that the locked file is still the one at ``.lock``: an adopter removes an
empty directory (lock file included) while holding its lock, and a process that was waiting for
that lock must not go on holding a file that no longer has a name.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Final

from infermeter.audit_spool import AUDIT_DIR
from infermeter.journal_files import JOURNAL_DIR
from infermeter.spool import RESHIP

__all__ = [
    "BUDGET_OVERRIDES",
    "GATEWAY_NONCES",
    "INSTANCES",
    "ISSUED_KEYS",
    "LOCK",
    "SpoolBusyError",
    "SpoolLock",
]

INSTANCES: Final = "instances"
BUDGET_OVERRIDES: Final = "budget-overrides"
GATEWAY_NONCES: Final = "gateway-nonces"
# The keys billing issued, as a sidecar last read them (``sidecar.keysync``): a cache.
ISSUED_KEYS: Final = "issued-keys.json"
LOCK: Final = ".lock"


class SpoolBusyError(OSError):
    """Another live process held the spool directory's lock for longer than we could wait."""


class SpoolLock:
    """The exclusive ``flock`` on ``<directory>/.lock``; not reentrant, one holder per object."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def try_acquire(self, create: bool = True) -> bool:
        """Take the lock if it is free now; ``create`` makes the directory when it is missing.

        False when another process holds it, or (``create`` False) the directory is gone.
        """
        assert self._fd is None, "the lock is already held"
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        if not _still_named(fd, self.path):
            # Removed by its previous holder while we waited: that lock guards nothing now.
            os.close(fd)
            return self.try_acquire(create) if create else False
        self._fd = fd
        return True

    async def acquire(self, wait_seconds: float, poll_seconds: float = 0.05) -> None:
        """Take the lock, waiting up to ``wait_seconds`` for its holder to let go.

        SpoolBusyError when it is still held then: another sidecar runs on this directory (the
        same pod UID or instance id twice), or a collector is still shipping it.
        """
        deadline = time.monotonic() + wait_seconds
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                raise SpoolBusyError(
                    f"spool directory {self.directory} is locked by another process "
                    f"({self.path} still held after {wait_seconds:g} s): another sidecar of "
                    "the same instance runs, or a collector is shipping it"
                )
            await asyncio.sleep(poll_seconds)

    def release(self) -> None:
        """Let go of the lock (closing the file releases it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove_directory(self) -> bool:
        """Remove the (empty) directory while holding its lock, then release; False if not empty.

        The lock file goes last but one, the directory last, so that a process that takes the
        lock meanwhile finds its file unnamed and starts afresh.
        """
        assert self._fd is not None, "remove a spool directory only while holding its lock"
        nonces = self.directory / GATEWAY_NONCES
        if nonces.is_dir():  # nothing to ship: the caller judged them too old to matter
            for path in nonces.iterdir():
                path.unlink(missing_ok=True)
        (self.directory / ISSUED_KEYS).unlink(missing_ok=True)  # a cache of billing's
        # Segments billing acknowledged, kept for a restore of its ledger: their writer is gone.
        for path in [*self.directory.glob("acked-*.jsonl"), self.directory / RESHIP]:
            path.unlink(missing_ok=True)
        (self.directory / AUDIT_DIR / LOCK).unlink(missing_ok=True)
        for sub in (INSTANCES, BUDGET_OVERRIDES, JOURNAL_DIR, GATEWAY_NONCES, AUDIT_DIR):
            with contextlib.suppress(OSError):  # absent, or not empty: the check below tells
                (self.directory / sub).rmdir()
        if any(p.name != LOCK for p in self.directory.iterdir()):
            self.release()
            return False
        self.path.unlink(missing_ok=True)
        try:
            self.directory.rmdir()
        except OSError:
            return False  # something arrived after the check: kept for the next round
        finally:
            self.release()
        return True


def _still_named(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)
