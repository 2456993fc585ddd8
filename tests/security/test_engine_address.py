"""An instance event cannot steer a collector's metrics token to an address of its choosing.

A pod's credential names its sidecar's address, and billing takes from it no engine metrics URL
but that one; the collector, reading its engines from billing's registry, sends the token only
to a sidecar relay the registry lists. Real billing, real registry discovery, real scrapes on
loopback; the forged address is a server that counts every credential it is sent.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from collectors.discovery import RegistryPoller
from collectors.serve import engine_sources
from collectors.targets import EngineTarget, registry_targets
from infermeter.serving import free_port
from infermeter.writers import Writer, issue
from tests.security import writers as writer_fixtures
from tests.security.writers import SECRET, billing, event, post
from tests.servers import serving

METRICS_TOKEN = "im-demo-metrics"
PAGE = b"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


class Counting:
    """A server that answers a vLLM metrics page and keeps every Authorization header it got."""

    def __init__(self) -> None:
        self.tokens: list[str | None] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers", []))
        token = headers.get(b"authorization")
        self.tokens.append(token.decode() if token else None)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": PAGE})


# The demo configuration as it ships (the collector reads the registry with the metrics token)
# and a ledger of its fleet.
strict, ledger = writer_fixtures.strict, writer_fixtures.ledger


async def test_a_forged_start_event_gets_no_metrics_token_sent_to_its_address(strict, ledger):
    """Forged addresses (another port, another path, anywhere) are quarantined; the collector's
    registry lists only the pod's own relay, which alone gets the token."""
    relay, trap = Counting(), Counting()
    relay_port, trap_port = free_port(), free_port()
    pod = issue(SECRET, Writer.for_instance("small-0", "vllm-small-0-1", f"127.0.0.1:{relay_port}"))
    forged = [
        event(
            instance="vllm-small-0-1",
            engine_metrics_url=f"http://127.0.0.1:{trap_port}/engine/metrics",
        ),
        event(instance="vllm-small-0-1", engine_metrics_url=f"http://127.0.0.1:{trap_port}/"),
        event(
            instance="ghost-1", engine_metrics_url=f"http://127.0.0.1:{trap_port}/engine/metrics"
        ),
    ]
    own = event(
        instance="vllm-small-0-1",
        engine_metrics_url=f"http://127.0.0.1:{relay_port}/engine/metrics",
    )
    seen: list[dict[str, EngineTarget]] = []
    async with (
        billing(strict, ledger) as url,
        serving(relay, relay_port, lifespan="off"),
        serving(trap, trap_port, lifespan="off"),
        httpx.AsyncClient() as client,
    ):
        steered = (await post(client, url, "instances", forged, pod)).json()
        kept = (await post(client, url, "instances", [own], pod)).json()
        poller = RegistryPoller(
            url, client, strict.replicas, lambda t: seen.append(dict(t)), METRICS_TOKEN
        )
        for _ in range(3):
            assert await poller.poll_once()
            env = {strict.collector.metrics_token_env: METRICS_TOKEN}
            for source in engine_sources(strict, seen[-1], client, env):
                await source.read()
    assert (steered["accepted"], len(steered["quarantined"]), kept["accepted"]) == (0, 3, 1)
    assert [(t.instance, t.node) for t in seen[-1].values()] == [("vllm-small-0-1", "node-b")]
    assert trap.tokens == []
    assert relay.tokens == [f"Bearer {METRICS_TOKEN}"] * 3


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/steal",
        "http://user:pass@127.0.0.1:9000/engine/metrics",
        "http://127.0.0.1:9000/engine/metrics?next=http://elsewhere",
        "http://127.0.0.1:9000/engine/metrics/../../v1/spend",
        "file:///etc/passwd",
    ],
)
def test_the_registry_lists_no_target_but_a_sidecar_relay(strict, url):
    """Whatever billing's registry held, a URL that is not ``http://host:port/engine/metrics``
    is never a target, so the metrics token is never sent to it."""
    answer = {
        "instances": [
            {
                "instance": "vllm-small-0-1",
                "replica": "small-0",
                "state": "live",
                "node": "node-b",
                "engine_metrics_url": url,
            }
        ]
    }
    assert registry_targets(answer, strict.replicas) == {}
