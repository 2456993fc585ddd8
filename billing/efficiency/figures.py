"""Efficiency figures: SQL built by pure functions over the ledger's rollups and raw tables.

What the fleet got for its GPU money, hour by hour: tokens per GPU-second, batch occupancy
(running sequences / ``max_num_seqs``), KV-cache use and preemptions, the prefix-cache hit rate,
queue depth and the wait it implies, the idle share, cost per 1M input and output tokens and
energy per token. The builders return ``(sql, params)`` and open nothing, so tests run them on
an in-memory DuckDB; ``billing.efficiency.store`` is the one module that holds a cursor.

Conventions the figures share:

- **Per instance, then per group.** The unit is the engine instance (a pod of a replica group;
  a fixed replica is its own one instance), as allocation's: every rollup is keyed by
  ``(replica, instance, slot)`` and every join between rollups includes ``instance``. Each
  figure is worked out for each instance-minute first, then summed over the group's instances:
  a join on the group alone pairs every instance's rows with every other's, counting a team's
  requests once per instance and its cost once per instance squared.
- **Cost** is measured the way the statement measures it: GPU-seconds x the price book's USD per
  GPU-hour, plus measured energy x USD per kWh x PUE. A GPU model without a price costs nothing
  here (the statement shows it as an error line).
- **Input and output cost** split a group's cost by ``billing.token_weights`` (prompt 1,
  completion 3 by default), the weights the ``tokens`` allocation uses: an output token costs
  ``completion / prompt`` input tokens.
- **Idle share**: ``1 - busy instance-seconds / measured instance-seconds``. A measured
  instance-minute (one with GPU time) is 60 s; it was busy for ``min(60, in-flight seconds on
  that instance)``, as the ``in_flight`` allocation counts idle capacity. Busy time is only
  counted in measured minutes, so the share lies in [0, 1] by construction.
- **Engines** in an hour: the mean live instances, instance-minutes with GPU time / the hour's
  minutes (those inside the range). **GPUs per engine**: GPU-seconds / measured
  instance-seconds, each instance's own GPUs, so a group of 2-GPU instances reads 2 whatever
  the instance count.
- **Engine gauges** (running, waiting, KV cache) are read per instance and minute first; a
  group's running and waiting sequences are its instances' summed each minute, its occupancy
  and KV use the mean over its instance-minutes. **Occupancy** is against the engine's real
  capacity: the fuller of its slots (running / ``max_num_seqs``) and its KV cache.
- **Queue wait** is Little's law over the engines' own queues: the group's mean waiting
  requests x the hour's seconds / requests served.
- **Counters** (prefix-cache queries and hits, preemptions) are read as Prometheus reads them:
  the increase between consecutive samples of one instance, a drop being a restart from zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from billing.pricebook import PriceBook, compute_usd_sql, energy_usd_sql, price_book, priced_sql
from billing.schema import SLOT_SECONDS
from infermeter.config import Config

__all__ = [
    "HOURS_PER_MONTH",
    "Fleet",
    "fleet_of",
    "group_hourly_sql",
    "instance_hourly_sql",
    "team_hourly_sql",
]

# 365 x 24 / 12: what a measured hourly cost becomes over a month.
HOURS_PER_MONTH: Final = 730.0
_MINUTES_PER_HOUR: Final = 3600 // SLOT_SECONDS

Sql = tuple[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Fleet:
    """What the figures need from the configuration: prices, engine limits, token weights.

    ``prices`` is the statement's own price object (``billing.pricebook.PriceBook``, what
    ``billing.charges.Policy.prices`` gives allocation): node pools, dated prices and energy, so
    the figures and the statements cost a GPU-minute from one object.
    """

    prices: PriceBook
    max_num_seqs: Mapping[str, int]  # replica group -> the engine's max_num_seqs
    replica_models: Mapping[str, str] = field(default_factory=dict)  # replica group -> model
    prompt_weight: float = 1.0
    completion_weight: float = 3.0


def fleet_of(config: Config) -> Fleet:
    """The ``Fleet`` a configuration describes (replicas without ``max_num_seqs`` are left out)."""
    return Fleet(
        prices=price_book(config.prices),
        max_num_seqs={r.id: r.max_num_seqs for r in config.replicas if r.max_num_seqs},
        replica_models={r.id: r.model for r in config.replicas},
        prompt_weight=config.billing.token_weights.prompt,
        completion_weight=config.billing.token_weights.completion,
    )


def _values(name: str, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[Any]]) -> Sql:
    """A CTE ``name`` holding ``rows`` as bound parameters (an empty one when there are none)."""
    params: dict[str, Any] = {}
    if not rows:
        nulls = ", ".join(f"NULL::{t} AS {c}" for c, t in columns)
        return f"{name} AS (SELECT {nulls} WHERE false)", params
    tuples = []
    for i, row in enumerate(rows):
        cells = []
        for j, ((_, sql_type), value) in enumerate(zip(columns, row, strict=True)):
            key = f"{name}_{i}_{j}"
            params[key] = value
            cells.append(f"${key}::{sql_type}")
        tuples.append(f"({', '.join(cells)})")
    names = ", ".join(c for c, _ in columns)
    return f"{name} AS (SELECT * FROM (VALUES {', '.join(tuples)}) AS v({names}))", params


def _range(lo_slot: int, hi_slot: int) -> dict[str, Any]:
    return {"lo": int(lo_slot), "hi": int(hi_slot)}


def _hour_minutes(hour: str) -> str:
    """SQL: the minutes of hour ``hour`` inside the range (60, but for a range's cut hour)."""
    m = _MINUTES_PER_HOUR
    return f"(least({m}, $hi - {hour} * {m}) - greatest(0, $lo - {hour} * {m}))"


def _cost_ctes(fleet: Fleet) -> Sql:
    """CTEs ``prices``, ``seqs``, ``cost`` and ``measured``: each instance's minutes.

    ``cost``: per replica group, instance and minute with GPU time, what it cost.
    ``measured``: the same minutes with the seconds the instance was busy in each (at most 60,
    and only in minutes it was measured, so busy time never exceeds measured time).
    """
    seqs, params = _values(
        "seqs",
        [("replica", "VARCHAR"), ("max_num_seqs", "BIGINT")],
        sorted(fleet.max_num_seqs.items()),
    )
    book = fleet.prices
    # The statement's prices (``billing.pricebook``): a GPU nothing prices costs nothing here.
    gpus = "(SELECT * FROM gpu_slots WHERE replica <> '' AND slot >= $lo AND slot < $hi)"
    cost = f"""cost AS (
    SELECT g.replica, g.instance, g.slot, min(g.gpu_model) AS gpu_model,
        sum(g.gpu_seconds) AS gpu_seconds, sum(g.energy_joules) AS energy_joules,
        sum(g.utilization_seconds) AS utilization_seconds,
        sum({compute_usd_sql("g.gpu_seconds", "coalesce(g.usd, 0)")}) AS gpu_usd,
        sum({energy_usd_sql("g.energy_joules", "g.kwh_usd")}) AS energy_usd
    FROM {priced_sql(book, gpus)} g
    GROUP BY g.replica, g.instance, g.slot HAVING sum(g.gpu_seconds) > 0),
measured AS (
    SELECT c.*, least(coalesce(r.inflight_seconds, 0), {SLOT_SECONDS}) AS busy_seconds
    FROM cost c
    LEFT JOIN (SELECT * FROM replica_slots WHERE slot >= $lo AND slot < $hi) r
        ON r.replica = c.replica AND r.instance = c.instance AND r.slot = c.slot)"""
    return f"{seqs}, {cost}", params


def _engine_cte() -> str:
    """CTE ``engine``: one row per engine sample, with its counters' increases since the last."""

    def increase(column: str) -> str:
        prev = f"lag({column}) OVER w"
        return (
            f"CASE WHEN {prev} IS NULL THEN 0 WHEN {column} >= {prev} THEN {column} - {prev} "
            f"ELSE {column} END AS {column.removesuffix('_total')}"
        )

    counters = ", ".join(
        increase(c)
        for c in ("prefix_cache_queries_total", "prefix_cache_hits_total", "preemptions_total")
    )
    # A minute before the range so the first increase inside it has a sample to start from.
    return f"""engine AS (
    SELECT * FROM (
        SELECT replica, model, coalesce(instance, replica) AS instance,
            CAST(floor("timestamp" / {SLOT_SECONDS}) AS BIGINT) AS slot,
            requests_running, requests_waiting, kv_cache_usage, kv_cache_tokens, {counters}
        FROM engine_samples
        WHERE "timestamp" >= (CAST($lo AS BIGINT) - 1) * {SLOT_SECONDS} AND "timestamp" < CAST($hi AS BIGINT) * {SLOT_SECONDS}
        WINDOW w AS (PARTITION BY coalesce(instance, replica) ORDER BY "timestamp"))
    WHERE slot >= $lo AND slot < $hi)"""


def _engine_minutes_cte() -> str:
    """CTE ``eng_min``: per replica group, instance and minute, the engine's gauges and counters.

    Occupancy is against the engine's real capacity: the fuller of its sequence slots (running
    over the group's ``max_num_seqs``) and its KV cache (the engine's own gauge, of the cache it
    reports), since either stops admission. It is taken from the minute's means (one join per
    instance-minute rather than per sample).
    """
    return """eng_min AS (
    SELECT m.*, greatest(m.running / s.max_num_seqs, m.kv) AS occupancy
    FROM (
        SELECT replica, instance, slot, any_value(model) AS model, avg(requests_running) AS running,
            avg(requests_waiting) AS waiting, max(requests_waiting) AS waiting_max,
            avg(kv_cache_usage) AS kv, max(kv_cache_usage) AS kv_max, sum(preemptions) AS preemptions,
            sum(prefix_cache_queries) AS queries, sum(prefix_cache_hits) AS hits
        FROM engine GROUP BY replica, instance, slot) m
    LEFT JOIN seqs s ON s.replica = m.replica)"""


def _per_million(cost: str, tokens: str) -> str:
    return f"CASE WHEN {tokens} > 0 THEN {cost} / {tokens} * 1e6 END"


def _token_costs(fleet: Fleet, cost: str, prompt: str, completion: str) -> str:
    """Cost per 1M input and output tokens: ``cost`` split by the token weights."""
    wp, wc = fleet.prompt_weight, fleet.completion_weight
    weighted = f"({wp!r} * {prompt} + {wc!r} * {completion})"
    return (
        f"{_per_million(f'{cost} * {wp!r}', weighted)} AS usd_per_1m_input_tokens, "
        f"{_per_million(f'{cost} * {wc!r}', weighted)} AS usd_per_1m_output_tokens"
    )


def _hourly_head(fleet: Fleet) -> Sql:
    """``WITH`` the cost CTEs, ``models`` (each replica group's model), ``engine``, ``eng_min``
    and ``inst_gpu`` (per instance and hour: GPU time, cost, measured and busy minutes): what
    the hourly queries start from."""
    ctes, params = _cost_ctes(fleet)
    models, p2 = _values(
        "models",
        [("replica", "VARCHAR"), ("model", "VARCHAR")],
        sorted(fleet.replica_models.items()),
    )
    inst_gpu = f"""inst_gpu AS (
    SELECT replica, instance, slot // {_MINUTES_PER_HOUR} AS hour, sum(gpu_seconds) AS gpu_seconds,
        sum(energy_joules) AS energy_joules, sum(gpu_usd) AS gpu_usd,
        sum(gpu_usd + energy_usd) AS cost_usd, sum(utilization_seconds) AS utilization_seconds,
        count(*) AS minutes, sum(busy_seconds) AS busy_seconds
    FROM measured GROUP BY ALL)"""
    head = f"WITH {ctes}, {models}, {_engine_cte()}, {_engine_minutes_cte()}, {inst_gpu}"
    return head, params | p2


def _time_figures(gpu: str, hour: str) -> str:
    """Select items over a ``gpu`` row (sums over instance-hours): engines, GPUs, idle share."""
    measured = f"{gpu}.minutes * {SLOT_SECONDS}"
    return f"""{gpu}.minutes / {_hour_minutes(hour)} AS engines,
    {gpu}.gpu_seconds / ({measured}) AS gpus_per_engine, {gpu}.minutes / {_MINUTES_PER_HOUR} AS instance_hours,
    {gpu}.busy_seconds / 3600 AS busy_hours, 1 - {gpu}.busy_seconds / ({measured}) AS idle_share"""


def group_hourly_sql(lo_slot: int, hi_slot: int, fleet: Fleet) -> Sql:
    """Per hour, model and replica group: what the GPUs cost and what they served (fleet-wide).

    Each instance's minutes are figured on their own (``inst_gpu``, ``eng_min``) and summed
    over the group; requests and tokens are the group's usage, each request once.
    """
    head, params = _hourly_head(fleet)
    sql = f"""
{head},
gpu AS (
    SELECT replica, hour, sum(gpu_seconds) AS gpu_seconds, sum(energy_joules) AS energy_joules,
        sum(cost_usd) AS cost_usd, sum(utilization_seconds) AS utilization_seconds,
        sum(minutes) AS minutes, sum(busy_seconds) AS busy_seconds, count(*) AS instances
    FROM inst_gpu GROUP BY ALL),
served AS (
    SELECT replica, slot // {_MINUTES_PER_HOUR} AS hour, any_value(model) AS model, sum(requests) AS requests,
        sum(prompt_tokens) AS prompt_tokens, sum(cached_prompt_tokens) AS cached_prompt_tokens,
        sum(completion_tokens) AS completion_tokens
    FROM usage_slots WHERE slot >= $lo AND slot < $hi GROUP BY replica, hour),
eng AS (
    SELECT replica, slot // {_MINUTES_PER_HOUR} AS hour, any_value(model) AS model,
        sum(running) / count(DISTINCT slot) AS requests_running,
        sum(waiting) / count(DISTINCT slot) AS requests_waiting,
        avg(occupancy) AS batch_occupancy, avg(kv) AS kv_cache_usage, max(kv_max) AS kv_cache_usage_max,
        sum(preemptions) AS preemptions, sum(queries) AS prefix_cache_queries, sum(hits) AS prefix_cache_hits
    FROM eng_min GROUP BY replica, hour)
SELECT gpu.hour * 3600 AS t, coalesce(served.model, eng.model, models.model) AS model, gpu.replica,
    gpu.instances, {_time_figures("gpu", "gpu.hour")},
    gpu.gpu_seconds / 3600 AS gpu_hours, gpu.cost_usd,
    CAST(coalesce(served.requests, 0) AS BIGINT) AS requests,
    CAST(coalesce(served.prompt_tokens, 0) AS BIGINT) AS prompt_tokens,
    CAST(coalesce(served.completion_tokens, 0) AS BIGINT) AS completion_tokens,
    (coalesce(served.prompt_tokens, 0) + coalesce(served.completion_tokens, 0)) / nullif(gpu.gpu_seconds, 0)
        AS tokens_per_gpu_second,
    gpu.utilization_seconds / nullif(gpu.gpu_seconds, 0) AS gpu_utilization,
    eng.batch_occupancy, eng.requests_running, eng.kv_cache_usage, eng.kv_cache_usage_max,
    eng.preemptions, eng.prefix_cache_hits / nullif(eng.prefix_cache_queries, 0) AS prefix_cache_hit_rate,
    coalesce(served.cached_prompt_tokens, 0) / nullif(served.prompt_tokens, 0) AS cached_prompt_share,
    eng.requests_waiting,
    eng.requests_waiting * {_hour_minutes("gpu.hour")} * {SLOT_SECONDS} / nullif(served.requests, 0)
        AS queue_wait_seconds,
    {_token_costs(fleet, "gpu.cost_usd", "served.prompt_tokens", "served.completion_tokens")},
    gpu.energy_joules / nullif(served.prompt_tokens + served.completion_tokens, 0) AS joules_per_token,
    gpu.energy_joules / 3.6e6 AS energy_kwh,
    gpu.energy_joules / 3.6e6 / nullif(served.prompt_tokens + served.completion_tokens, 0) * 1e6
        AS kwh_per_1m_tokens
FROM gpu
LEFT JOIN served ON served.replica = gpu.replica AND served.hour = gpu.hour
LEFT JOIN eng ON eng.replica = gpu.replica AND eng.hour = gpu.hour
LEFT JOIN models ON models.replica = gpu.replica
WHERE gpu.gpu_seconds > 0
ORDER BY gpu.replica, t, model"""
    return sql, params | _range(lo_slot, hi_slot)


def instance_hourly_sql(lo_slot: int, hi_slot: int, fleet: Fleet) -> Sql:
    """Per hour and engine instance: its GPU time, cost, idle share and GPUs, what it served, and
    its engine's occupancy, KV cache, preemptions, prefix hits and queue.

    An instance seen only by the engine collector, or only in the usage, still has its row
    (the figures it has no measurement for are empty).
    """
    head, params = _hourly_head(fleet)
    sql = f"""
{head},
inst_eng AS (
    SELECT replica, instance, slot // {_MINUTES_PER_HOUR} AS hour, any_value(model) AS model,
        avg(running) AS requests_running, avg(occupancy) AS batch_occupancy,
        avg(waiting) AS requests_waiting, max(waiting_max) AS requests_waiting_max,
        avg(kv) AS kv_cache_usage, max(kv_max) AS kv_cache_usage_max, sum(preemptions) AS preemptions,
        sum(hits) / nullif(sum(queries), 0) AS prefix_cache_hit_rate
    FROM eng_min GROUP BY replica, instance, hour),
inst_served AS (
    SELECT replica, instance, slot // {_MINUTES_PER_HOUR} AS hour, any_value(model) AS model,
        sum(requests) AS requests, sum(prompt_tokens) AS prompt_tokens,
        sum(completion_tokens) AS completion_tokens
    FROM usage_slots WHERE slot >= $lo AND slot < $hi GROUP BY replica, instance, hour),
joined AS (
    SELECT replica, instance, hour, coalesce(s.model, e.model) AS seen_model,
        g.gpu_seconds, g.cost_usd, g.minutes, g.busy_seconds, s.requests, s.prompt_tokens,
        s.completion_tokens, e.requests_running, e.batch_occupancy, e.requests_waiting,
        e.requests_waiting_max, e.kv_cache_usage, e.kv_cache_usage_max, e.preemptions,
        e.prefix_cache_hit_rate
    FROM inst_gpu g
    FULL JOIN inst_eng e USING (replica, instance, hour)
    FULL JOIN inst_served s USING (replica, instance, hour))
SELECT j.hour * 3600 AS t, coalesce(j.seen_model, models.model) AS model, j.replica, j.instance,
    {_time_figures("j", "j.hour")},
    j.gpu_seconds / 3600 AS gpu_hours, j.cost_usd,
    CAST(coalesce(j.requests, 0) AS BIGINT) AS requests,
    CAST(coalesce(j.prompt_tokens, 0) AS BIGINT) AS prompt_tokens,
    CAST(coalesce(j.completion_tokens, 0) AS BIGINT) AS completion_tokens,
    j.requests_running, j.batch_occupancy, j.requests_waiting, j.requests_waiting_max,
    j.kv_cache_usage, j.kv_cache_usage_max, j.preemptions, j.prefix_cache_hit_rate
FROM joined j LEFT JOIN models ON models.replica = j.replica
ORDER BY j.replica, j.instance, t"""
    return sql, params | _range(lo_slot, hi_slot)


def team_hourly_sql(lo_slot: int, hi_slot: int, fleet: Fleet, team: str | None = None) -> Sql:
    """Per hour, model and team: tokens, the busy cost of the team's in-flight share, unit costs.

    A team's cost here is its in-flight share of each of its instances' minutes (the ``in_flight``
    allocation without the idle part): what its own requests held of the GPUs. The share is of
    the instance that served them, never of the group: joined on the group alone, each of a
    team's rows would meet every instance's minute.
    """
    ctes, params = _cost_ctes(fleet)
    where = "" if team is None else "AND u.team = $team"
    if team is not None:
        params["team"] = team
    sql = f"""
WITH {ctes},
shares AS (
    SELECT u.slot // {_MINUTES_PER_HOUR} AS hour, u.model, u.team, u.requests, u.prompt_tokens,
        u.cached_prompt_tokens, u.completion_tokens, u.inflight_seconds,
        u.inflight_seconds / greatest({SLOT_SECONDS}, r.inflight_seconds) AS share,
        c.gpu_seconds, c.gpu_usd + c.energy_usd AS cost_usd, c.energy_joules
    FROM usage_slots u
    JOIN replica_slots r ON r.replica = u.replica AND r.instance = u.instance AND r.slot = u.slot
    LEFT JOIN cost c ON c.replica = u.replica AND c.instance = u.instance AND c.slot = u.slot
    WHERE u.slot >= $lo AND u.slot < $hi {where}),
hourly AS (
    SELECT hour, model, team, sum(requests) AS requests, sum(prompt_tokens) AS prompt_tokens,
        sum(cached_prompt_tokens) AS cached_prompt_tokens, sum(completion_tokens) AS completion_tokens,
        sum(share * coalesce(gpu_seconds, 0)) AS gpu_seconds, sum(share * coalesce(cost_usd, 0)) AS cost_usd,
        sum(share * coalesce(energy_joules, 0)) AS energy_joules
    FROM shares GROUP BY ALL)
SELECT hour * 3600 AS t, model, team, CAST(requests AS BIGINT) AS requests,
    CAST(prompt_tokens AS BIGINT) AS prompt_tokens, CAST(completion_tokens AS BIGINT) AS completion_tokens,
    gpu_seconds / 3600 AS gpu_hours, cost_usd,
    (prompt_tokens + completion_tokens) / nullif(gpu_seconds, 0) AS tokens_per_gpu_second,
    cached_prompt_tokens / nullif(prompt_tokens, 0) AS cached_prompt_share,
    {_token_costs(fleet, "cost_usd", "prompt_tokens", "completion_tokens")},
    energy_joules / nullif(prompt_tokens + completion_tokens, 0) AS joules_per_token,
    energy_joules / 3.6e6 AS energy_kwh
FROM hourly ORDER BY team, model, t"""
    return sql, params | _range(lo_slot, hi_slot)
