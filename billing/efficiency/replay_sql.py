"""What the replay is built from: SQL over the ledger, built by pure functions.

- ``arrivals_sql``: every billable request received in the range, in arrival order: team,
  model, prompt and output tokens, choices, whether it streamed, its shared prompt head (the
  sidecar's digest, with the head's tokens: its share of the prompt), and whether its first
  token was seen (TTFT is measured, and held to its SLA, only where it was).
- ``runs_sql``: the engine instances as they ran. An instance with a lifetime (its sidecar's
  start, heartbeats and stop, ``billing.lifetimes``) runs from its start to its end, with the
  GPUs it announced; one without (a fixed replica whose sidecar says nothing) runs over each
  stretch of consecutive minutes it had GPU time, with the GPUs measured.
- ``group_measured_sql``: per replica group, what the replay as it ran is held to: GPU time and
  its cost, and the TTFT and inter-token p95 of its finished requests.
- ``group_engine_sql``: per replica group, the engines' own figures: batch occupancy, the
  deepest queue, the fullest KV cache, preemptions, prefix-cache lookups and hits, and the KV
  cache's size as vLLM reported it (``vllm:cache_config_info``).
- ``hours_sql``: the hours with GPU time measured, which a month is scaled from.
"""

from __future__ import annotations

from billing.efficiency.figures import Fleet, Sql, _cost_ctes, _engine_cte, _range, _values
from billing.lifetimes import ended_sql
from billing.schema import SLOT_SECONDS
from infermeter.records import BILLABLE_STATUSES

__all__ = ["arrivals_sql", "group_engine_sql", "group_measured_sql", "hours_sql", "runs_sql"]

_BILLABLE = ", ".join(f"'{s.value}'" for s in BILLABLE_STATUSES)
# Slots are widened before they become seconds: a bound 32-bit slot times 60 overflows past 2038.
_RECEIVED = f"received_at >= CAST($lo AS BIGINT) * {SLOT_SECONDS} AND received_at < CAST($hi AS BIGINT) * {SLOT_SECONDS}"


def arrivals_sql(lo_slot: int, hi_slot: int) -> Sql:
    """The billable requests received in the range, in arrival order."""
    sql = f"""
SELECT received_at AS t, team, model, prompt_tokens, completion_tokens, choices, stream,
    CASE WHEN prefix_digest IS NOT NULL AND coalesce(prefix_share, 0) > 0 THEN prefix_digest END AS head,
    CAST(floor(coalesce(prefix_share, 0) * prompt_tokens) AS BIGINT) AS head_tokens,
    first_token_at IS NOT NULL AS timed
FROM usage
WHERE status IN ({_BILLABLE}) AND {_RECEIVED}
ORDER BY received_at, request_id"""
    return sql, _range(lo_slot, hi_slot)


def runs_sql(lo_slot: int, hi_slot: int, heartbeat_seconds: float) -> Sql:
    """The instances that ran in the range: (replica, instance, start, end, gpus, lifetime)."""
    ended = ended_sql(heartbeat_seconds)
    sql = f"""
WITH life AS (
    SELECT replica, instance, started_at AS start, {ended} AS "end", gpu_count AS gpus
    FROM lifetimes),
life_in AS (
    SELECT * FROM life WHERE start < CAST($hi AS BIGINT) * {SLOT_SECONDS} AND "end" > CAST($lo AS BIGINT) * {SLOT_SECONDS}),
minutes AS (
    SELECT replica, instance, slot, sum(gpu_seconds) AS gpu_seconds
    FROM gpu_slots WHERE replica <> '' AND slot >= $lo AND slot < $hi
    GROUP BY ALL HAVING sum(gpu_seconds) > 0),
fixed AS (
    SELECT *, slot - row_number() OVER (PARTITION BY replica, instance ORDER BY slot) AS island
    FROM minutes WHERE instance NOT IN (SELECT instance FROM life_in))
SELECT replica, instance, start, "end", CAST(gpus AS DOUBLE) AS gpus, true AS lifetime FROM life_in
UNION ALL
SELECT replica, instance, min(slot) * {SLOT_SECONDS}.0 AS start, (max(slot) + 1) * {SLOT_SECONDS}.0,
    sum(gpu_seconds) / (count(*) * {SLOT_SECONDS}.0), false
FROM fixed GROUP BY replica, instance, island
ORDER BY replica, instance, start"""
    return sql, _range(lo_slot, hi_slot)


def group_measured_sql(lo_slot: int, hi_slot: int, fleet: Fleet) -> Sql:
    """Per replica group: GPU seconds and their cost, requests, TTFT and inter-token p95."""
    ctes, params = _cost_ctes(fleet)
    finished = "status = 'ok' AND first_token_at IS NOT NULL"
    sql = f"""
WITH {ctes},
gpu AS (SELECT replica, sum(gpu_seconds) AS gpu_seconds, sum(gpu_usd) AS gpu_usd FROM cost GROUP BY replica),
served AS (
    SELECT replica, any_value(model) AS model, count(*) AS requests,
        quantile_cont(first_token_at - received_at, 0.95) FILTER (WHERE {finished}) AS ttft_p95,
        quantile_cont((finished_at - first_token_at) / (completion_tokens - 1), 0.95)
            FILTER (WHERE {finished} AND completion_tokens >= 2 AND choices = 1) AS itl_p95
    FROM usage WHERE status IN ({_BILLABLE}) AND {_RECEIVED} GROUP BY replica)
SELECT replica, s.model, coalesce(g.gpu_seconds, 0) AS gpu_seconds, coalesce(g.gpu_usd, 0) AS gpu_usd,
    s.ttft_p95, s.itl_p95, CAST(coalesce(s.requests, 0) AS BIGINT) AS requests
FROM gpu g FULL JOIN served s USING (replica)
ORDER BY replica"""
    return sql, params | _range(lo_slot, hi_slot)


def group_engine_sql(lo_slot: int, hi_slot: int, fleet: Fleet) -> Sql:
    """Per replica group: occupancy, deepest queue, fullest KV cache, preemptions, prefix-cache
    lookups and hits, and the smallest KV cache any of its engines reported."""
    seqs, params = _values(
        "seqs",
        [("replica", "VARCHAR"), ("max_num_seqs", "BIGINT")],
        sorted(fleet.max_num_seqs.items()),
    )
    sql = f"""
WITH {seqs}, {_engine_cte()}
SELECT e.replica, any_value(e.model) AS model,
    avg(e.requests_running / s.max_num_seqs) AS batch_occupancy,
    max(e.requests_waiting) AS requests_waiting_max, max(e.kv_cache_usage) AS kv_cache_usage_max,
    coalesce(sum(e.preemptions), 0) AS preemptions,
    coalesce(sum(e.prefix_cache_queries), 0) AS prefix_cache_queries,
    coalesce(sum(e.prefix_cache_hits), 0) AS prefix_cache_hits,
    min(e.kv_cache_tokens) FILTER (WHERE e.kv_cache_tokens > 0) AS kv_cache_tokens
FROM engine e LEFT JOIN seqs s ON s.replica = e.replica
GROUP BY e.replica ORDER BY e.replica"""
    return sql, params | _range(lo_slot, hi_slot)


def hours_sql(lo_slot: int, hi_slot: int) -> Sql:
    """The number of hours in the range with GPU time measured on a replica group."""
    sql = f"""
SELECT count(DISTINCT slot // {3600 // SLOT_SECONDS}) AS hours
FROM gpu_slots WHERE replica <> '' AND slot >= $lo AND slot < $hi AND gpu_seconds > 0"""
    return sql, _range(lo_slot, hi_slot)
