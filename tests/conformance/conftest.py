"""Fixtures of the conformance tests that go through a sidecar."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sidecar.app import Sidecar
from tests.conformance.sidecar_front import sidecar_config
from tests.servers import serving


@pytest.fixture
async def sidecar(real_vllm: str, tmp_path: Path) -> AsyncIterator[tuple[str, Sidecar]]:
    """A sidecar in front of real vLLM; its URL and itself."""
    app = Sidecar(sidecar_config(real_vllm), "small-0", spool_dir=tmp_path)
    async with serving(app) as url:
        yield url, app
