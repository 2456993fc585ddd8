"""A service's own audit events, spooled before they count and shipped like usage.

The sidecars (budget overrides, configuration reloads), the dashboard (sign-ins, sign-in
failures, sign-outs) and the autoscaler (configuration reloads) record the changes
they see with ``AuditLog.record``: the event is a sealed line in the service's ``audit`` spool
once the call returns, and a ``Shipper`` sends it to billing's ``POST /v1/ingest/audit`` as billing
can take it, so an event made while billing is down is kept until billing has it. Billing keeps
each event once, naming the writer that sent it as its ``source``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from infermeter.audit import MAX_BATCH_EVENTS, AuditEvent, audit_event
from infermeter.spool import Spool, SpoolError

if TYPE_CHECKING:
    import httpx

    from infermeter.shipper import Shipper, ShipperMetrics
    from infermeter.writers import Credential

__all__ = ["AUDIT_DIR", "AUDIT_KIND", "AuditLog", "AuditThread"]

log = logging.getLogger("infermeter.audit")

# The subdirectory of a service's spool directory, and the kind billing's ingest names.
AUDIT_DIR: Final = "audit"
AUDIT_KIND: Final = "audit"
# Audit events are few (a person's hand, a reload): this bound is ample.
_MAX_BYTES: Final = 64 << 20


class AuditLog:
    """One service's audit spool; ``source`` names the service in its events."""

    def __init__(self, directory: Path, source: str, credential: Credential | None = None) -> None:
        from infermeter.writers import Sealer

        self.source = source
        self.credential = credential
        sealer = Sealer(credential) if credential is not None else None
        self.spool = Spool(directory, max_bytes=_MAX_BYTES, sealer=sealer)

    def open(self) -> None:
        """Open the spool (in the running event loop)."""
        self.spool.open()

    async def close(self) -> None:
        """Make every event durable and close the spool."""
        await self.spool.close()

    async def record(self, action: str, actor: str, actor_role: str, **what: Any) -> AuditEvent:
        """Append one event and return once it is on disk; SpoolError if it cannot be."""
        event = audit_event(action, actor, actor_role, self.source, **what)
        await self.spool.append(event.to_json())
        return event

    async def note(self, action: str, actor: str, actor_role: str, **what: Any) -> None:
        """``record``, for a change that has happened already: a spool that cannot take the
        event is logged (with the event), never raised into the change."""
        try:
            await self.record(action, actor, actor_role, **what)
        except SpoolError as exc:
            log.error("audit event %s by %s not spooled (%s): %s", action, actor, exc, what)

    def shipper(
        self,
        ingest_url: str,
        token: str | None,
        client: httpx.AsyncClient,
        metrics: ShipperMetrics | None = None,
    ) -> Shipper:
        """The shipper of this spool to billing's ``<ingest_url>/audit``, in batches billing takes
        (``MAX_BATCH_EVENTS``)."""
        from infermeter.shipper import Shipper

        return Shipper(
            self.spool,
            ingest_url,
            token,
            AUDIT_KIND,
            client,
            batch_size=MAX_BATCH_EVENTS,
            metrics=metrics,
            credential=self.credential,
        )


class AuditThread:
    """An ``AuditLog`` for a process without an event loop of its own (the dashboard's WSGI
    threads): the spool and its shipper run on a loop in a daemon thread, and ``record`` returns
    once the event is on disk (or the timeout passed, which is logged)."""

    def __init__(self, log: AuditLog, ingest_url: str | None, token: str | None) -> None:
        self.log = log
        self.ingest_url = ingest_url
        self.token = token
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="audit", daemon=True)
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None

    def start(self) -> None:
        """Open the spool and start shipping it, on the thread's loop."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    async def _start(self) -> None:
        self.log.open()
        if self.ingest_url:
            import httpx

            self._client = httpx.AsyncClient(timeout=30)
            shipper = self.log.shipper(self.ingest_url, self.token, self._client)
            self._tasks.append(asyncio.get_running_loop().create_task(shipper.run()))

    def record(
        self, action: str, actor: str, actor_role: str, timeout: float = 5.0, **what: Any
    ) -> None:
        """``AuditLog.note`` from any thread; waits at most ``timeout`` seconds for the disk."""
        future = asyncio.run_coroutine_threadsafe(
            self.log.note(action, actor, actor_role, **what), self._loop
        )
        try:
            future.result(timeout)
        except TimeoutError:
            log.error("audit event %s by %s not on disk within %g s", action, actor, timeout)

    def stop(self) -> None:
        """Stop shipping, make every event durable, close the spool, end the thread."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.log.close()
        if self._client is not None:
            await self._client.aclose()
