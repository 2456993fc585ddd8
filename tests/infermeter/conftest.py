"""Fixtures of the core's tests: billing on loopback for the admin commands."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from billing.api import create_app
from infermeter.config import Config
from tests.conftest import config_ledger
from tests.servers import serving


@pytest.fixture
async def billing(config: Config, tmp_path: Path) -> AsyncIterator[str]:
    """Billing over a ledger file, on a loopback port (what ``infermeter keys`` and ``infermeter
    budgets`` call)."""
    ledger = config_ledger(config, tmp_path / "ledger.duckdb")
    try:
        async with serving(create_app(config, ledger), lifespan="off") as url:
            yield url
    finally:
        ledger.close()
