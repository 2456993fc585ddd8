"""A month of node pools, a commitment, prompt caching and projects, built by hand.

The statement of November 2026 (30 days, 720 hours) below is built by hand, as billing hands it
to the exporters when its lines are split by instance and by the requests' tags:

| team      | model      | instance     | pool     | category  | project | GPU-h | cents  |
|-----------|------------|--------------|----------|-----------|---------|-------|--------|
| search    | chat-small | small-0-a    | reserved | committed |         | 240   | 48 000 |
| assistant | chat-small | small-0-a    | reserved | committed | alpha   | 80    | 16 000 |
| assistant | chat-small | small-0-a    | reserved | committed | beta    | 40    | 8 000  |
| research  | chat-large | large-0-spot | spot     | spot      |         | 10    | 1 200  |
| research  | chat-large | large-0-own  | owned    | owned     |         | 20    | 1 900  |

The pool ``reserved`` commits 1 GPU for the month at $2.00 per GPU-hour: 720 GPU-hours,
$1,440.00. Its rows use 240 + 80 + 40 = 360 GPU-hours, $720.00 at that rate: half. The other
360 GPU-hours, $720.00, are the commitment left unused, so Used ($720.00) + Unused ($720.00) =
$1,440.00, what the commitment cost.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from infermeter.config import Config, NodePool
from infermeter.statement import CACHE_SCHEMA, LINE_SCHEMA, POOL_SCHEMA, Statement

MONTH = "2026-11"
SPLIT = {
    "replica": pl.String,
    "instance": pl.String,
    "pool": pl.String,
    "pricing_category": pl.String,
    "sku": pl.String,
    "project": pl.String,
    "user": pl.String,
}
# team, model, replica, instance, pool, category, sku, project, user, GPU-hours, cents, prompt
ROWS = [
    (
        "search",
        "chat-small",
        "small-0",
        "small-0-a",
        "reserved",
        "committed",
        "gpu-h100-1y",
        None,
        None,
        240.0,
        48000,
        10000,
    ),
    (
        "assistant",
        "chat-small",
        "small-0",
        "small-0-a",
        "reserved",
        "committed",
        "gpu-h100-1y",
        "alpha",
        "u1",
        80.0,
        16000,
        3000,
    ),
    (
        "assistant",
        "chat-small",
        "small-0",
        "small-0-a",
        "reserved",
        "committed",
        "gpu-h100-1y",
        "beta",
        "u2",
        40.0,
        8000,
        1000,
    ),
    (
        "research",
        "chat-large",
        "large-0",
        "large-0-spot",
        "spot",
        "spot",
        None,
        None,
        None,
        10.0,
        1200,
        500,
    ),
    (
        "research",
        "chat-large",
        "large-0",
        "large-0-own",
        "owned",
        "owned",
        None,
        None,
        None,
        20.0,
        1900,
        700,
    ),
]
TOTAL_CENTS = 48000 + 16000 + 8000 + 1200 + 1900  # 75 100


def lines(rows: list[tuple[Any, ...]]) -> pl.DataFrame:
    """``rows`` (laid out as ``ROWS``) as statement lines split by instance and tags."""
    records = [
        {
            "month": MONTH,
            "for_month": MONTH,
            "team": t,
            "model": m,
            "requests": 10,
            "prompt_tokens": prompt,
            "completion_tokens": 100,
            "gpu_hours": hours,
            "energy_kwh": 0.0,
            "compute_cents": cents,
            "energy_cents": 0,
            "idle_cents": 0,
            "total_cents": cents,
            "replica": r,
            "instance": i,
            "pool": p,
            "pricing_category": c,
            "sku": s,
            "project": pr,
            "user": u,
        }
        for t, m, r, i, p, c, s, pr, u, hours, cents, prompt in rows
    ]
    return pl.DataFrame(records, schema={**LINE_SCHEMA, **SPLIT})


def pools() -> pl.DataFrame:
    """The month's pools as ``statement.pools`` has them: ``reserved`` half used."""
    return pl.DataFrame(
        [
            {
                "pool": "reserved",
                "category": "committed",
                "gpu_hours": 360.0,
                "energy_kwh": 0.0,
                "list_cents": 72000,
                "committed_gpu_hours": 720.0,
                "committed_cents": 144000,
                "unused_commitment_cents": 72000,
                "commitment_utilization": 0.5,
            },
            {
                "pool": "spot",
                "category": "spot",
                "gpu_hours": 10.0,
                "energy_kwh": 0.0,
                "list_cents": 1200,
                "committed_gpu_hours": 0.0,
                "committed_cents": 0,
                "unused_commitment_cents": 0,
                "commitment_utilization": None,
            },
        ],
        schema=POOL_SCHEMA,
    )


def statement(**kw: Any) -> Statement:
    """The month above on the list basis, search's prompts hitting the cache 4,000 times."""
    cache = pl.DataFrame(
        [
            {
                "team": "search",
                "model": "chat-small",
                "prompt_tokens": 10000,
                "cached_prompt_tokens": 4000,
                "cache_savings_cents": 150,
            }
        ],
        schema=CACHE_SCHEMA,
    )
    args: dict[str, Any] = {"pools": pools(), "cache": cache} | kw
    made = args.pop("lines", None)
    return Statement(MONTH, False, lines(ROWS) if made is None else made, TOTAL_CENTS, 0, **args)


def pooled(config: Config) -> Config:
    """The demo configuration with the three pools, ``reserved`` naming its SKU."""

    def pool(name: str, entry: dict[str, Any]) -> NodePool:
        return NodePool.model_validate(
            {"name": name, "nodes": [f"node-{name}"], "prices": [{"from": "2026-01-01", **entry}]}
        )

    book = [
        pool(
            "reserved",
            {
                "category": "committed",
                "usd_per_gpu_hour": 2.0,
                "committed_gpus": 1,
                "sku": "gpu-h100-1y",
            },
        ),
        pool("spot", {"category": "spot", "usd_per_gpu_hour": 1.2}),
        pool(
            "owned",
            {"category": "owned", "purchase_usd_per_gpu": 20000.0, "depreciation_months": 36},
        ),
    ]
    return config.model_copy(update={"prices": config.prices.model_copy(update={"pools": book})})
