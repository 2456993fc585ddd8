"""What the writer-credential tests share: a billing service that holds the writer secret, and
records of the demo fleet as its writers would send them, timed now, with the ids their writers
mint (``infermeter.ids``; billing quarantines a credential's record whose id is not its own)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from billing.api import create_app
from billing.ledger import Ledger
from billing.quarantine import KnownFleet
from infermeter.config import Config, load_config
from infermeter.ids import sample_id
from infermeter.records import EngineSample, GpuSample, UsageRecord
from infermeter.tags import project_rules
from infermeter.writers import Credential, Writer, issue
from tests.billing.conftest import instance_event
from tests.conftest import config_ledger
from tests.servers import serving

SECRET = b"a writer secret for the tests"
ADMIN = {"authorization": "Bearer im-demo-admin"}
METRICS = {"authorization": "Bearer im-demo-metrics"}
# small-0 of the demo, the one instance of its group, at its sidecar's address.
SMALL_0 = issue(SECRET, Writer.for_instance("small-0", "small-0", "127.0.0.1:18102"))
COLLECTOR_A = issue(SECRET, Writer.for_collector(["node-a"]))
COLLECTOR_B = issue(SECRET, Writer.for_collector(["node-b"]))
_ids = itertools.count()


def _ago(seconds: float) -> float:
    """Now less ``seconds``, a millisecond apart from every other call's (the ids of two records
    of one source made in a row are their times, so they must differ)."""
    return time.time() - seconds - next(_ids) % 1000 / 1000


def bearer(credential: Credential | str) -> dict[str, str]:
    """The Authorization header of a credential (or of a plain token)."""
    token = credential.token if isinstance(credential, Credential) else credential
    return {"authorization": f"Bearer {token}"}


def usage(**kw: Any) -> dict[str, Any]:
    """A request of team search on small-0 that ended a minute ago."""
    t = time.time() - 60
    record = UsageRecord(
        request_id=f"req-{time.time_ns()}-{next(_ids)}",
        team="search",
        model="chat-small",
        served_version="llama-3.1-8b-instruct",
        replica="small-0",
        received_at=t - 2,
        first_token_at=t - 1.9,
        finished_at=t,
        prompt_tokens=100,
        cached_prompt_tokens=0,
        completion_tokens=50,
        status="ok",
        http_status=200,
        stream=True,
    ).to_json()
    return record | kw


def gpu(node: str = "node-b", **kw: Any) -> dict[str, Any]:
    """A GPU of ``node`` read 10 s ago, held by small-0; its id as the collector mints it."""
    t = _ago(10)
    record = (
        GpuSample(
            sample_id="",
            node=node,
            gpu="0",
            uuid=f"GPU-{node}-0",
            gpu_model="L40S",
            replica="small-0",
            model="chat-small",
            timestamp=t,
            interval_seconds=10.0,
            utilization=0.5,
            power_watts=200.0,
            energy_joules=2000.0,
            memory_used_mib=1.0,
            memory_free_mib=1.0,
        ).to_json()
        | kw
    )
    own = sample_id(record["timestamp"], record["node"], record["uuid"], "-", str(next(_ids)))
    return record if "sample_id" in kw else record | {"sample_id": own}


def engine(node: str | None = "node-b", **kw: Any) -> dict[str, Any]:
    """small-0's engine read 10 s ago on ``node``; its id as the collector mints it."""
    record = (
        EngineSample(
            sample_id="",
            replica="small-0",
            model="chat-small",
            timestamp=_ago(10),
            requests_running=1,
            requests_waiting=0,
            kv_cache_usage=0.1,
            prompt_tokens_total=100,
            generation_tokens_total=50,
            node=node,
        ).to_json()
        | kw
    )
    own = sample_id(record["timestamp"], record["instance"] or record["replica"])
    return record if "sample_id" in kw else record | {"sample_id": own}


def event(instance: str = "small-0", replica: str = "small-0", **kw: Any) -> dict[str, Any]:
    """A start event of ``instance`` of ``replica`` on node-b, with no engine address; its id as
    the sidecar mints it."""
    t = _ago(5)
    record = instance_event(instance, "start", t, t, replica=replica) | kw
    own = sample_id(record["timestamp"], record["instance"], record["event"])
    return record if "event_id" in kw else record | {"event_id": own}


def lines(records: list[dict[str, Any]]) -> bytes:
    """NDJSON, as a shipper sends a segment."""
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def fleet_ledger(config: Config) -> Ledger:
    """An in-memory ledger that knows the fleet of ``config``, as the billing service opens it."""
    return config_ledger(config, fleet=KnownFleet.of(config), projects=project_rules(config))


@contextlib.asynccontextmanager
async def billing(
    config: Config, ledger: Ledger, secret: bytes | None = SECRET
) -> AsyncIterator[str]:
    """The billing API over ``ledger`` on loopback, holding ``secret``; yields its URL."""
    async with serving(create_app(config, ledger, writer_secret=secret), lifespan="off") as url:
        yield url


async def post(
    client: httpx.AsyncClient,
    url: str,
    kind: str,
    records: list[dict[str, Any]],
    credential: Credential | str,
) -> httpx.Response:
    """POST ``records`` as NDJSON to ``/v1/ingest/<kind>`` with ``credential``."""
    headers = bearer(credential) | {"content-type": "application/x-ndjson"}
    return await client.post(f"{url}/v1/ingest/{kind}", content=lines(records), headers=headers)


async def quarantined_total(client: httpx.AsyncClient, url: str) -> dict[tuple[str, str], float]:
    """billing's /metrics quarantine counter, per (kind, reason)."""
    text = (await client.get(f"{url}/metrics", headers=METRICS)).text
    out = {}
    for line in text.splitlines():
        if line.startswith("infermeter_billing_quarantined_records_total{"):
            labels, value = line.rsplit(" ", 1)
            pairs = dict(p.split("=", 1) for p in labels[labels.index("{") + 1 : -1].split(","))
            out[(pairs["kind"].strip('"'), pairs["reason"].strip('"'))] = float(value)
    return out


@pytest.fixture
def strict() -> Config:
    """The embedded demo configuration as it ships: no shared ingest token taken."""
    return load_config(None, environ={})


@pytest.fixture
async def ledger(strict: Config) -> AsyncIterator[Ledger]:
    """A ledger that knows the demo fleet."""
    led = fleet_ledger(strict)
    yield led
    led.close()


@pytest.fixture
async def url(strict: Config, ledger: Ledger) -> AsyncIterator[str]:
    """Billing on loopback with the writer secret."""
    async with billing(strict, ledger) as base:
        yield base
