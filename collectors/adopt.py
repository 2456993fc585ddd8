"""Adopt orphan spools: ship what sidecars that are gone left behind on this node.

A sidecar holds the lock of its spool directory while it runs (``infermeter.spooldir``), and the
kernel releases it when the process ends, kill -9 included. When a pod is removed, its spool
directory stays on the node (a hostPath), with the records it had not shipped yet: usage of
responses its clients saw complete, and its lifetime events. Each round, the node's collector
tries the lock of every directory under the spool root; one it can take is an orphan, and it
ships what the directory holds (closed and open segments alike, with the same shipper the
sidecar uses), then removes the directory once nothing is left. Record ids make shipping twice
harmless: a segment the sidecar had sent but not yet deleted is simply acknowledged again.

The lock is let go between rounds, so a pod restarted with the same UID gets its directory back
(it waits for the lock, ``sidecar.lifetime.LOCK_WAIT_SECONDS``) and ships the rest itself. For
the same reason a directory is not removed while its gateway nonces (``sidecar.nonces``) were
written less than ``keep_nonces_seconds`` ago: a sidecar restarted within that time must still
refuse the signed requests it served.

What to do with a directory, once locked, is decided by ``plan`` alone, from a ``Listing`` of it;
the file system and HTTP live in ``Adopter``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from infermeter.audit_spool import AUDIT_DIR
from infermeter.journal_files import JOURNAL_DIR, journal_files, recover
from infermeter.shipper import Shipper, ShipperMetrics
from infermeter.spool import RESHIP, Segment, Spool
from infermeter.spooldir import (
    BUDGET_OVERRIDES,
    GATEWAY_NONCES,
    INSTANCES,
    ISSUED_KEYS,
    LOCK,
    SpoolLock,
)
from infermeter.writers import Credential, Sealer

__all__ = [
    "Action",
    "Adopter",
    "AdoptionMetrics",
    "Leftovers",
    "Listing",
    "candidates",
    "listing",
    "plan",
]

log = logging.getLogger("infermeter.collectors")

# Each spool of an instance directory and the kind its records are shipped as.
_KINDS = (("", "usage"), (INSTANCES, "instances"), (BUDGET_OVERRIDES, "budget_overrides"))


class Action(StrEnum):
    """What a round does with a spool directory whose lock it holds."""

    SHIP = "ship"  # it holds segments: send them to billing
    REMOVE = "remove"  # nothing is left: remove it
    KEEP = "keep"  # nothing to ship, but files an operator should read (rejected records)


@dataclass(frozen=True, slots=True)
class Listing:
    """What an instance's spool directory holds, by kind of file."""

    usage_segments: int = 0
    instance_segments: int = 0
    # Admission journals a killed sidecar left: its requests in flight, not recorded yet.
    journals: int = 0
    # Files that are neither segments nor the lock: rejected.jsonl, or anything unknown.
    other_files: tuple[str, ...] = ()
    # Budget overrides an admin granted through the sidecar, not shipped yet.
    override_segments: int = 0
    # Gateway nonces a restarted sidecar would still need (written within the time asked).
    recent_nonces: bool = False


def candidates(names: Iterable[str]) -> list[str]:
    """The entries of the spool root that may be instance directories, in a stable order."""
    return sorted(n for n in names if not n.startswith("."))


def plan(found: Listing) -> Action:
    """Ship what there is; remove a directory left with nothing; keep one with dead letters,
    or with gateway nonces its sidecar, restarted, would still need."""
    if found.usage_segments or found.instance_segments or found.override_segments or found.journals:
        return Action.SHIP
    return Action.KEEP if found.other_files or found.recent_nonces else Action.REMOVE


def listing(directory: Path, keep_nonces_seconds: float = 0.0) -> Listing:
    """Look at an instance's spool directory (without reading the segments); gateway nonces
    written within ``keep_nonces_seconds`` are recent."""
    usage = journals = 0
    segments = {INSTANCES: 0, BUDGET_OVERRIDES: 0}
    others: list[str] = []
    recent = False
    for entry in directory.iterdir():
        if entry.name.startswith("seg-") and entry.name.endswith(".jsonl"):
            usage += 1
        elif entry.name.startswith("acked-") or entry.name == RESHIP:
            continue  # acknowledged already: kept for a restore, gone with the directory
        elif entry.name == GATEWAY_NONCES and entry.is_dir():
            since = time.time() - keep_nonces_seconds
            recent = any(p.stat().st_mtime > since for p in entry.iterdir())
        elif entry.name == JOURNAL_DIR and entry.is_dir():
            journals = len(journal_files(directory))
        elif entry.name in segments and entry.is_dir():
            segments[entry.name] = sum(1 for _ in entry.glob("seg-*.jsonl"))
            others += [
                f"{entry.name}/{p.name}" for p in entry.iterdir() if not p.name.startswith("seg-")
            ]
        elif entry.name == AUDIT_DIR and entry.is_dir():
            # Audit events are shipped by their own service only: a gone sidecar's unshipped ones
            # keep the directory for an operator; an empty audit spool is nothing left.
            others += [f"{entry.name}/{p.name}" for p in entry.iterdir() if p.name != LOCK]
        elif entry.name not in (LOCK, ISSUED_KEYS):  # the issued keys are a cache of billing's
            others.append(entry.name)
    return Listing(
        usage,
        segments[INSTANCES],
        journals,
        tuple(sorted(others)),
        segments[BUDGET_OVERRIDES],
        recent,
    )


class Leftovers:
    """The segments a process that is gone left in one spool: all closed, none growing.

    Unlike ``Spool.open``, listing them reads no record (a spool may hold a gigabyte), so the
    record counts are unknown (0); the shipper reads each segment in batches, off the event loop.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._segments: list[Segment] | None = None

    async def closed_segments(self) -> list[Segment]:
        """Every segment of the directory, oldest first (listed once)."""
        if self._segments is None:
            self._segments = await asyncio.to_thread(_segments, self.directory)
        return list(self._segments)

    def acknowledge(self, segment: Segment) -> None:
        """Billing has every record of ``segment``: delete it."""
        segment.path.unlink(missing_ok=True)
        if self._segments is not None:
            self._segments.remove(segment)


def _segments(directory: Path) -> list[Segment]:
    return [Segment(p, 0, p.stat().st_size) for p in sorted(directory.glob("seg-*.jsonl"))]


class AdoptionMetrics:
    """What adoption did, on the collector's /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.adopted = Counter(
            "infermeter_collector_spools_adopted_total",
            "Spool directories of sidecars that were gone, taken over by this collector.",
            registry=registry,
        )
        self.records = Counter(
            "infermeter_collector_adopted_records_total",
            "Records billing acknowledged from adopted spools, by kind (usage, instances).",
            ["kind"],
            registry=registry,
        )
        self.interrupted = Counter(
            "infermeter_collector_adopted_interrupted_total",
            "Requests a sidecar that is gone left in its journal, recorded from it (with the "
            "ending kept in their slot, else as interrupted).",
            registry=registry,
        )
        self.orphans = Gauge(
            "infermeter_collector_orphan_spools",
            "Spool directories without a live sidecar that still held records after the last round.",
            registry=registry,
        )


class Adopter:
    """Each round: lock every unlocked spool directory under ``root``, ship it, remove it."""

    def __init__(
        self,
        root: Path,
        ingest_url: str,
        token: str | None,
        client: httpx.AsyncClient,
        metrics: AdoptionMetrics,
        shipper_metrics: ShipperMetrics | None = None,
        interval_seconds: float = 10.0,
        max_wait_seconds: float = 5.0,
        exclude: Iterable[Path] = (),
        keep_nonces_seconds: float = 0.0,
        credential: Credential | None = None,
    ) -> None:
        """``keep_nonces_seconds``: how long after its last write a sidecar's gateway nonces
        keep its directory (twice the gateway's skew window: see the module docstring).
        ``credential``: the collector's own; the gone sidecar's lines keep the instance's seals,
        which billing checks, and the requests recovered from its journal are sealed with this."""
        self.root = root
        self.ingest_url = ingest_url
        self.token = token
        self.client = client
        self.metrics = metrics
        self.shipper_metrics = shipper_metrics or ShipperMetrics()
        self.interval_seconds = interval_seconds
        # Per batch: billing down ends the round quickly, so that the lock is let go.
        self.max_wait_seconds = max_wait_seconds
        self.exclude = frozenset(p.resolve() for p in exclude)
        self.keep_nonces_seconds = keep_nonces_seconds
        self.credential = credential
        self._adopted: set[str] = set()

    async def run(self) -> None:
        """Adopt every ``interval_seconds`` forever; a failing round is logged and retried."""
        while True:
            try:
                await self.adopt_once()
            except OSError as exc:  # the root unreadable, a disk error: the next round retries
                log.error("adopting spools under %s failed: %s", self.root, exc)
            await asyncio.sleep(self.interval_seconds)

    async def adopt_once(self) -> int:
        """One round over the spool root; returns how many records billing acknowledged."""
        if not self.root.is_dir():
            return 0
        shipped = orphans = 0
        present = set()
        for name in candidates(p.name for p in self.root.iterdir()):
            directory = self.root / name
            present.add(name)
            if not directory.is_dir() or directory.resolve() in self.exclude:
                continue
            lock = SpoolLock(directory)
            if not lock.try_acquire(create=False):
                continue  # its sidecar runs (or it vanished meanwhile)
            try:
                done, left = await self._adopt(name, directory, lock)
            finally:
                lock.release()
            shipped += done
            orphans += left
        self._adopted &= present
        self.metrics.orphans.set(orphans)
        return shipped

    async def _adopt(self, name: str, directory: Path, lock: SpoolLock) -> tuple[int, int]:
        """Ship and remove one locked directory; (records shipped, 1 if records are left)."""
        action = plan(listing(directory, self.keep_nonces_seconds))
        shipped = 0
        if action is Action.SHIP:
            if name not in self._adopted:
                self._adopted.add(name)
                self.metrics.adopted.inc()
                log.warning("adopting the spool of a sidecar that is gone: %s", directory)
            await self._recover(directory)
            shipped = await self._ship(directory)
            action = plan(listing(directory, self.keep_nonces_seconds))
        if action is Action.REMOVE and lock.remove_directory():
            log.info("spool %s shipped and removed", directory)
            self._adopted.discard(name)
        return shipped, int(action is Action.SHIP)

    async def _recover(self, directory: Path) -> None:
        """Record what the dead sidecar left in its journal, in its spool: each request's ending
        as its slot kept it (it ended, its record was not yet written), else interrupted.

        The sidecar would have done it at its next start; a sidecar that does not come back
        leaves it to the adopter, which holds the directory's lock and so is its one writer.
        """
        paths = journal_files(directory)
        if not paths:
            return
        spool = Spool(directory, sealer=Sealer(self.credential) if self.credential else None)
        spool.open()
        try:
            made = await recover(paths, spool)
        finally:
            await spool.close()
        if made:
            self.metrics.interrupted.inc(len(made))

    async def _ship(self, directory: Path) -> int:
        """Ship each spool of ``directory``; stops at the first round billing did not take."""
        shipped = 0
        for sub, kind in _KINDS:
            path = directory / sub if sub else directory
            if not any(path.glob("seg-*.jsonl")):
                continue
            shipper = Shipper(
                Leftovers(path),
                self.ingest_url,
                self.token,
                kind,
                self.client,
                metrics=self.shipper_metrics,
                credential=self.credential,
            )
            ok = await shipper.ship_round(self.max_wait_seconds)
            shipped += shipper.shipped
            self.metrics.records.labels(kind).inc(shipper.shipped)
            if not ok:
                break
        return shipped
