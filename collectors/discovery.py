"""Where engine targets come from at run time: billing's instance registry, or the Kubernetes API.

Each watcher keeps the current target set and hands every changed set to ``on_targets`` (the
collector swaps its engine sources); the target logic itself is in ``collectors.targets``.

``RegistryPoller`` asks billing ``GET /v1/instances?state=live`` every ``refresh_seconds``. While
billing cannot answer, the last set is kept: an outage of billing must not stop the scrapes.

``PodWatcher`` lists the vLLM pods by label selector (and, on a node, by ``spec.nodeName``),
then watches from the list's resourceVersion. Each ADDED, MODIFIED or DELETED event changes the
set; a watch that ends (the server's timeout) resumes from the last version seen (bookmarks
included); a 410 Gone, as a status or as an ERROR event, means that version is too old, so the
pods are listed again and the set replaced, dropping anything deleted meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from collectors.targets import (
    DiscoveryError,
    EngineTarget,
    PodRules,
    apply_pod_event,
    changes,
    listed_pods,
    registry_targets,
)
from infermeter.config import Replica
from infermeter.kubernetes import KubernetesApiError, bearer

__all__ = ["Gone", "OnTargets", "PodWatcher", "RegistryPoller"]

log = logging.getLogger("infermeter.collectors")

OnTargets = Callable[[Mapping[str, EngineTarget]], None]


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list the pods again."""


class _Watcher:
    """Holds the current set and reports each change once, with what came and went."""

    source = ""

    def __init__(self, on_targets: OnTargets) -> None:
        self.on_targets = on_targets
        self.targets: dict[str, EngineTarget] = {}
        self.updates = 0
        self._last_error: str | None = None

    def publish(self, targets: dict[str, EngineTarget]) -> None:
        """Replace the set; tell the collector when anything changed."""
        if targets == self.targets and self.updates:
            return
        added, removed = changes(self.targets, targets)
        if added or removed:
            log.info("%s: engine targets +%s -%s", self.source, added, removed)
        self.targets = targets
        self.updates += 1
        self.on_targets(targets)

    def failed(self, reason: str) -> None:
        """Log a failure once per distinct reason, so a long outage is one line, not thousands."""
        if reason != self._last_error:
            log.warning("%s: %s; keeping %d engine targets", self.source, reason, len(self.targets))
        self._last_error = reason

    def recovered(self) -> None:
        """Forget the last failure so the next one is logged."""
        self._last_error = None


class RegistryPoller(_Watcher):
    """Engine targets from billing's instance registry, asked every ``refresh_seconds``."""

    source = "registry"

    def __init__(
        self,
        billing_url: str,
        client: httpx.AsyncClient,
        replicas: Sequence[Replica],
        on_targets: OnTargets,
        token: str | None = None,
        refresh_seconds: float = 30.0,
        timeout_seconds: float = 5.0,
    ) -> None:
        super().__init__(on_targets)
        self.url = billing_url.rstrip("/") + "/v1/instances"
        self.client = client
        self.replicas = replicas
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self.refresh_seconds = refresh_seconds
        self.timeout_seconds = timeout_seconds

    async def poll_once(self) -> bool:
        """Ask the registry once; True when the set was read (and published)."""
        try:
            response = await self.client.get(
                self.url,
                params={"state": "live"},
                headers=self.headers,
                timeout=self.timeout_seconds,
            )
            if response.status_code != 200:
                raise DiscoveryError(f"{self.url}: HTTP {response.status_code}")
            targets = registry_targets(orjson.loads(response.content), self.replicas)
        except (httpx.HTTPError, orjson.JSONDecodeError, DiscoveryError) as exc:
            self.failed(f"{type(exc).__name__}: {exc}")
            return False
        self.recovered()
        self.publish(targets)
        return True

    async def run(self) -> None:
        """Poll forever."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.refresh_seconds)


class PodWatcher(_Watcher):
    """Engine targets from the vLLM pods of one namespace (and node), listed then watched."""

    source = "kubernetes"

    def __init__(
        self,
        api_url: str,
        namespace: str,
        label_selector: str,
        client: httpx.AsyncClient,
        replicas: Sequence[Replica],
        on_targets: OnTargets,
        *,
        rules: PodRules | None = None,
        node_name: str | None = None,
        token: str | None = None,
        token_file: Path | None = None,
        watch_timeout_seconds: int = 300,
        retry_seconds: float = 5.0,
    ) -> None:
        super().__init__(on_targets)
        self.url = f"{api_url.rstrip('/')}/api/v1/namespaces/{namespace}/pods"
        self.params = {"labelSelector": label_selector}
        if node_name:
            self.params["fieldSelector"] = f"spec.nodeName={node_name}"
        self.client = client
        self.replicas = replicas
        self.rules = rules or PodRules()
        self.token = token
        self.token_file = token_file
        self.watch_timeout_seconds = watch_timeout_seconds
        self.retry_seconds = retry_seconds
        self.lists = 0

    async def run(self) -> None:
        """List, then watch, forever; re-list on 410 Gone, retry after failures."""
        while True:
            try:
                version = await self.list()
                while True:
                    version = await self.watch(version)
            except Gone:
                log.info("kubernetes: pod watch expired (410 Gone); listing again")
                continue
            except (
                httpx.HTTPError,
                orjson.JSONDecodeError,
                DiscoveryError,
                KubernetesApiError,
            ) as exc:
                self.failed(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(self.retry_seconds)

    async def list(self) -> str:
        """List the pods, publish their targets, and return the list's resourceVersion."""
        response = await self.client.get(
            self.url, params=self.params, headers=self._auth(), timeout=30.0
        )
        _check(response)
        targets, version = listed_pods(orjson.loads(response.content), self.replicas, self.rules)
        self.lists += 1
        self.recovered()
        self.publish(targets)
        return version

    async def watch(self, version: str) -> str:
        """Follow the watch from ``version`` until the server ends it; the last version seen."""
        params = {
            **self.params,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout_seconds),
        }
        timeout = httpx.Timeout(30.0, read=self.watch_timeout_seconds + 30.0)
        request = self.client.build_request(
            "GET", self.url, params=params, headers=self._auth(), timeout=timeout
        )
        response = await self.client.send(request, stream=True)
        try:
            if response.status_code != 200:
                await response.aread()
            _check(response)
            async for line in response.aiter_lines():
                if line.strip():
                    version = self._event(orjson.loads(line), version)
        finally:
            await response.aclose()
        return version

    def _event(self, event: Any, version: str) -> str:
        kind = event.get("type") if isinstance(event, dict) else None
        obj = event.get("object") if isinstance(event, dict) else None
        if kind == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            if code == 410:
                raise Gone(str(obj.get("message", "")) if isinstance(obj, dict) else "")
            raise DiscoveryError(f"the watch failed: {str(obj)[:200]}")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise DiscoveryError(f"unexpected watch event type {kind!r}")
        meta = (obj.get("metadata") or {}) if isinstance(obj, dict) else {}
        if kind != "BOOKMARK":
            self.publish(apply_pod_event(self.targets, kind, obj, self.replicas, self.rules))
        seen = meta.get("resourceVersion")
        return seen if isinstance(seen, str) and seen else version

    def _auth(self) -> dict[str, str]:
        return bearer(self.token, self.token_file)


def _check(response: httpx.Response) -> None:
    if response.status_code == 410:
        raise Gone(response.text[:200])
    if response.status_code != 200:
        raise DiscoveryError(
            f"{response.request.url.path}: HTTP {response.status_code}: {response.text[:200]}"
        )
