"""Ship spooled records to the billing ingest API, and delete only what it acknowledged.

A batch is a spool segment's lines, POSTed to ``<ingest_url>/<kind>`` as an Arrow IPC stream:
the shipper reads them into typed columns (strictly, ``infermeter.wire``), so the central billing
service does not parse JSON. Lines that do not convert exactly are sent as they are on disk, as
NDJSON, for billing to check record by record; so are all lines when billing refuses the
Arrow stream. The ingest API is idempotent by record id, so a segment that was sent but whose
acknowledgement was lost is simply sent again. Retries back off exponentially with jitter (tenacity). A record
that billing rejects as invalid is never retried: it goes to ``<spool>/rejected.jsonl`` with the
reason, so nothing is dropped silently and nothing blocks the records behind it.

With a writer credential (``infermeter.writers``) the shipper sends as that writer. Lines it
sealed itself and that still verify are sent as above, without their seals: billing takes the
credential's word for them, since the same key made the seals. A batch holding any other line (a
line changed or written on disk by someone else, or a gone instance's lines that the collector
adopted) is sent as it is on disk, seals and all (``SEALED_NDJSON``), and billing checks every
seal itself. What billing quarantines it keeps, so those records are counted, not dead-lettered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson
from prometheus_client import CollectorRegistry, Counter
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from infermeter.records import KINDS
from infermeter.spool import Segment, SegmentReader
from infermeter.wire import ARROW_STREAM, NDJSON, encode_arrow
from infermeter.writers import SEALED_NDJSON, Credential, Sealer, strip_seal

__all__ = ["IngestRejectedError", "Segments", "Shipper", "ShipperMetrics", "last_shipment"]

log = logging.getLogger("infermeter.shipper")


class Segments(Protocol):
    """Where a shipper takes segments from: a live ``Spool``, or what a gone process left."""

    async def closed_segments(self) -> list[Segment]:
        """Segments ready to ship, oldest first."""
        ...

    def acknowledge(self, segment: Segment) -> None:
        """Billing has every record of ``segment``: delete it."""
        ...


class IngestRejectedError(Exception):
    """Billing refused the whole batch (bad token, bad request): retrying soon will not help."""


class _RetryableError(Exception):
    """Billing was unreachable, answered 5xx/429, or answered something that is not an answer."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class _TooLargeError(Exception):
    """Billing answered 413: the batch is over its limit, and must be split."""


# Why a round of shipping failed, for ``infermeter_shipper_failures_total{reason}``.
_UNREACHABLE, _UNAVAILABLE, _REFUSED = "unreachable", "unavailable", "refused"
_BAD_ANSWER, _FAULT = "bad_answer", "fault"


class ShipperMetrics:
    """What the shippers of one process did, on that process's /metrics (one per registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.failures = Counter(
            "infermeter_shipper_failures_total",
            "Rounds of shipping that failed, by reason (each is retried after a back-off).",
            ["kind", "reason"],
            registry=registry,
        )
        self.records = Counter(
            "infermeter_shipper_records_total",
            "Records billing acknowledged, by outcome (kept, dead-lettered as rejected, or "
            "quarantined by billing).",
            ["kind", "outcome"],
            registry=registry,
        )


class Shipper:
    """Moves closed spool segments to billing, one batch at a time.

    A batch is a whole segment by default (a spool rolls every 2 s, or at 50,000 records on a
    busy sidecar): billing spends more per record on small batches (per request, and per
    transaction when few arrive at once), so a busy sidecar sends large ones
    (``python -m bench.billing_scale --batch``; docs/benchmarks.md). A segment is read batch by
    batch, never whole, and a batch also ends at ``batch_bytes``, so a segment of unusually large
    records does not become one body of unbounded size. A batch that billing still finds too large
    (413) is split in halves until it fits; a single record it will not take is dead-lettered.

    Nothing ends the shipping loop: every failure is logged, counted (``ShipperMetrics``) and
    retried after a back-off.

    ``credential``: the writer's own (sent instead of ``token``); see the module's docstring.
    """

    def __init__(
        self,
        spool: Segments,
        url: str,
        token: str | None,
        kind: str,
        client: httpx.AsyncClient,
        batch_size: int = 50_000,
        interval_seconds: float = 1.0,
        arrow: bool = True,
        batch_bytes: int = 16 << 20,
        metrics: ShipperMetrics | None = None,
        max_backoff_seconds: float = 60.0,
        credential: Credential | None = None,
    ) -> None:
        self.spool = spool
        self.url = f"{url.rstrip('/')}/{kind}"
        self.kind = kind
        self.client = client
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self.interval_seconds = interval_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.record_kind = KINDS.get(kind)
        self.arrow = arrow and self.record_kind is not None
        self.id_field = self.record_kind.id_field if self.record_kind else "id"
        self.sealer = Sealer(credential) if credential is not None else None
        token = credential.token if credential is not None else token
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self.shipped = 0
        self.metrics = metrics or ShipperMetrics()
        # Since when billing has not taken a batch (None: it takes them), for the log.
        self._down_since: float | None = None

    async def run(self) -> None:
        """Ship forever; errors are logged, counted and retried with back-off, never raised."""
        failures = 0
        while True:
            failures = 0 if await self.ship_round() else failures + 1
            delay = self.interval_seconds * 2 ** min(failures, 16)
            await asyncio.sleep(min(delay, max(self.max_backoff_seconds, self.interval_seconds)))

    async def ship_round(self, max_wait_seconds: float = 30.0) -> bool:
        """One round of ``ship_once``; False when it failed (counted and logged, never raised)."""
        try:
            await self.ship_once(max_wait_seconds)
        except IngestRejectedError as exc:
            log.error("billing refused a %s batch: %s; will retry", self.kind, exc)
            self.metrics.failures.labels(self.kind, _REFUSED).inc()
            return False
        except _RetryableError:
            return False  # counted and logged by every attempt
        except asyncio.CancelledError:
            raise
        except Exception:  # the loop must outlive any bug or surprise: the records stay spooled
            log.exception("shipping %s records failed; will retry", self.kind)
            self.metrics.failures.labels(self.kind, _FAULT).inc()
            return False
        return True

    async def ship_once(self, max_wait_seconds: float = 30.0) -> int:
        """Ship every closed segment now; return how many records were acknowledged."""
        done = 0
        for segment in await self.spool.closed_segments():
            done += await self._ship_segment(segment, max_wait_seconds)
        return done

    async def _ship_segment(self, segment: Segment, max_wait_seconds: float) -> int:
        reader = SegmentReader(segment.path, self.batch_size, self.batch_bytes)
        batches = iter(reader)
        shipped = 0
        while (batch := await asyncio.to_thread(next, batches, None)) is not None:
            await self._deliver(segment.path.parent, batch, max_wait_seconds)
            shipped += len(batch)
        if reader.torn:
            log.error(
                "%s: %d torn line(s) skipped (written by a process that died mid-write)",
                segment.path,
                reader.torn,
            )
        self.spool.acknowledge(segment)
        self.shipped += shipped
        return shipped

    async def _deliver(self, directory: Path, batch: list[bytes], max_wait_seconds: float) -> None:
        """Send ``batch`` until billing answers; split it while billing finds it too large."""
        # Off the event loop: seals are checked, and Arrow parses without the GIL, while the
        # sidecar relays tokens.
        body, encoded, content_type = await asyncio.to_thread(self._prepare, batch)
        quarantined: list[dict[str, Any]] = []
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_RetryableError),
                wait=wait_exponential_jitter(multiplier=0.2, max=10.0),
                stop=stop_after_delay(max_wait_seconds),
                reraise=True,
            ):
                with attempt:
                    rejected, quarantined = await self._attempt(body, encoded, content_type)
        except _TooLargeError as exc:
            if len(batch) == 1:
                rid = self._record_id(_loads(batch[0])) or "#1"
                rejected = [{"id": rid, "reason": f"billing will not take the record: {exc}"}]
            else:
                half = len(batch) // 2
                log.warning(
                    "billing found a %s batch of %d records too large; splitting it",
                    self.kind,
                    len(batch),
                )
                await self._deliver(directory, batch[:half], max_wait_seconds)
                await self._deliver(directory, batch[half:], max_wait_seconds)
                return
        if rejected:
            self._dead_letter(directory, batch, rejected)
        if quarantined:
            log.error(
                "billing quarantined %d %s record(s), first: %s",
                len(quarantined),
                self.kind,
                quarantined[0].get("reason"),
            )
        kept = len(batch) - len(rejected) - len(quarantined)
        self.metrics.records.labels(self.kind, "kept").inc(max(kept, 0))
        self.metrics.records.labels(self.kind, "dead_lettered").inc(len(rejected))
        self.metrics.records.labels(self.kind, "quarantined").inc(len(quarantined))

    def _prepare(self, batch: list[bytes]) -> tuple[bytes, bytes | None, str]:
        """The batch as billing takes it: (NDJSON body, Arrow stream or None, NDJSON media type).

        With a credential: its own sealed lines, seals removed, when every line is one; else
        every line as it is on disk, for billing to check (``SEALED_NDJSON``). Without one, any
        seal is removed (billing then trusts the shared ingest token).
        """
        if self.sealer is not None:
            records = [self.sealer.vouches(line) for line in batch]
            if any(r is None for r in records):
                return b"".join(batch), None, SEALED_NDJSON
            body = b"\n".join(r for r in records if r is not None) + b"\n"
        else:
            body = b"".join(strip_seal(line) for line in batch)
        encoded = None
        if self.arrow and self.record_kind is not None:
            encoded = encode_arrow(self.record_kind, body)
        return body, encoded, NDJSON

    async def _attempt(
        self, ndjson: bytes, arrow: bytes | None, content_type: str = NDJSON
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """One ``_post``; a failure worth retrying is counted and logged before it is retried."""
        try:
            answer = await self._post(ndjson, arrow, content_type)
        except _RetryableError as exc:
            self.metrics.failures.labels(self.kind, exc.reason).inc()
            # Once per outage: a billing that is down for a minute would otherwise fill the log
            # with a line per retry of every shipper (the counter above still counts each).
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning(
                    "billing did not take a %s batch: %s; retrying until it does", self.kind, exc
                )
            else:
                log.debug("billing did not take a %s batch: %s; will retry", self.kind, exc)
            raise
        if self._down_since is not None:
            log.info(
                "billing takes %s batches again, after %.0f s",
                self.kind,
                time.monotonic() - self._down_since,
            )
            self._down_since = None
        return answer

    async def _post(
        self, ndjson: bytes, arrow: bytes | None, content_type: str = NDJSON
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Send the batch (as Arrow if it converted); the records billing rejected and quarantined."""
        if arrow is not None:
            response = await self._send(arrow, ARROW_STREAM)
            if response.status_code not in (400, 415):
                return self._answer(response)
            log.warning(
                "billing refused the %s batch as Arrow (HTTP %d: %s); sending NDJSON",
                self.kind,
                response.status_code,
                response.text[:200],
            )
        return self._answer(await self._send(ndjson, content_type))

    async def _send(self, content: bytes, content_type: str) -> httpx.Response:
        try:
            return await self.client.post(
                self.url, content=content, headers={**self.headers, "content-type": content_type}
            )
        except httpx.HTTPError as exc:
            raise _RetryableError(f"{type(exc).__name__}: {exc}", _UNREACHABLE) from exc

    @staticmethod
    def _answer(response: httpx.Response) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        status = response.status_code
        if status >= 500 or status == 429:
            raise _RetryableError(f"HTTP {status}", _UNAVAILABLE)
        if status == 413:
            raise _TooLargeError(f"HTTP 413: {response.text[:200]}")
        if status >= 400:
            raise IngestRejectedError(f"HTTP {status}: {response.text[:200]}")
        # Anything but {"rejected": [{"id", "reason"}...]} is not billing's answer (a proxy's
        # page, a truncated body): the batch's fate is unknown, so it is sent again.
        try:
            answer = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            raise _RetryableError(
                f"HTTP {status} with a body that is not JSON", _BAD_ANSWER
            ) from None
        rejected = _records(answer, "rejected")
        quarantined = _records(answer, "quarantined")
        if rejected is None or quarantined is None:
            raise _RetryableError(
                f"HTTP {status} with a body that is not an ingest answer", _BAD_ANSWER
            )
        return rejected, quarantined

    def _record_id(self, record: Any) -> Any:
        return record.get(self.id_field) if isinstance(record, dict) else None

    def _dead_letter(
        self, directory: Path, batch: list[bytes], rejected: list[dict[str, Any]]
    ) -> None:
        """Keep the rejected lines with their reasons; a record without an id is named ``#<line>``."""
        reasons = {r.get("id"): r.get("reason") for r in rejected}
        with (directory / "rejected.jsonl").open("ab") as fh:
            for pos, line in enumerate(batch, start=1):
                record = _loads(line)
                rid = self._record_id(record)
                if rid not in reasons:
                    rid = f"#{pos}"
                if rid in reasons:
                    fh.write(orjson.dumps({"reason": reasons[rid], "record": record}) + b"\n")
        log.error(
            "billing rejected %d record(s); kept in %s/rejected.jsonl", len(reasons), directory
        )


def _records(answer: Any, key: str) -> list[dict[str, Any]] | None:
    """``answer[key]`` when it is a list of objects (absent: none); None when it is not."""
    found = answer.get(key, []) if isinstance(answer, dict) else None
    if not isinstance(found, list) or not all(isinstance(r, dict) for r in found):
        return None
    return found


def _loads(line: bytes) -> Any:
    """A line's JSON value, or the line as text when it is not JSON."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return line.decode("utf-8", "replace").rstrip("\n")


async def last_shipment(shippers: Iterable[Shipper], seconds: float) -> None:
    """Ship the spools' closed segments once more, for at most ``seconds`` in all.

    On the way out of a process: what billing does not take in time stays on disk for the next
    start (or for the collector that adopts a gone sidecar's spool).
    """
    deadline = asyncio.get_running_loop().time() + seconds
    for shipper in shippers:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(shipper.ship_round(max_wait_seconds=left), left)
