"""Fixtures shared by the security tests: the embedded configuration's ledger, in memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from billing.ledger import Ledger
from infermeter.config import Config


@pytest.fixture
def ledger(config: Config) -> Iterator[Ledger]:
    """An empty in-memory ledger for the demo teams, with the models' TTFT targets."""
    led = Ledger.open(
        ":memory:",
        [t.name for t in config.teams],
        {m.name: m.sla.ttft_p95_seconds for m in config.models},
    )
    yield led
    led.close()
