"""What the conformance tests through a sidecar share: its configuration in front of real vLLM,
and its records (the ``sidecar`` fixture is in this folder's conftest)."""

from __future__ import annotations

from typing import Any

import yaml

from infermeter.config import DEFAULT_CONFIG, Config
from infermeter.spool import read_segment
from sidecar.app import Sidecar


def sidecar_config(upstream: str) -> Config:
    """The embedded configuration with ``small-0`` serving the tiny model at ``upstream``, and
    the first team unlimited."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["models"][1].update(approved_versions=["tiny"], serve_version="tiny", max_model_len=512)
    data["replicas"][1].update(upstream_url=upstream, served_version="tiny", max_num_seqs=8)
    data["teams"][0]["limits"] = {}
    return Config.model_validate(data)


async def spooled_records(app: Sidecar) -> list[dict[str, Any]]:
    """The sidecar's records, those of the requests ended so far written first (the tick)."""
    await app.accounting.flush()
    return [
        r for seg in sorted(app.spool.directory.glob("seg-*.jsonl")) for r in read_segment(seg)[0]
    ]
