"""A central billing pulling its clusters' closed months (``billing.role: central``).

Each round asks every configured cluster for its closed months and their digests, and fetches
only the months whose digest differs from the copy held; a closed month never changes, so a
round over an unchanged cluster writes nothing but the time it was pulled. A request that fails
on the network or with a 5xx is tried again with exponential backoff (tenacity); a cluster that
stays unreachable is marked stale (since its first failure) and tried again the next round,
while what was pulled of it stays and is served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import duckdb
import httpx
import orjson
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from billing import federation_store as store
from billing.federation import FederationError, parse_payload
from billing.ledger import Ledger
from infermeter.config import BillingSettings, FederatedCluster, process_environment
from infermeter.months import check_month

__all__ = ["ClusterReport", "Puller"]

log = logging.getLogger("infermeter.billing")


class _TooLarge(FederationError):
    """An answer longer than ``billing.federation.max_body_bytes``."""


def _retryable(exc: BaseException) -> bool:
    """Network failures and a cluster's 5xx are worth another try; a 4xx (a refused
    credential) or a malformed answer is not: it would be refused again."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500
    return isinstance(exc, httpx.TransportError)


@dataclass(slots=True)
class ClusterReport:
    """What one round did with one cluster."""

    cluster: str
    fetched: list[str] = field(default_factory=list)
    unchanged: int = 0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The pull route's answer for this cluster."""
        return {
            "cluster": self.cluster,
            "fetched": self.fetched,
            "unchanged": self.unchanged,
            "error": self.error,
        }


class Puller:
    """Pulls every cluster of ``settings.clusters`` into ``ledger``; one round at a time."""

    def __init__(
        self,
        ledger: Ledger,
        settings: BillingSettings,
        environ: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.ledger = ledger
        self.settings = settings
        env = process_environment() if environ is None else environ
        self._tokens = {c.name: env.get(c.token_env, "") for c in settings.clusters}
        self._transport = transport
        self._round = asyncio.Lock()
        self.started_at = time.time()

    async def run(self) -> None:
        """A round now, then one every ``billing.federation.interval_seconds``, until cancelled.

        A round the ledger fails (a DuckDB error: disk full) is logged and the timer goes on: what
        it had not committed is pulled again at the next round.
        """
        while True:
            try:
                await self.pull()
            except duckdb.Error as exc:
                log.warning(
                    "billing: federation round failed, tried again in %.0f s: %s",
                    self.settings.federation.interval_seconds,
                    exc,
                )
            await asyncio.sleep(self.settings.federation.interval_seconds)

    async def pull(self) -> list[ClusterReport]:
        """One round over every cluster (concurrently); rounds asked for at once run in turn."""
        async with self._round:
            f = self.settings.federation
            async with httpx.AsyncClient(
                timeout=f.timeout_seconds, transport=self._transport
            ) as client:
                return list(
                    await asyncio.gather(
                        *(self._cluster(client, c) for c in self.settings.clusters)
                    )
                )

    async def _cluster(self, client: httpx.AsyncClient, cluster: FederatedCluster) -> ClusterReport:
        report = ClusterReport(cluster.name)
        try:
            await self._pull_cluster(client, cluster, report)
        except (httpx.HTTPError, FederationError) as exc:
            report.error = _describe(exc)
            log.warning(
                "billing: federation: cluster %s not pulled, tried again in %.0f s: %s",
                cluster.name,
                self.settings.federation.interval_seconds,
                report.error,
            )
            await asyncio.to_thread(
                store.mark_failed, self.ledger, cluster.name, time.time(), report.error
            )
            return report
        await asyncio.to_thread(store.mark_pulled, self.ledger, cluster.name, time.time())
        return report

    async def _pull_cluster(
        self, client: httpx.AsyncClient, cluster: FederatedCluster, report: ClusterReport
    ) -> None:
        token = self._tokens[cluster.name]
        if not token:
            raise FederationError(f"${cluster.token_env} (its federation token) is not set")
        base = cluster.url.rstrip("/")
        listing = await self._get(client, f"{base}/v1/federation/months", token)
        if listing.get("cluster") != cluster.name:
            raise FederationError(f"the cluster at {base} says it is {listing.get('cluster')!r}")
        held = await asyncio.to_thread(store.held_digests, self.ledger, cluster.name)
        for entry in listing.get("months", []):
            month, digest = _listed(entry)
            if held.get(month) == digest:
                report.unchanged += 1
                continue
            body = await self._get(client, f"{base}/v1/federation/months/{month}", token)
            payload = parse_payload(body, cluster.name, month)
            if payload.digest != digest:
                raise FederationError(f"month {month} changed while it was pulled")
            await asyncio.to_thread(store.replace_month, self.ledger, payload, time.time())
            report.fetched.append(month)

    async def _get(self, client: httpx.AsyncClient, url: str, token: str) -> dict[str, Any]:
        f = self.settings.federation
        retrying = AsyncRetrying(
            stop=stop_after_attempt(f.attempts),
            wait=wait_exponential(multiplier=f.backoff_seconds, max=60),
            retry=retry_if_exception(_retryable),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await _bounded_json(client, url, token, f.max_body_bytes)
        raise AssertionError("unreachable: tenacity reraises the last failure")


async def _bounded_json(
    client: httpx.AsyncClient, url: str, token: str, limit: int
) -> dict[str, Any]:
    """The JSON object at ``url``, read no further than ``limit`` bytes."""
    headers = {"Authorization": f"Bearer {token}"}
    async with client.stream("GET", url, headers=headers) as response:
        response.raise_for_status()
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limit:
                raise _TooLarge(f"{url}: the answer is longer than {limit} bytes")
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise FederationError(f"{url}: the answer is not JSON") from None
    if not isinstance(parsed, dict):
        raise FederationError(f"{url}: the answer is not a JSON object")
    return parsed


def _listed(entry: Any) -> tuple[str, str]:
    """A listing's (month, digest); FederationError when it is not one."""
    try:
        return check_month(str(entry["month"])), str(entry["digest"])
    except (KeyError, TypeError, ValueError):
        raise FederationError(f"a month listed as {entry!r}") from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"{exc.request.url} answered {exc.response.status_code}"
    if isinstance(exc, httpx.TransportError):
        return f"{type(exc).__name__}: {str(exc) or 'no answer'}"
    return str(exc)
