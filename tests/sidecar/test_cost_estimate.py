"""Cost at the point of use: every answer carries its cost estimate, from billing's rates.

Real HTTP over loopback: billing over a ledger file (GPU time and records of chat-small in the
last complete hour, nothing of chat-large), a simulated replica and a sidecar for each model,
the sidecars polling billing's ``/v1/rates`` with the spend_reader token. All started once for
the module, on an event loop of their own, and stopped at its end.

chat-small's rate, by hand: one L40S for the hour, $1.60, plus 200 W x 3,600 s = 0.2 kWh x
$0.14 x PUE 1.35 = $0.0378: $1.6378 over three records of 1,000 prompt tokens (200 of them
cached) and 100 completion tokens, weighted 1, 0.25 and 3: 800 + 50 + 300 = 1,150 each, 3,450
in all: $0.000474724... per weighted token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import pytest

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.serving import free_port
from sidecar.app import Sidecar
from sidecar.rates import usd_text, with_cost
from simulator.replica import ReplicaSim, replica_spec
from tests.billing.conftest import batch, gpu_samples, usage
from tests.conftest import config_ledger
from tests.servers import serving
from tests.sidecar.conftest import KEYS, METRICS_TOKEN, make_config

SPEND = "im-demo-spend"
HOUR = 3600
EXPECTED_RATE = (1.60 + 0.2 * 0.14 * 1.35) / 3450
T = TypeVar("T")


@dataclass(frozen=True)
class Fleet:
    """The running servers' URLs."""

    billing: str
    small: str  # the sidecar of chat-small (a rate known)
    large: str  # the sidecar of chat-large (no rate)
    relayed: str  # a sidecar of chat-small relaying whole answers as vLLM gives them


def _fill(ledger: Ledger, now: float) -> None:
    """chat-small's GPU and three records in the last complete hour."""
    hour = (int(now) // HOUR - 1) * HOUR
    records = [
        usage(
            "search",
            hour + 600 + 60 * i,
            30.0,
            prompt_tokens=1000,
            cached_prompt_tokens=200,
            completion_tokens=100,
        )
        for i in range(3)
    ]
    ledger.ingest(batch("usage", records), now=now)
    ledger.ingest(batch("gpu_samples", gpu_samples("small-0", hour, 3600.0)), now=now)


async def _start(stack: contextlib.AsyncExitStack, directory: Path) -> Fleet:
    """Billing, then a replica and a sidecar per model, each served on loopback."""
    billing_port, small_port, large_port, relayed_port = (free_port() for _ in range(4))
    billing = f"http://127.0.0.1:{billing_port}"
    changes = {
        "replicas.0.upstream_url": f"http://127.0.0.1:{large_port}",
        "replicas.2.upstream_url": f"http://127.0.0.1:{relayed_port}",
        "sidecar.budgets": {"spend_url": billing, "refresh_seconds": 0.2},
    }
    config = make_config(f"http://127.0.0.1:{small_port}", **changes)
    relaying = make_config(
        f"http://127.0.0.1:{small_port}", **changes, **{"sidecar.non_streamed_via_stream": False}
    )
    ledger = config_ledger(config, directory / "ledger.duckdb")
    stack.callback(ledger.close)
    _fill(ledger, time.time())
    await stack.enter_async_context(
        serving(create_app(config, ledger), billing_port, lifespan="off")
    )
    urls = []
    for replica, port, own in (
        ("small-0", small_port, config),
        ("large-0", large_port, config),
        ("small-1", relayed_port, relaying),
    ):
        await stack.enter_async_context(serving(ReplicaSim(replica_spec(own, replica)), port))
        sidecar = Sidecar(own, replica, spool_dir=directory / replica)
        urls.append(await stack.enter_async_context(serving(sidecar, limits=sidecar.server_limits)))
        if replica != "large-0":
            for _ in range(200):  # the first poll of billing's rates
                if sidecar.rates.current:
                    break
                await asyncio.sleep(0.05)
            assert sidecar.rates.current, "the sidecar never read billing's rates"
    return Fleet(billing, *urls)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The servers, on an event loop in a thread of their own, for the whole module."""
    previous = os.environ.get("INFERMETER_SPEND_TOKEN")
    os.environ["INFERMETER_SPEND_TOKEN"] = SPEND  # the sidecars read spend and rates with it
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    stack = contextlib.AsyncExitStack()
    try:
        yield run(_start(stack, tmp_path_factory.mktemp("cost")))
    finally:
        run(stack.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        if previous is None:
            os.environ.pop("INFERMETER_SPEND_TOKEN", None)
        else:
            os.environ["INFERMETER_SPEND_TOKEN"] = previous


def _rates(fleet: Fleet) -> dict[str, Any]:
    answer = httpx.get(f"{fleet.billing}/v1/rates", headers={"authorization": f"Bearer {SPEND}"})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _expected(rates: dict[str, Any], usage_object: dict[str, Any]) -> float:
    """The answer's tokens, weighted as billing says, times chat-small's rate."""
    w = rates["weights"]
    cached = (usage_object.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    weighted = (
        (usage_object["prompt_tokens"] - cached) * w["prompt"]
        + cached * w["cached_prompt"]
        + usage_object["completion_tokens"] * w["completion"]
    )
    return float(weighted * rates["models"]["chat-small"]["usd_per_weighted_token"])


def _chat(url: str, **extra: Any) -> httpx.Response:
    body = {
        "model": extra.pop("model", "chat-small"),
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "how much did this cost?"}],
        **extra,
    }
    return httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        timeout=60,
        headers={"authorization": f"Bearer {KEYS['search']}"},
    )


def test_billing_gives_the_last_hour_s_cost_per_weighted_token_and_null_when_unknown(
    fleet: Fleet,
) -> None:
    """chat-small's rate is the hour's $1.6378 over 3,450 weighted tokens; chat-large's is null."""
    rates = _rates(fleet)
    assert rates["weights"] == {"prompt": 1.0, "cached_prompt": 0.25, "completion": 3.0}
    small = rates["models"]["chat-small"]
    assert small["basis"] == "hour"
    assert small["usd_per_weighted_token"] == pytest.approx(EXPECTED_RATE, rel=1e-9)
    assert rates["models"]["chat-large"]["usd_per_weighted_token"] is None


@pytest.mark.parametrize("sidecar", ["small", "relayed"])
def test_a_whole_answer_carries_tokens_times_the_rate_in_its_header_and_usage(
    fleet: Fleet, sidecar: str
) -> None:
    """A non-streamed answer (assembled from vLLM's stream, or relayed whole): the header and
    ``usage.cost`` both say its tokens x the rate."""
    answer = _chat(getattr(fleet, sidecar))
    assert answer.status_code == 200, answer.text
    usage_object = answer.json()["usage"]
    expected = _expected(_rates(fleet), usage_object)
    header = answer.headers["x-infermeter-cost-estimate-usd"]
    assert float(Decimal(header)) == pytest.approx(expected, rel=1e-9)
    assert usage_object["cost"] == {"usd": float(Decimal(header)), "estimate": True}


def test_a_stream_s_final_usage_chunk_carries_the_cost_and_no_header(fleet: Fleet) -> None:
    """A stream with include_usage: the final usage chunk has ``cost``; headers left before it."""
    with httpx.stream(
        "POST",
        f"{fleet.small}/v1/chat/completions",
        timeout=60,
        headers={"authorization": f"Bearer {KEYS['search']}"},
        json={
            "model": "chat-small",
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "and this one?"}],
        },
    ) as r:
        assert r.status_code == 200
        assert "x-infermeter-cost-estimate-usd" not in r.headers
        chunks = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    final = chunks[-1]
    assert final["choices"] == []
    assert final["usage"]["cost"]["estimate"] is True
    assert final["usage"]["cost"]["usd"] == pytest.approx(
        _expected(_rates(fleet), final["usage"]), rel=1e-9
    )
    assert all("cost" not in (c.get("usage") or {}) for c in chunks[:-1])


def test_no_estimate_when_billing_has_no_rate_for_the_model(fleet: Fleet) -> None:
    """chat-large has no measured cost: neither the header nor ``cost``, never a 0."""
    answer = _chat(fleet.large, model="chat-large")
    assert answer.status_code == 200, answer.text
    assert "x-infermeter-cost-estimate-usd" not in answer.headers
    assert "cost" not in answer.json()["usage"]


def test_the_cost_is_added_last_to_the_usage_object_in_plain_decimals() -> None:
    """``with_cost`` adds to the usage object alone; a cost that shows as 0 is no estimate."""
    body = (
        b'{"id":"x","usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":1}},"z":1}'
    )
    assert orjson.loads(with_cost(body, b"0.00012"))["usage"] == {
        "prompt_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 1},
        "cost": {"usd": 0.00012, "estimate": True},
    }
    assert orjson.loads(with_cost(b'{"usage":{}}', b"1.5")) == {
        "usage": {"cost": {"usd": 1.5, "estimate": True}}
    }
    assert usd_text(1.25e-7) == b"0.000000125"
    assert usd_text(2.0) == b"2.0"
    assert usd_text(1e-14) is None
    assert usd_text(0.0) is None


def test_a_sidecar_shows_how_old_its_rates_are(fleet: Fleet) -> None:
    """``infermeter_cost_rates_age_seconds``: read moments ago, within a couple of refreshes."""
    text = httpx.get(
        f"{fleet.small}/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}
    ).text
    ages = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("infermeter_cost_rates_age_seconds ")
    ]
    assert len(ages) == 1
    assert 0.0 <= ages[0] < 5.0
