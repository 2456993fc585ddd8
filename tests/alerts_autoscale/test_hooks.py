"""Decision outputs: gauges, the signed webhook and the Kubernetes scale patch, over real HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from alerts.autoscale.hooks import (
    HookError,
    KubernetesScaleHook,
    ScalingGauges,
    WebhookHook,
    in_cluster_api,
)
from alerts.autoscale.policy import Decision
from tests.servers import serving

DECISION = Decision("chat-large", 1_790_000_000.5, 3, 4, ("queue 12 > 10 for 30 s: scale up",))
SECRET = b"webhook-test-secret"


class Receiver:
    """A webhook receiver that verifies signatures the way a user's endpoint would."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.seen: list[dict[str, Any]] = []

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        timestamp = request.headers["x-infermeter-timestamp"]
        expected = hmac.new(SECRET, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
        valid = hmac.compare_digest(request.headers["x-infermeter-signature"], f"sha256={expected}")
        self.seen.append({"body": json.loads(body), "valid": valid, "timestamp": timestamp})
        status = self.statuses.pop(0) if self.statuses else 200
        return Response(status_code=status if valid else 401)


def test_gauges_show_desired_and_current_per_model():
    """The gauges carry the decision's desired and current replicas, labelled by model."""
    registry = CollectorRegistry()
    ScalingGauges(registry).update({"chat-large": DECISION})
    get = registry.get_sample_value
    assert get("infermeter_desired_replicas", {"model": "chat-large"}) == 4
    assert get("infermeter_current_replicas", {"model": "chat-large"}) == 3


async def test_webhook_is_signed_and_retried_after_a_server_error():
    """A 503 is retried; the delivered body is the decision and its signature verifies."""
    receiver = Receiver([503])
    app = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    async with serving(app) as url, httpx.AsyncClient() as client:
        await WebhookHook(f"{url}/hook", SECRET, client, max_wait_seconds=5).publish(DECISION)
    assert len(receiver.seen) == 2
    assert all(seen["valid"] for seen in receiver.seen)
    assert receiver.seen[-1]["body"] == {
        "model": "chat-large",
        "current": 3,
        "desired": 4,
        "reasons": ["queue 12 > 10 for 30 s: scale up"],
        "timestamp": 1_790_000_000.5,
    }
    assert receiver.seen[-1]["timestamp"] == "1790000000.500"


async def test_webhook_with_the_wrong_secret_is_refused_and_not_retried():
    """A receiver that rejects the signature (401) fails the hook at once, after one attempt."""
    receiver = Receiver([])
    app = Starlette(routes=[Route("/hook", receiver.handle, methods=["POST"])])
    async with serving(app) as url, httpx.AsyncClient() as client:
        hook = WebhookHook(f"{url}/hook", b"not-the-secret", client, max_wait_seconds=5)
        with pytest.raises(HookError, match="HTTP 401"):
            await hook.publish(DECISION)
    assert [seen["valid"] for seen in receiver.seen] == [False]


async def test_webhook_gives_up_when_the_receiver_is_down():
    """An unreachable receiver is retried until the budget runs out, then reported."""
    from infermeter.serving import free_port

    async with httpx.AsyncClient() as client:
        hook = WebhookHook(f"http://127.0.0.1:{free_port()}/hook", SECRET, client, 0.5)
        with pytest.raises(HookError, match="ConnectError"):
            await hook.publish(DECISION)


async def test_a_receiver_that_drips_its_answer_is_given_up_at_the_deadline():
    """A byte every 0.2 s keeps each read under its timeout; the delivery's deadline still holds."""

    async def drip() -> AsyncIterator[bytes]:
        for _ in range(25):  # 5 s of answer, ten times the deadline
            yield b" "
            await asyncio.sleep(0.2)

    async def handle(request: Request) -> Response:
        return StreamingResponse(drip())

    app = Starlette(routes=[Route("/hook", handle, methods=["POST"])])
    async with serving(app) as url, httpx.AsyncClient() as client:
        hook = WebhookHook(f"{url}/hook", SECRET, client, max_wait_seconds=0.5, timeout_seconds=1)
        with pytest.raises(HookError, match=r"no answer within 0\.5 s"):
            await hook.publish(DECISION)


class FakeApiServer:
    """Answers the scale subresource PATCH like the Kubernetes API server, recording requests."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def handle(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.requests.append(
            {
                "method": request.method,
                "path": request.url.path,
                "query": dict(request.query_params),
                "content_type": request.headers.get("content-type"),
                "authorization": request.headers.get("authorization"),
                "body": body,
            }
        )
        name = request.path_params["name"]
        return JSONResponse(
            {
                "kind": "Scale",
                "apiVersion": "autoscaling/v1",
                "metadata": {"name": name, "namespace": request.path_params["ns"]},
                "spec": {"replicas": body["spec"]["replicas"]},
                "status": {"replicas": 3},
            }
        )


def _api() -> tuple[FakeApiServer, Starlette]:
    fake = FakeApiServer()
    path = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
    return fake, Starlette(routes=[Route(path, fake.handle, methods=["PATCH"])])


async def test_kubernetes_hook_patches_the_scale_subresource_in_dry_run():
    """PATCH .../deployments/<name>/scale?dryRun=All with a merge patch and the bearer token."""
    fake, app = _api()
    async with serving(app) as url, httpx.AsyncClient() as client:
        hook = KubernetesScaleHook(
            url, "infermeter", {"chat-large": "vllm-chat-large"}, client, token="sa-token"
        )
        await hook.publish(DECISION)
        await hook.publish(Decision("not-deployed", 0.0, 1, 2, ()))
    assert fake.requests == [
        {
            "method": "PATCH",
            "path": "/apis/apps/v1/namespaces/infermeter/deployments/vllm-chat-large/scale",
            "query": {"dryRun": "All"},
            "content_type": "application/merge-patch+json",
            "authorization": "Bearer sa-token",
            "body": {"spec": {"replicas": 4}},
        }
    ]


async def test_kubernetes_hook_applies_for_real_when_dry_run_is_off(tmp_path: Path) -> None:
    """With dry_run off there is no dryRun parameter; the token file is read at each call."""
    fake, app = _api()
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    async with serving(app) as url, httpx.AsyncClient() as client:
        hook = KubernetesScaleHook(
            url, "ns", {"chat-large": "d"}, client, token_file=token_file, dry_run=False
        )
        await hook.publish(DECISION)
        token_file.write_text("rotated\n")
        await hook.publish(DECISION)
    assert [r["query"] for r in fake.requests] == [{}, {}]
    assert [r["authorization"] for r in fake.requests] == ["Bearer first", "Bearer rotated"]


def test_in_cluster_api_needs_the_service_host():
    """Outside a pod the in-cluster API cannot be found, and the message says what to set."""
    with pytest.raises(HookError, match=r"kubernetes\.api_url"):
        in_cluster_api(environ={})
