"""The worked month's configuration and an empty ledger, for the exporter tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from billing.ledger import Ledger
from infermeter.config import Config
from tests.exporters import month


@pytest.fixture
def pooled(config: Config) -> Config:
    """The demo configuration with the worked month's three node pools."""
    return month.pooled(config)


@pytest.fixture
def ledger(config: Config) -> Iterator[Ledger]:
    """An empty in-memory ledger for the demo teams."""
    led = Ledger.open(":memory:", [t.name for t in config.teams], {})
    yield led
    led.close()
