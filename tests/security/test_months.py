"""Month names and the other checked strings are checked whole: nothing may trail or hide."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.auth import AuthError, GatewayVerifier, sign_request
from infermeter.config import BillingSettings, Config
from infermeter.months import check_month
from tests.billing.conftest import OCT, batch, usage
from tests.servers import serving

ADMIN, INGEST = "im-demo-admin", "im-demo-ingest"


@pytest.mark.parametrize(
    "month",
    [
        "2026-11\n",
        "2026-11\r\n",
        "\n2026-11",
        "2026-11 ",
        "2026-13",
        "2026-1",
        "\u0662\u0660\u0662\u0666-11",  # Arabic-Indic digits
        "2026-\uff11\uff11",  # full-width digits
    ],
)
def test_a_month_with_anything_around_or_inside_it_is_refused(month):
    """Only YYYY-MM in ASCII digits is a month; a trailing newline is not ignored."""
    with pytest.raises(ValueError, match="is not of the form YYYY-MM"):
        check_month(month)


def test_a_plain_month_is_accepted():
    """2026-11 is a month."""
    assert check_month("2026-11") == "2026-11"


@pytest.fixture
async def billing(config: Config) -> AsyncIterator[str]:
    """The billing API over an in-memory ledger holding some October usage."""
    ledger = Ledger.open(":memory:", [t.name for t in config.teams], {})
    ledger.ingest(batch("usage", [usage("search", OCT + 3600, 60)]), now=OCT + 86400)
    try:
        async with serving(create_app(config, ledger), lifespan="off") as url:
            yield url
    finally:
        ledger.close()


@pytest.mark.parametrize("suffix", ["%0A", "%0D%0A", "%20"])
async def test_a_month_with_a_trailing_newline_does_not_freeze_a_second_statement(billing, suffix):
    """Closing 2026-10 and then "2026-10\\n" leaves one closed month; the second close is 400."""
    async with httpx.AsyncClient(
        base_url=billing, headers={"authorization": f"Bearer {ADMIN}"}
    ) as client:
        first = await client.post("/v1/months/2026-10/close")
        second = await client.post(f"/v1/months/2026-10{suffix}/close")
        months = (await client.get("/v1/months")).json()
        export = await client.get(f"/v1/chargeback/2026-10{suffix}.csv")
        version = await client.get(f"/v1/chargeback/2026-10.focus.csv?version=1.2{suffix}")
    assert first.status_code == 200
    assert second.status_code == 400
    assert second.json()["error"]["code"] == "invalid_value"
    assert export.status_code == 400
    assert version.status_code in (400, 422)
    assert [m["month"] for m in months] == ["2026-10"]


NOW = 1_790_812_800


@pytest.mark.parametrize(
    "stamp",
    [
        "9" * 400,
        "-" + "9" * 400,
        f"{NOW}\n",
        f" {NOW}",
        f"{NOW:_}",  # int() accepts underscores
        "+" + str(NOW),
        str(NOW).translate(str.maketrans("0123456789", "".join(map(chr, range(0x660, 0x66A))))),
    ],
)
def test_a_gateway_timestamp_must_be_plain_ascii_digits(stamp):
    """Anything but a short run of ASCII digits is a malformed timestamp, never a crash."""
    verifier = GatewayVerifier(b"s", "t", "ts", "sig", 300.0, frozenset({"search"}), "chat-small")
    nonce = "n" * 16
    signature = sign_request(
        b"s",
        team="search",
        timestamp=NOW,
        nonce=nonce,
        audience="chat-small",
        method="POST",
        path="/v1/chat/completions",
        body=b"",
    )
    headers = {"t": "search", "ts": stamp, "sig": signature, "x-infermeter-nonce": nonce}
    with pytest.raises(AuthError, match="Malformed gateway timestamp") as err:
        verifier.verify(headers, "POST", "/v1/chat/completions", b"", now=NOW)
    assert err.value.code == "invalid_team_signature"


@pytest.mark.parametrize("memory_limit", ["2GB\n", "\u0662GB", "2\u2003GB", "2 GB\n"])
def test_the_ledger_memory_limit_is_checked_whole(memory_limit):
    """billing.memory_limit is ASCII digits, optional spaces and a unit, and nothing else."""
    with pytest.raises(ValidationError):
        BillingSettings(memory_limit=memory_limit)


# Months whose hours and minutes, as Unix seconds, are past 2^31 (2038-01-19T03:14:07Z): the
# statement's SQL multiplied 32-bit hour and minute numbers by 3600 and 60, and overflowed.
_LATE_MONTHS = ("2038-02", "2062-11", "2999-12")
_LATE_ROUTES = (
    "/v1/chargeback/{month}",
    "/v1/chargeback/{month}.csv",
    "/v1/chargeback/{month}.focus.csv?version=1.3",
    "/v1/chargeback/{month}/breakdown",
    "/v1/query/statement/{month}",
    "/v1/efficiency/{month}",
)


@pytest.fixture
async def busy_billing(config: Config, tmp_path: Path) -> AsyncIterator[str]:
    """The billing API over a ledger holding an hour of the demo fleet: usage, GPUs, engines."""
    from tests.dashboards import records

    fleet = records.build(records.recent_start())
    ledger = records.open_ledger(config, tmp_path / "ledger.duckdb", fleet)
    try:
        async with serving(create_app(config, ledger), lifespan="off") as url:
            yield url
    finally:
        ledger.close()


async def test_a_month_past_2038_is_an_empty_statement_never_a_500(busy_billing):
    """2062-11 (a year typo), 2038-02 and 2999-12 are months: every statement route answers
    them, with no line, for the admin and a team, as the chargeback CLI and the dashboard's
    "No data for" note expect; so does the allocation explorer at the calendar's last hour."""
    async with httpx.AsyncClient(base_url=busy_billing, timeout=120) as client:
        for key in (ADMIN, "im-demo-search"):
            headers = {"authorization": f"Bearer {key}"}
            for month in _LATE_MONTHS:
                for route in _LATE_ROUTES:
                    r = await client.get(route.format(month=month), headers=headers)
                    assert r.status_code == 200, (key, month, route, r.text[:200])
                body = (await client.get(f"/v1/chargeback/{month}", headers=headers)).json()
                assert body["lines"] == [], (key, month)
            last_hour = {"from": 32_503_672_800, "to": 32_503_676_400}
            for route in ("/v1/allocation", "/v1/allocation.csv"):
                r = await client.get(route, params=last_hour, headers=headers)
                assert r.status_code == 200, (key, route, r.text[:200])
