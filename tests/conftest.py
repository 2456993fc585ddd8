"""Shared fixtures: the embedded configuration and paths to captured real-system output."""

from __future__ import annotations

from pathlib import Path

import pytest

from infermeter.config import Config, load_config

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def config() -> Config:
    """The embedded demo configuration, with no environment overrides."""
    return load_config(None, environ={})


@pytest.fixture
def fixture_text():
    """Read a captured file from tests/fixtures."""

    def read(name: str) -> str:
        return (FIXTURES / name).read_text()

    return read
