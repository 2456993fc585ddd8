"""Configuration reload without a restart: on SIGHUP, and when the file changes (a ConfigMap).

A mounted ConfigMap is replaced by Kubernetes through a symlink swap, which changes the file's
modification time as seen through the mount: ``Reloader.watch`` compares it every
``interval_seconds`` (2 s) with the one last read and reloads when it moved. Either way ``Reloader.reload`` reads the file again (with the
same ``INFERMETER__*`` overrides), validates it whole, asks the service's own ``check`` (what it
cannot take without a restart, a public key hash beyond loopback), and only then ``apply``; a
file that fails any of it is refused with the error named, and the configuration in force stays.
Each outcome is told to ``audit`` (the audit trail: ``config.reloaded`` or ``config.refused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path

from infermeter.config import Config, ConfigError, load_config

__all__ = ["Reloader"]

log = logging.getLogger("infermeter.reload")

# (action, trigger, why) -> the event on the audit trail.
Audit = Callable[[str, str, str], Coroutine[object, object, None]]


@dataclass
class Reloader:
    """Reloads one service's configuration from ``path``."""

    path: Path
    service: str
    apply: Callable[[Config], None]
    audit: Audit | None = None
    # The problems that refuse a new configuration besides its validation (none: every valid one).
    check: Callable[[Config], list[str]] = lambda _: []
    _audits: set[asyncio.Task[None]] = field(default_factory=set)
    # The modification time of the file as last read: a SIGHUP after an edit reads the file,
    # and the watch does not read the same edit again.
    _seen: float = field(default=0.0)

    def __post_init__(self) -> None:
        self._seen = _mtime(self.path)

    def reload(self, trigger: str = "SIGHUP") -> bool:
        """Read, validate, check and apply the file; False (old configuration kept) if refused."""
        self._seen = _mtime(self.path)
        try:
            fresh = load_config(self.path)
            problems = self.check(fresh)
            if problems:
                raise ConfigError(str(self.path), problems)
            self.apply(fresh)
        except (ConfigError, KeyError, ValueError) as exc:
            log.error(
                "%s: configuration NOT reloaded, keeping the previous one: %s", self.service, exc
            )
            self._audit("config.refused", trigger, str(exc))
            return False
        log.warning("%s: configuration reloaded from %s (%s)", self.service, self.path, trigger)
        self._audit("config.reloaded", trigger, "")
        return True

    def _audit(self, action: str, trigger: str, why: str) -> None:
        if self.audit is None:
            return
        task = asyncio.get_running_loop().create_task(self.audit(action, trigger, why[:2000]))
        self._audits.add(task)
        task.add_done_callback(self._audits.discard)

    def install(
        self, loop: asyncio.AbstractEventLoop, interval_seconds: float = 2.0
    ) -> asyncio.Task[None]:
        """Reload on SIGHUP and when the file changes; the watching task (cancel it to stop)."""
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        return loop.create_task(self.watch(interval_seconds))

    async def watch(self, interval_seconds: float = 2.0) -> None:
        """Reload when the file's modification time moves from the one last read."""
        while True:
            await asyncio.sleep(interval_seconds)
            if _mtime(self.path) != self._seen:
                self.reload("file change")

    async def settle(self) -> None:
        """Wait for the audit events of reloads done so far to be written."""
        if self._audits:
            await asyncio.gather(*self._audits, return_exceptions=True)


def _mtime(path: Path) -> float:
    with contextlib.suppress(OSError):
        return path.stat().st_mtime
    return 0.0
