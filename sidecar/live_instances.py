"""How many sidecars share a fleet-wide limit, from billing's instance registry.

When the shared limit store is down and the policy is fail_open, each sidecar serves the limit
divided by this number, so the fleet as a whole stays near the limit. The count is read in the
background (``GET /v1/instances?state=live``) and kept when a read fails: a stale count is better
than none, and 1 (the whole limit per sidecar) is what is left when billing was never reached.

The registry is told of instances by the instances themselves, so its count is not trusted past
what the configuration allows (``instance_bound``, from ``infermeter.fleet_bound``): 250 forged
live instances must not divide every team's limit by 250. The bound errs high (a loose bound only
weakens that protection; a tight one would give a real fleet more than its share).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from infermeter.fleet_bound import instance_bound

__all__ = ["LiveInstances", "count_live", "instance_bound"]

log = logging.getLogger("infermeter.sidecar")


def count_live(body: Any, replica: str | None) -> int | None:
    """Live instances in a registry answer (of ``replica`` only, when given); None if malformed."""
    if not isinstance(body, dict) or not isinstance(body.get("instances"), list):
        return None
    rows = [
        r for r in body["instances"] if isinstance(r, dict) and r.get("state", "live") == "live"
    ]
    if replica is not None:
        rows = [r for r in rows if r.get("replica") == replica]
    return len(rows)


class LiveInstances:
    """The live instance count, refreshed every ``refresh_seconds`` while ``run`` runs."""

    def __init__(
        self,
        url: str | None,
        token: str | None,
        replica: str | None,
        refresh_seconds: float,
        client: httpx.AsyncClient | None = None,
        max_count: int | None = None,
    ) -> None:
        """``replica``: count only that replica group's instances (limits per model group).
        ``max_count``: the most the count may be (``instance_bound``); None for no bound.
        """
        self.url = None if url is None else url.rstrip("/") + "/v1/instances"
        self.max_count = max_count
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self.replica = replica
        self.refresh_seconds = refresh_seconds
        self.client = client or httpx.AsyncClient(timeout=5.0)
        self.count = 1

    async def refresh(self) -> None:
        """Read the registry once; on failure keep the last count."""
        if self.url is None:
            return
        try:
            r = await self.client.get(self.url, params={"state": "live"}, headers=self.headers)
            r.raise_for_status()
            n = count_live(r.json(), self.replica)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("instance registry unreadable, keeping %d live: %s", self.count, exc)
            return
        if n is None:
            log.warning("instance registry answer has no instances list; keeping %d", self.count)
            return
        self.count = self.clamped(n)

    def clamped(self, n: int) -> int:
        """``n`` live instances as the count to use: at least 1, at most ``max_count``."""
        if self.max_count is not None and n > self.max_count:
            log.warning(
                "instance registry lists %d live instances, more than the %d the "
                "configuration allows (scaling.max_replicas per replica group); using %d",
                n,
                self.max_count,
                self.max_count,
            )
            return self.max_count
        return max(1, n)

    async def run(self) -> None:
        """Refresh until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_seconds)

    async def close(self) -> None:
        """Close the HTTP client."""
        await self.client.aclose()
