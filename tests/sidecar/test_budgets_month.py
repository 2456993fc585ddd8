"""The month boundary seen by two sidecars whose clocks are apart: real ``infermeter sidecar``
processes over HTTP, one whose clock reads the last minute of a month and one whose clock reads
the first second of the next, the simulator as their replica and billing's ``GET /v1/spend``
answering one month's spend, then the next's, as billing's does when its own clock turns.

Billing puts a request in the month its usage record's times fall in, and those times are the
sidecar's clock (``received_at``, ``finished_at``); so a sidecar judges a request by the spend of
the month its own clock puts the request in: the month billing charges it to.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from infermeter.months import month_bounds, month_of, next_month
from tests.servers import serving
from tests.sidecar.conftest import KEYS
from tests.sidecar.two_sidecars import TwoSidecars

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SEARCH = {"authorization": f"Bearer {KEYS['search']}"}
# The next month's first second: where the two clocks fall either side.
BOUNDARY = month_bounds(next_month(month_of(time.time())))[0]
OLD, NEW = month_of(BOUNDARY - 1), month_of(BOUNDARY)


class MonthSpend:
    """Billing's ``GET /v1/spend``: each team's spend in ``month``, the month billing's clock is in."""

    def __init__(self, month: str, spent: dict[str, float]) -> None:
        self.month, self.spent = month, spent

    def app(self) -> Starlette:
        async def handle(request: Request) -> JSONResponse:
            return JSONResponse(
                [
                    {"team": t, "month": self.month, "spent_usd": s, "budget_usd": 100.0}
                    for t, s in self.spent.items()
                ]
            )

        return Starlette(routes=[Route("/v1/spend", handle)])


def _fleet(tmp_path: Path, billing: str) -> TwoSidecars:
    """small-0's and small-1's sidecars, search's budget $100 read from ``billing``."""
    sidecar = {"budgets": {"spend_url": billing, "refresh_seconds": 0.1}}
    return TwoSidecars(tmp_path, sidecar, {"budget_usd_per_month": 100.0})


def _months(fleet: TwoSidecars, replica: str) -> list[str]:
    """The months of the ``received_at`` of ``replica``'s usage records so far."""
    lines = b"".join(
        p.read_bytes() for p in sorted((fleet.spool / replica).rglob("seg-*.jsonl"))
    ).splitlines()
    out = []
    for line in lines:
        record = orjson.loads(line)
        record = record.get("record", record)
        if "received_at" in record:
            out.append(month_of(record["received_at"]))
    return out


async def _statuses(c: httpx.AsyncClient, urls: list[str]) -> list[int]:
    return [
        (await c.post(f"{u}/v1/chat/completions", json=CHAT, headers=SEARCH)).status_code
        for u in urls
    ]


async def _read(c: httpx.AsyncClient, url: str) -> None:
    """Return once the sidecar at ``url`` refuses search (it has read billing's spend)."""
    for _ in range(200):
        r = await c.post(f"{url}/v1/chat/completions", json=CHAT, headers=SEARCH)
        if r.status_code == 429:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the sidecar never read billing's spend")


@pytest.mark.timeout(120)
async def test_each_sidecar_judges_a_request_by_the_month_billing_charges_it_to(tmp_path):
    """search spent 100.5 of its 100 in the month ending; small-0's clock reads its last minute,
    small-1's the next month's first second. While billing still answers the old month, small-0
    refuses search (billing charges its request to the old month) and small-1 serves it (the new
    month has nothing spent). Once billing answers the new month, small-0 still refuses it: its
    request is still the old month's, which is past its budget."""
    now = time.time()
    offsets = (BOUNDARY - 60 - now, BOUNDARY + 1 - now)
    spend = MonthSpend(OLD, {"search": 100.5})
    async with serving(spend.app(), lifespan="off") as billing:
        fleet = _fleet(tmp_path, billing)
        async with fleet.running(offsets) as urls, httpx.AsyncClient(timeout=30) as c:
            await _read(c, urls[0])  # small-0 has read billing's spend (small-1 refuses nothing)
            before = [await _statuses(c, urls) for _ in range(3)]
            spend.month, spend.spent = NEW, {"search": 0.0}
            await asyncio.sleep(1.0)  # ten refreshes of each
            after = [await _statuses(c, urls) for _ in range(3)]
            await asyncio.sleep(0.3)  # the records of the last requests are written
    assert before == [[429, 200]] * 3
    assert after == [[429, 200]] * 3
    # Billing's month for each: the month of the record's times, the sidecar's clock.
    assert set(_months(fleet, "small-0")) == {OLD}
    assert set(_months(fleet, "small-1")) == {NEW}
