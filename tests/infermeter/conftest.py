"""Fixtures of the core's tests: billing on loopback for the admin commands."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import Config
from tests.conftest import config_ledger
from tests.servers import serving


@contextlib.asynccontextmanager
async def billing_over(config: Config, ledger: Ledger) -> AsyncIterator[str]:
    """Billing of ``config`` over ``ledger`` on a loopback port, its URL; the ledger is closed
    once billing stops."""
    try:
        async with serving(create_app(config, ledger), lifespan="off") as url:
            yield url
    finally:
        ledger.close()


@pytest.fixture
async def billing(config: Config, tmp_path: Path) -> AsyncIterator[str]:
    """Billing over an empty ledger file, on a loopback port (what ``infermeter keys`` and
    ``infermeter budgets`` call)."""
    async with billing_over(config, config_ledger(config, tmp_path / "ledger.duckdb")) as url:
        yield url
