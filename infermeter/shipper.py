"""Ship spooled records to the billing ingest API, and delete only what it acknowledged.

A batch is a spool segment's lines, POSTed to ``<ingest_url>/<kind>`` as an Arrow IPC stream:
the shipper reads them into typed columns (strictly, ``infermeter.wire``), so the central billing
service does not parse JSON. Lines that do not convert exactly are sent as they are on disk, as
NDJSON, for billing to check record by record; so are all lines when billing refuses the
Arrow stream. The ingest API is idempotent by record id, so a segment that was sent but whose
acknowledgement was lost is simply sent again. Retries back off exponentially with jitter (tenacity). A record
that billing rejects as invalid is never retried: it goes to ``<spool>/rejected.jsonl`` with the
reason, so nothing is dropped silently and nothing blocks the records behind it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import orjson
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from infermeter.records import KINDS
from infermeter.spool import Segment, Spool, read_lines
from infermeter.wire import ARROW_STREAM, NDJSON, encode_arrow

__all__ = ["IngestRejectedError", "Shipper"]

log = logging.getLogger("infermeter.shipper")


class IngestRejectedError(Exception):
    """Billing refused the whole batch (bad token, bad request): retrying will not help."""


class _RetryableError(Exception):
    """Billing was unreachable or answered 5xx/429."""


class Shipper:
    """Moves closed spool segments to billing, one batch at a time.

    A batch is a whole segment by default (a spool rolls every 2 s, or at 50,000 records on a
    busy sidecar): billing spends more per record on small batches (per request, and per
    transaction when few arrive at once), so a busy sidecar sends large ones
    (``python -m bench.billing_scale --batch``; docs/benchmarks.md).
    """

    def __init__(self, spool: Spool, url: str, token: str | None, kind: str, client: httpx.AsyncClient,
                 batch_size: int = 50_000, interval_seconds: float = 1.0, arrow: bool = True) -> None:  # fmt: skip
        self.spool = spool
        self.url = f"{url.rstrip('/')}/{kind}"
        self.kind = kind
        self.client = client
        self.batch_size = batch_size
        self.interval_seconds = interval_seconds
        self.record_kind = KINDS.get(kind)
        self.arrow = arrow and self.record_kind is not None
        self.id_field = self.record_kind.id_field if self.record_kind else "id"
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self.shipped = 0

    async def run(self) -> None:
        """Ship forever; errors are logged and retried, never raised."""
        while True:
            try:
                await self.ship_once()
            except IngestRejectedError as exc:
                log.error("billing refused a %s batch: %s; will retry later", self.kind, exc)
            except _RetryableError as exc:
                log.warning("billing unreachable for %s: %s", self.kind, exc)
            await asyncio.sleep(self.interval_seconds)

    async def ship_once(self, max_wait_seconds: float = 30.0) -> int:
        """Ship every closed segment now; return how many records were acknowledged."""
        done = 0
        for segment in await self.spool.closed_segments():
            done += await self._ship_segment(segment, max_wait_seconds)
        return done

    async def _ship_segment(self, segment: Segment, max_wait_seconds: float) -> int:
        lines, torn = read_lines(segment.path)
        if torn:
            log.error(
                "%s: %d torn line(s) skipped (written by a process that died mid-write)",
                segment.path,
                torn,
            )
        for start in range(0, len(lines), self.batch_size):
            batch = lines[start : start + self.batch_size]
            body = b"".join(batch)
            # Off the event loop: Arrow parses without the GIL while the sidecar relays tokens.
            encoded = None
            if self.arrow and self.record_kind is not None:
                encoded = await asyncio.to_thread(encode_arrow, self.record_kind, body)
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_RetryableError),
                wait=wait_exponential_jitter(multiplier=0.2, max=10.0),
                stop=stop_after_delay(max_wait_seconds),
                reraise=True,
            ):
                with attempt:
                    rejected = await self._post(body, encoded)
            if rejected:
                self._dead_letter(segment.path.parent, batch, rejected)
        self.spool.acknowledge(segment)
        self.shipped += len(lines)
        return len(lines)

    async def _post(self, ndjson: bytes, arrow: bytes | None) -> list[dict[str, Any]]:
        """Send the batch (as Arrow if it converted) and return the records billing rejected."""
        if arrow is not None:
            response = await self._send(arrow, ARROW_STREAM)
            if response.status_code not in (400, 415):
                return self._answer(response)
            log.warning("billing refused the %s batch as Arrow (HTTP %d: %s); sending NDJSON",
                        self.kind, response.status_code, response.text[:200])  # fmt: skip
        return self._answer(await self._send(ndjson, NDJSON))

    async def _send(self, content: bytes, content_type: str) -> httpx.Response:
        try:
            return await self.client.post(
                self.url, content=content, headers={**self.headers, "content-type": content_type}
            )
        except httpx.HTTPError as exc:
            raise _RetryableError(f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _answer(response: httpx.Response) -> list[dict[str, Any]]:
        if response.status_code >= 500 or response.status_code == 429:
            raise _RetryableError(f"HTTP {response.status_code}")
        if response.status_code >= 400:
            raise IngestRejectedError(f"HTTP {response.status_code}: {response.text[:200]}")
        rejected: list[dict[str, Any]] = orjson.loads(response.content).get("rejected", [])
        return rejected

    def _dead_letter(
        self, directory: Path, batch: list[bytes], rejected: list[dict[str, Any]]
    ) -> None:
        """Keep the rejected lines with their reasons; a record without an id is named ``#<line>``."""
        reasons = {r.get("id"): r.get("reason") for r in rejected}
        with (directory / "rejected.jsonl").open("ab") as fh:
            for pos, line in enumerate(batch, start=1):
                record = _loads(line)
                rid = None
                if isinstance(record, dict):
                    rid = record.get(self.id_field)
                if rid not in reasons:
                    rid = f"#{pos}"
                if rid in reasons:
                    fh.write(orjson.dumps({"reason": reasons[rid], "record": record}) + b"\n")
        log.error(
            "billing rejected %d record(s); kept in %s/rejected.jsonl", len(reasons), directory
        )


def _loads(line: bytes) -> Any:
    """A line's JSON value, or the line as text when it is not JSON."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return line.decode("utf-8", "replace").rstrip("\n")
