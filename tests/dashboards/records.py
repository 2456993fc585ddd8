"""A ledger of known contents for the dashboard tests: one hour of the demo fleet, built by rule.

Every number a test checks can be recomputed from these records in Python, so a dashboard that
shows the ledger's numbers can be told apart from one that shows anything else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from billing.ledger import Ledger
from infermeter.config import Config
from tests.conftest import config_ledger

TEAMS = ("search", "assistant", "analytics")
# replica -> (model, node, GPU indexes)
REPLICAS = {
    "large-0": ("chat-large", "node-a", (0, 1)),
    "small-0": ("chat-small", "node-b", (0,)),
    "small-1": ("chat-small", "node-b", (1,)),
}
MINUTES = 60
ADMIN_KEY = "im-demo-admin"
TEAM_KEYS = {t: f"im-demo-{t}" for t in TEAMS}


@dataclass(frozen=True, slots=True)
class Fleet:
    """The records of one hour starting at ``start`` (a whole hour, in the past)."""

    start: int
    usage: list[dict[str, Any]]
    gpu: list[dict[str, Any]]
    engine: list[dict[str, Any]]


def ttft_of(minute: int, team_index: int) -> float:
    """The TTFT of a request: slow in minutes 40-44 (a bad period), fast otherwise."""
    base = 2.5 if 40 <= minute < 45 else 0.2
    return base + 0.01 * ((minute + team_index) % 10)


def build(start: int) -> Fleet:
    """One hour of usage, GPU and engine records from ``start``."""
    usage = []
    for minute in range(MINUTES):
        for ti, team in enumerate(TEAMS):
            for replica, (model, _, _) in REPLICAS.items():
                received = start + minute * 60 + 5.0 + ti
                ttft = ttft_of(minute, ti)
                failed = (minute + ti) % 13 == 0
                usage.append(
                    {
                        "request_id": f"r-{minute}-{team}-{replica}",
                        "team": team,
                        "model": model,
                        "served_version": model,
                        "replica": replica,
                        "received_at": received,
                        "first_token_at": received + ttft,
                        "finished_at": received + ttft + 4.0,
                        "prompt_tokens": 100 + 10 * ti,
                        "cached_prompt_tokens": 0,
                        "completion_tokens": 0 if failed else 50 + ti,
                        "status": "upstream_error" if failed else "ok",
                        "http_status": 500 if failed else 200,
                        "stream": True,
                    }
                )
    gpu, engine = [], []
    for k in range(MINUTES * 6):
        ts = start + (k + 1) * 10.0
        for replica, (model, node, gpus) in REPLICAS.items():
            for g in gpus:
                util = 0.5 + 0.1 * g
                power = 300.0 + 50 * g
                gpu.append(
                    {
                        "sample_id": f"g-{k}-{node}-{g}",
                        "node": node,
                        "gpu": str(g),
                        "uuid": f"GPU-{node}-{g}",
                        "gpu_model": "H100" if node == "node-a" else "L40S",
                        "replica": replica,
                        "model": model,
                        "timestamp": ts,
                        "interval_seconds": 10.0,
                        "utilization": util,
                        "power_watts": power,
                        "energy_joules": power * 10.0,
                        "memory_used_mib": 1000.0,
                        "memory_free_mib": 1000.0,
                    }
                )
            engine.append(
                {
                    "sample_id": f"e-{k}-{replica}",
                    "replica": replica,
                    "model": model,
                    "timestamp": ts,
                    "requests_running": 4.0,
                    "requests_waiting": float(k % 3),
                    "kv_cache_usage": 0.25,
                    "prompt_tokens_total": 0.0,
                    "generation_tokens_total": 0.0,
                }
            )
    return Fleet(start, usage, gpu, engine)


def recent_start(now: float | None = None) -> int:
    """The start of the last whole hour that ended at least a minute ago."""
    now = time.time() if now is None else now
    return int((now - 60) // 3600) * 3600 - 3600


def open_ledger(config: Config, path: str | Path, fleet: Fleet) -> Ledger:
    """A ledger at ``path`` holding ``fleet``, ingested the way the service ingests."""
    ledger = config_ledger(config, path)
    for key, records in (
        ("usage", fleet.usage),
        ("gpu_samples", fleet.gpu),
        ("engine_samples", fleet.engine),
    ):
        result = ledger.ingest(orjson.dumps({key: records}))
        assert not result.rejected, result.rejected[:3]
    return ledger
