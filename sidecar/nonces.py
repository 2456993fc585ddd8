"""Gateway nonces: a signed request is served once, by any sidecar of the fleet, across restarts.

A gateway's signature (``infermeter.auth.GatewayVerifier``) holds for ``max_skew_seconds`` either
side of its timestamp and for one request to one model; its nonce is remembered so that it is
served once. Two memories keep it:

- ``NonceFile``, this sidecar's own, always: ``sidecar.seen_nonces.ReplayCache`` in memory (at most
  ``replay_cache_entries``), and every nonce appended to ``<spool dir>/gateway-nonces/`` before
  its request is forwarded, so a restarted sidecar (the same instance: the same spool directory)
  refuses what it served before. The file is bounded: once it holds twice
  ``replay_cache_entries`` lines it is rewritten, in the disk thread, with only what the memory
  holds (its floor and its nonces), and so is it at each start. Appends are fsynced every second:
  a crash of the process loses none, a crash of the machine up to a second's.
- ``SharedNonces``, the fleet's, when shared limits are configured (``shared_limits.redis_url``;
  the Redis client, ``sidecar.resp``, is loaded only then):
  ``SET <prefix>:nonce:<nonce> NX PX <ms>`` in the same Redis, kept until the timestamp leaves
  the skew window (plus a second for the sidecars' clocks), so a request served by one sidecar is
  refused by every other. This sidecar's file is asked first and kept as well. When Redis does
  not answer in ``timeout_millis``, ``shared_limits.on_failure`` decides: ``fail_open`` serves on
  this sidecar's memory alone (logged once, counted), ``fail_closed`` refuses with 503.

Without Redis, then, a signed request is served once per sidecar, even across its restarts, but
a request captured in flight may be replayed once to each other sidecar of the same model within
the window; the signature's audience keeps it from any sidecar of another model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter

from infermeter.auth import AuthError
from infermeter.config import Config, env_value
from infermeter.disk_thread import DiskThread
from infermeter.records import RequestStatus
from infermeter.spooldir import GATEWAY_NONCES
from sidecar.admission import Headers, Refusal, identify
from sidecar.seen_nonces import ReplayCache
from sidecar.state import View

if TYPE_CHECKING:
    from sidecar.resp import RespClient

__all__ = [
    "NonceFile",
    "NonceStore",
    "SharedNonces",
    "nonce_store",
    "team_of",
]

log = logging.getLogger("infermeter.sidecar")

_FSYNC_SECONDS = 1.0
_LINE = re.compile(rb"([0-9]{1,12}) ([A-Za-z0-9_.-]{16,128})")
_FLOOR = re.compile(rb"floor ([0-9]{1,12})")
_FILE = re.compile(r"nonces-([0-9]{1,12})\.log")
# Redis remembers a nonce this much past its window: the sidecars' clocks differ a little.
_CLOCK_MARGIN_SECONDS = 1.0

Reason = Literal["stale", "replayed"]
# The floor and the nonces a memory holds, as a compacted file begins.
_Snapshot = tuple[float, list[tuple[int, str]]]


class NonceStore(Protocol):
    """Where a sidecar asks whether a signed request's nonce was used before."""

    async def admit(self, nonce: str, timestamp: int, now: float) -> Reason | None:
        """Remember ``nonce``; the reason to refuse it, or None. Refusal (503) when the memory
        cannot be kept, so a request that might be served twice is not served."""
        ...

    async def run(self) -> None:
        """Background work until cancelled (fsync)."""
        ...

    async def close(self) -> None:
        """Make what is remembered durable and let go of the files and connections."""
        ...


def _unavailable(what: str) -> Refusal:
    return Refusal(
        503,
        f"The memory of served gateway requests is unavailable ({what}); "
        "the request was not served.",
        "server_error",
        "replay_memory_unavailable",
        RequestStatus.REJECTED,
        (("retry-after", "1"),),
    )


class NonceFile:
    """This sidecar's nonces, in memory and in its spool directory (module docstring)."""

    def __init__(self, directory: Path, window_seconds: float, max_entries: int) -> None:
        self.directory = directory
        self.memory = ReplayCache(window_seconds, max_entries)
        # Lines in the current file past which it is rewritten with only what is remembered.
        self.compact_after = 2 * max_entries
        self._number = 0
        self._lines = 0
        self._fd: int | None = None
        self._opened = False
        self._dirty = False
        self._disk = DiskThread(f"nonces-{directory.parent.name}")

    async def admit(self, nonce: str, timestamp: int, now: float) -> Reason | None:
        """Check and remember in memory at once (concurrent replays meet it), then on disk."""
        if not self._opened:
            await self._disk.run(lambda: self._open(now))
        refused = self.memory.admit(nonce, timestamp, now)
        if refused is not None:
            return refused
        self._lines += 1
        kept: _Snapshot | None = None
        if self._lines >= self.compact_after:
            # Taken here, where the memory changes: every nonce admitted so far is in it.
            kept = (self.memory.floor, self.memory.entries())
            self._lines = len(kept[1]) + 1
        line = f"{timestamp} {nonce}\n".encode()
        try:
            await self._disk.run(lambda: self._append(line, kept))
        except OSError as exc:
            log.error("gateway nonce not written to %s: %s", self.directory, exc)
            raise _unavailable("cannot write the sidecar's nonce file") from None
        return None

    def _open(self, now: float) -> None:
        """In the disk thread: read what an earlier run remembered, then rewrite it compactly."""
        if self._opened:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        found = sorted(
            (int(m.group(1)), p) for p in self.directory.iterdir() if (m := _FILE.fullmatch(p.name))
        )
        for _, path in found:
            self._read(path, now)
        self._number = found[-1][0] if found else -1
        self._compact((self.memory.floor, self.memory.entries()))
        self._lines = len(self.memory) + 1
        self._opened = True

    def _read(self, path: Path, now: float) -> None:
        for raw in path.read_bytes().splitlines():
            if m := _LINE.fullmatch(raw):
                self.memory.admit(m.group(2).decode(), int(m.group(1)), now)
            elif m := _FLOOR.fullmatch(raw):
                self.memory.floor = max(self.memory.floor, int(m.group(1)))
            # Anything else is the torn end of a line a crash cut: never acted on.

    def _append(self, line: bytes, kept: _Snapshot | None) -> None:
        """In the disk thread: one nonce line; then, when the file is full, a compact one."""
        assert self._fd is not None
        os.write(self._fd, line)
        self._dirty = True
        if kept is not None:
            self._compact(kept)

    def _compact(self, kept: _Snapshot) -> None:
        """Begin the next file with the floor and the nonces remembered, then drop the older.

        The new file is on disk (fsynced) before any older one goes, so a crash between the two
        leaves both, which read together say the same.
        """
        floor, entries = kept
        self._number += 1
        path = self.directory / f"nonces-{self._number:012d}.log"
        head = f"floor {int(floor)}\n" if floor > 0 else ""
        data = (head + "".join(f"{ts} {nonce}\n" for ts, nonce in entries)).encode()
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
        )
        try:
            os.write(fd, data)
            os.fsync(fd)
        except OSError:
            os.close(fd)
            raise
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._dirty = fd, False
        for old in self.directory.iterdir():
            if (m := _FILE.fullmatch(old.name)) and int(m.group(1)) < self._number:
                old.unlink(missing_ok=True)

    def _sync(self) -> None:
        if self._fd is not None and self._dirty:
            self._dirty = False
            os.fsync(self._fd)

    async def run(self) -> None:
        """Fsync what was written, every second, until cancelled."""
        while True:
            await asyncio.sleep(_FSYNC_SECONDS)
            if self._dirty:
                try:
                    await self._disk.run(self._sync)
                except OSError as exc:
                    log.error("gateway nonces not synced to %s: %s", self.directory, exc)

    async def close(self) -> None:
        """Fsync and close the current file."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                await self._disk.run(self._sync)
            os.close(self._fd)
            self._fd = None
        self._disk.stop()


class SharedNonces:
    """The fleet's nonces in Redis, over this sidecar's own file (module docstring)."""

    def __init__(
        self,
        local: NonceFile,
        resp: RespClient,
        key_prefix: str,
        window_seconds: float,
        on_failure: Literal["fail_open", "fail_closed"],
        registry: CollectorRegistry,
    ) -> None:
        self.local = local
        self.resp = resp
        self.key_prefix = key_prefix
        self.window_seconds = window_seconds
        self.on_failure = on_failure
        self.unshared = Counter(
            "infermeter_gateway_nonces_unshared",
            "Signed gateway requests decided without the fleet's memory (Redis did not answer): "
            "served on this sidecar's own memory (fail_open) or refused (fail_closed).",
            ["policy"],
            registry=registry,
        )
        self._down = False
        from sidecar.resp import ReplyError  # loaded with the client (``nonce_store``)

        self._failures = (ReplyError, OSError, TimeoutError)

    async def admit(self, nonce: str, timestamp: int, now: float) -> Reason | None:
        """This sidecar's memory first, then ``SET NX`` in Redis."""
        refused = await self.local.admit(nonce, timestamp, now)
        if refused is not None:
            return refused
        ttl = timestamp + self.window_seconds - now + _CLOCK_MARGIN_SECONDS
        key = f"{self.key_prefix}:nonce:{nonce}"
        try:
            reply = await self.resp.call(
                "SET", key, timestamp, "NX", "PX", max(1, math.ceil(ttl * 1000))
            )
        except self._failures as exc:
            return self._without_redis(exc)
        if self._down:
            self._down = False
            log.warning(
                "gateway nonces: Redis answers again; signed requests are checked fleet-wide"
            )
        return None if reply is not None else "replayed"

    def _without_redis(self, exc: BaseException) -> Reason | None:
        self.unshared.labels(self.on_failure).inc()
        if not self._down:
            self._down = True
            log.error(
                "gateway nonces: Redis did not answer (%s: %s); %s",
                type(exc).__name__,
                exc,
                "signed requests are checked by this sidecar's own memory alone"
                if self.on_failure == "fail_open"
                else "signed requests are refused",
            )
        if self.on_failure == "fail_closed":
            raise _unavailable("Redis did not answer")
        return None

    async def run(self) -> None:
        """The local file's fsync, until cancelled."""
        await self.local.run()

    async def close(self) -> None:
        """Close the file and the connection."""
        await self.local.close()
        await self.resp.close()


def nonce_store(config: Config, spool_directory: Path, registry: CollectorRegistry) -> NonceStore:
    """The nonce memory of a sidecar whose spool is ``spool_directory``: shared when Redis is.

    Made whether or not gateway mode is on (a reload may turn it on); nothing is read, written or
    connected before the first signed request.
    """
    gateway, shared = config.sidecar.gateway, config.sidecar.shared_limits
    local = NonceFile(
        spool_directory / GATEWAY_NONCES, gateway.max_skew_seconds, gateway.replay_cache_entries
    )
    if shared.redis_url is None:
        return local
    # Only here: the Redis client and hiredis are memory that a sidecar without Redis would hold
    # for nothing (docs/benchmarks.md).
    from sidecar.resp import RespClient, parse_url

    password = env_value(shared.password_env) or None
    resp = RespClient(
        parse_url(shared.redis_url, password),
        shared.timeout_millis / 1000,
        max_backoff_seconds=shared.retry_seconds,
    )
    return SharedNonces(
        local, resp, shared.key_prefix, gateway.max_skew_seconds, shared.on_failure, registry
    )


async def team_of(
    view: View, nonces: NonceStore, method: str, path: str, headers: Headers, body: bytes = b""
) -> str:
    """The calling team, by its key or, in gateway mode, by a signature not used before.

    AuthError when neither proves a team (a replayed signature included); Refusal (503) when the
    memory of nonces cannot be kept.
    """
    signed = identify(view, method, path, headers, body)
    if isinstance(signed, str):
        return signed
    refused = await nonces.admit(signed.nonce, signed.timestamp, time.time())
    if refused == "replayed":
        raise AuthError("Replayed gateway signature.", "invalid_team_signature")
    if refused == "stale":
        raise AuthError("Stale gateway signature.", "invalid_team_signature")
    return signed.team
