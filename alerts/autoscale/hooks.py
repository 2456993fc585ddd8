"""Where scaling decisions go: Prometheus gauges, a signed webhook, a Deployment's scale.

Each output is small and separate. ``ScalingGauges`` is read by KEDA's Prometheus scaler or an
HPA external metric; ``WebhookHook`` and ``KubernetesScaleHook`` push a decision somewhere. The
pushing hooks retry transient failures (connection errors, 5xx, 429) with exponential back-off
and jitter, and give up after ``max_wait_seconds`` (a hard deadline on the whole delivery, since
httpx's timeout bounds each read, not the answer), so one stuck receiver cannot stall the loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import httpx
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from alerts.autoscale.policy import Decision
from infermeter import kubernetes
from infermeter.kubernetes import SERVICE_ACCOUNT_DIR, KubernetesApiError, bearer

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Hook",
    "HookError",
    "KubernetesScaleHook",
    "ScalingGauges",
    "WebhookHook",
    "in_cluster_api",
    "sign",
    "webhook_body",
]

TIMESTAMP_HEADER = "x-infermeter-timestamp"
SIGNATURE_HEADER = "x-infermeter-signature"


class HookError(Exception):
    """A hook's receiver refused the decision or stayed unreachable past the retry budget."""


class _TransientError(Exception):
    """Unreachable, 5xx or 429: worth another try."""


class Hook(Protocol):
    """Anything that takes a decision somewhere."""

    name: ClassVar[str]

    async def publish(self, decision: Decision) -> None:
        """Deliver ``decision``; raise ``HookError`` when it could not be delivered."""


class ScalingGauges:
    """``infermeter_desired_replicas{model}`` and ``infermeter_current_replicas{model}``, and
    the autoscaler's own health: unread pages, failed ticks, the last tick's time, hook failures."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.desired = Gauge(
            "infermeter_desired_replicas",
            "Replicas the autoscaling policy wants for the model now.",
            ["model"],
            registry=self.registry,
        )
        self.current = Gauge(
            "infermeter_current_replicas",
            "Replicas of the model serving now, as the autoscaler observed them.",
            ["model"],
            registry=self.registry,
        )
        self.unread_pages = Gauge(
            "infermeter_autoscale_unread_pages",
            "Pages (collector and sidecars) the last tick could not fetch or read.",
            registry=self.registry,
        )
        self.tick_failures = Counter(
            "infermeter_autoscale_tick_failures",
            "Ticks that failed with an error nobody foresaw; the next tick tries again.",
            registry=self.registry,
        )
        self.last_tick = Gauge(
            "infermeter_autoscale_last_tick_timestamp_seconds",
            "When the policy last decided: the desired counts served are from then.",
            registry=self.registry,
        )
        self.hook_errors = Gauge(
            "infermeter_autoscale_hook_failures",
            "Consecutive failed deliveries of the last decision, by hook.",
            ["hook"],
            registry=self.registry,
        )

    def update(self, decisions: Mapping[str, Decision]) -> None:
        """Set both gauges from this tick's decisions."""
        for model, d in decisions.items():
            self.desired.labels(model=model).set(d.desired)
            self.current.labels(model=model).set(d.current)


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    """Hex HMAC-SHA256 of ``"<timestamp>." + body``; the receiver recomputes and compares."""
    return hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def webhook_body(decision: Decision) -> bytes:
    """The JSON the webhook receives."""
    return orjson.dumps(
        {
            "model": decision.model,
            "current": decision.current,
            "desired": decision.desired,
            "reasons": list(decision.reasons),
            "timestamp": decision.time,
        }
    )


async def _send_with_retries(
    client: httpx.AsyncClient, request: httpx.Request, max_wait_seconds: float
) -> httpx.Response:
    """Send ``request``, retrying transient failures, for at most ``max_wait_seconds`` in all.

    The retry budget alone is checked only between attempts, and httpx's timeout bounds each
    read, not the answer: a receiver dripping its body a byte a second would hold one attempt
    for as long as it liked. So the whole delivery has a hard deadline.
    """
    failures: list[str] = []
    try:
        async with asyncio.timeout(max_wait_seconds):
            return await _attempts(client, request, max_wait_seconds, failures)
    except TimeoutError:
        last = f" (last attempt: {failures[-1]})" if failures else ""
        raise _TransientError(f"no answer within {max_wait_seconds:g} s{last}") from None


async def _attempts(
    client: httpx.AsyncClient,
    request: httpx.Request,
    max_wait_seconds: float,
    failures: list[str],
) -> httpx.Response:
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(_TransientError),
        wait=wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.2),
        stop=stop_after_delay(max_wait_seconds),
        reraise=True,
    ):
        with attempt:
            try:
                response = await client.send(request)
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                raise _TransientError(failures[-1]) from exc
            if response.status_code >= 500 or response.status_code == 429:
                failures.append(f"HTTP {response.status_code}")
                raise _TransientError(failures[-1])
    if response.status_code >= 400:
        raise HookError(
            f"{request.url} answered HTTP {response.status_code}: {response.text[:200]}"
        )
    return response


@dataclass
class WebhookHook:
    """POSTs each decision as JSON, signed with HMAC-SHA256 over timestamp and body.

    Headers: ``x-infermeter-timestamp`` (the decision's Unix time, as sent in the body) and
    ``x-infermeter-signature: sha256=<hex>``. Receivers should reject stale timestamps, which
    makes a captured request useless for replay later.
    """

    name: ClassVar[str] = "webhook"
    url: str
    secret: bytes
    client: httpx.AsyncClient
    max_wait_seconds: float = 30.0
    timeout_seconds: float = 5.0

    async def publish(self, decision: Decision) -> None:
        """Send one decision; retried until ``max_wait_seconds`` on transient failures."""
        body = webhook_body(decision)
        timestamp = f"{decision.time:.3f}"
        headers = {
            "content-type": "application/json",
            TIMESTAMP_HEADER: timestamp,
            SIGNATURE_HEADER: "sha256=" + sign(self.secret, timestamp, body),
        }
        request = self.client.build_request(
            "POST", self.url, content=body, headers=headers, timeout=self.timeout_seconds
        )
        try:
            await _send_with_retries(self.client, request, self.max_wait_seconds)
        except _TransientError as exc:
            raise HookError(f"webhook {self.url}: {exc}") from exc


@dataclass
class KubernetesScaleHook:
    """Sets ``spec.replicas`` of the model's Deployment through its ``scale`` subresource.

    A JSON merge patch of the subresource needs only ``get``/``patch`` on
    ``deployments/scale`` (no write access to the Deployment itself). With ``dry_run`` the API
    server validates and authorizes the patch but persists nothing (``?dryRun=All``).
    """

    name: ClassVar[str] = "kubernetes"
    api_url: str
    namespace: str
    deployments: Mapping[str, str]
    client: httpx.AsyncClient
    token: str | None = None
    token_file: Path | None = None
    dry_run: bool = True
    max_wait_seconds: float = 30.0

    def path(self, deployment: str) -> str:
        """The scale subresource of ``deployment``."""
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment}/scale"

    async def publish(self, decision: Decision) -> None:
        """Patch the model's Deployment to ``decision.desired``; models without one are skipped."""
        deployment = self.deployments.get(decision.model)
        if deployment is None:
            return
        params = {"dryRun": "All"} if self.dry_run else {}
        request = self.client.build_request(
            "PATCH",
            self.api_url.rstrip("/") + self.path(deployment),
            params=params,
            content=orjson.dumps({"spec": {"replicas": decision.desired}}),
            headers={"content-type": "application/merge-patch+json", **self._auth()},
        )
        try:
            await _send_with_retries(self.client, request, self.max_wait_seconds)
        except _TransientError as exc:
            raise HookError(f"kubernetes {deployment}: {exc}") from exc

    def _auth(self) -> dict[str, str]:
        # Projected service-account tokens are rotated by the kubelet, so read it every time.
        try:
            return bearer(self.token, self.token_file)
        except KubernetesApiError as exc:
            raise HookError(str(exc)) from exc


def in_cluster_api(
    environ: Mapping[str, str] | None = None, account_dir: Path = SERVICE_ACCOUNT_DIR
) -> tuple[str, Path, ssl.SSLContext]:
    """The API server URL, token file and TLS context a pod's service account provides."""
    try:
        return kubernetes.in_cluster_api(environ, account_dir)
    except KubernetesApiError as exc:
        raise HookError(str(exc).replace("an api_url", "kubernetes.api_url")) from exc
