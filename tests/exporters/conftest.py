"""The worked month's configuration, for the exporter tests."""

from __future__ import annotations

import pytest

from infermeter.config import Config
from tests.exporters import month


@pytest.fixture
def pooled(config: Config) -> Config:
    """The demo configuration with the worked month's three node pools."""
    return month.pooled(config)
