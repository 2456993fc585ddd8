"""The chargeback file routes through the running service: each file answers at its own path."""

from __future__ import annotations

import asyncio
import csv
import io
from collections.abc import AsyncIterator

import httpx
import pytest

from billing.api import create_app
from billing.ledger import Ledger
from exporters.focus import FOCUS_1_2_MANDATORY
from infermeter.config import Config
from launcher.cli import main
from tests.billing.conftest import NOV, batch, gpu_samples, usage
from tests.servers import serving

ADMIN, INGEST = "im-demo-admin", "im-demo-ingest"


@pytest.fixture
async def billing(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """The billing service with a little November usage, on a loopback port."""
    async with serving(create_app(config, ledger), lifespan="off") as url:
        async with httpx.AsyncClient(
            base_url=url, headers={"authorization": f"Bearer {INGEST}"}
        ) as c:
            for body in (
                batch("usage", [usage("search", NOV + 3600, 120)]),
                batch("gpu_samples", gpu_samples(start=NOV + 3600, seconds=600)),
            ):
                assert (await c.post("/v1/ingest", content=body)).status_code == 200
        yield url


@pytest.mark.parametrize("version", ["1.0", "1.2", "1.3"])
async def test_chargeback_focus_through_the_service_writes_the_focus_file(
    billing, tmp_path, monkeypatch, version
):
    """`infermeter chargeback --format focus` against the service writes FOCUS, not a 400."""
    monkeypatch.setenv("INFERMETER_ADMIN_TOKEN", ADMIN)
    out = tmp_path / "focus.csv"
    args = [
        "chargeback",
        "--month",
        "2026-11",
        "--format",
        "focus",
        "--focus-version",
        version,
        "--billing-url",
        billing,
        "--out",
        str(out),
    ]
    # The command is synchronous; the service runs in this test's event loop.
    assert await asyncio.to_thread(main, args) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert set(FOCUS_1_2_MANDATORY) <= set(rows[0])
    assert {row["x_Team"] for row in rows} == {"search"}


@pytest.mark.parametrize(
    ("path", "status", "filename"),
    [
        ("/v1/chargeback/2026-11.focus.csv", 200, "focus-1.0-2026-11.csv"),
        ("/v1/chargeback/2026-11.focus.csv?version=1.2", 200, "focus-1.2-2026-11.csv"),
        ("/v1/chargeback/2026-11.focus.csv?version=1.3", 200, "focus-1.3-2026-11.csv"),
        ("/v1/chargeback/2026-11.csv", 200, "chargeback-2026-11.csv"),
        ("/v1/chargeback/2026-11.focus.json", 400, None),
        ("/v1/chargeback/2026-11.xlsx", 400, None),
    ],
)
async def test_each_chargeback_file_has_its_own_route(billing, path, status, filename):
    """The FOCUS path is not taken for a month named "2026-11.focus"; other suffixes are 400."""
    async with httpx.AsyncClient(base_url=billing) as client:
        response = await client.get(path, headers={"authorization": f"Bearer {ADMIN}"})
    assert response.status_code == status, response.text
    if filename is not None:
        assert response.headers["content-disposition"] == f'attachment; filename="{filename}"'
    else:
        assert "is not of the form YYYY-MM" in response.json()["error"]["message"]
