"""Allocation over two frames, in a scratch DuckDB: for tests, worked examples and small jobs.

The SQL is ``billing.allocation``'s, the same the ledger runs over its rollups; only the
connection differs, and it comes from the ledger module (``billing.ledger.connect``), the one
place that opens DuckDB connections, so that what holds a database is found in one file.
"""

from __future__ import annotations

import polars as pl

from billing.allocation import Policy, allocation_sql, run
from billing.ledger import connect

__all__ = ["allocate"]


def _with_instance(frame: pl.DataFrame) -> pl.DataFrame:
    if "instance" not in frame.columns:
        frame = frame.with_columns(instance=pl.col("replica"))
    if "gpu_model" in frame.columns and "node" not in frame.columns:
        frame = frame.with_columns(node=pl.lit(""))  # GPUs priced by model alone
    if "cached_prompt_tokens" in frame.columns or "prompt_tokens" not in frame.columns:
        return frame
    return frame.with_columns(cached_prompt_tokens=pl.lit(0, pl.Int64))  # no prefix cache hits


def allocate(
    usage: pl.DataFrame,
    gpus: pl.DataFrame,
    policy: Policy,
    lifetimes: pl.DataFrame | None = None,
) -> tuple[pl.DataFrame, int]:
    """Lines and fleet cost (micro-cents) for two frames with the rollup tables' columns.

    Runs in a scratch in-memory DuckDB. Frames without an ``instance`` column are a fixed
    fleet's: each replica is its one instance. ``lifetimes`` (instance, replica, first_slot,
    last_slot), when given, bounds the instances it names.
    """
    with connect() as con:
        con.register("usage_in", _with_instance(usage))
        con.register("gpus_in", _with_instance(gpus))
        lives = None
        if lifetimes is not None:
            con.register("lifetimes_in", lifetimes)
            lives = "lifetimes_in"
        return run(con, allocation_sql(policy, "usage_in", "gpus_in", None, lives), policy)
