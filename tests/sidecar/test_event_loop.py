"""``sidecar.event_loop``: which loop the sidecar process runs on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import uvloop
import yaml

from infermeter.config import DEFAULT_CONFIG, ConfigError, load_config
from infermeter.serving import loop_factory


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_pythons_own_loop():
    """The default picks uvloop (a dependency); "asyncio" keeps Python's loop."""
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)


def test_an_unknown_event_loop_names_the_file_the_key_and_the_value(tmp_path: Path) -> None:
    """A typo in the setting is a configuration error, not a silent fallback."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data.setdefault("sidecar", {})["event_loop"] = "trio"
    path = tmp_path / "infermeter.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert str(path) in message
    assert "sidecar.event_loop" in message
    assert "trio" in message
