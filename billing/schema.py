"""The ledger's tables, as an ordered list of migrations.

A ledger file records the highest migration it has applied in ``schema_version``; opening it
applies the rest, each in its own transaction, so an old file is brought forward and a file
from a newer infermeter is refused rather than misread.

Times are Unix seconds (DOUBLE) in UTC, as the records carry them. The raw tables keep every
accepted record exactly as sent (plus ``ingested_at``); a field added to a record kind later
(``infermeter.records``) needs no migration of its own: ``new_field_sql`` adds its column, with
the field's default for the rows already there; the ``*_slots`` tables are rollups that ingest maintains in the
same transaction, keyed by one-minute slots (``slot`` = Unix minute). Chargeback and the
dashboards read the rollups, so their cost does not grow with the number of requests.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

from billing.columns import column_ddl
from infermeter.records import RecordKind

__all__ = [
    "EDGE_SECONDS",
    "HOUR_SECONDS",
    "LATEST_VERSION",
    "MIGRATIONS",
    "SLOT_SECONDS",
    "USAGE_TAGS_VERSION",
    "new_field_sql",
]

SLOT_SECONDS: Final = 60
HOUR_SECONDS: Final = 3600
# How close to the end of its hour an instance's engine must have been read last for that hour's
# tokens to come from ``usage_hours`` (see ``_V6``); a collector reading at least once a minute.
EDGE_SECONDS: Final = 60

_V1 = """
CREATE TABLE usage (
    request_id VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    served_version VARCHAR NOT NULL,
    replica VARCHAR NOT NULL,
    received_at DOUBLE NOT NULL,
    first_token_at DOUBLE,
    finished_at DOUBLE NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    status VARCHAR NOT NULL,
    http_status INTEGER NOT NULL,
    stream BOOLEAN NOT NULL,
    endpoint VARCHAR NOT NULL,
    finish_reason VARCHAR,
    usage_exact BOOLEAN NOT NULL,
    ingested_at DOUBLE NOT NULL
);
CREATE TABLE gpu_samples (
    sample_id VARCHAR NOT NULL,
    node VARCHAR NOT NULL,
    gpu VARCHAR NOT NULL,
    uuid VARCHAR NOT NULL,
    gpu_model VARCHAR NOT NULL,
    replica VARCHAR,
    model VARCHAR,
    "timestamp" DOUBLE NOT NULL,
    interval_seconds DOUBLE NOT NULL,
    utilization DOUBLE NOT NULL,
    power_watts DOUBLE NOT NULL,
    energy_joules DOUBLE,
    memory_used_mib DOUBLE NOT NULL,
    memory_free_mib DOUBLE NOT NULL,
    xid_errors BIGINT NOT NULL,
    mig_profile VARCHAR,
    gap BOOLEAN NOT NULL,
    ingested_at DOUBLE NOT NULL
);
CREATE TABLE engine_samples (
    sample_id VARCHAR NOT NULL,
    replica VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    "timestamp" DOUBLE NOT NULL,
    requests_running DOUBLE NOT NULL,
    requests_waiting DOUBLE NOT NULL,
    kv_cache_usage DOUBLE NOT NULL,
    prompt_tokens_total DOUBLE NOT NULL,
    generation_tokens_total DOUBLE NOT NULL,
    prefix_cache_queries_total DOUBLE NOT NULL,
    prefix_cache_hits_total DOUBLE NOT NULL,
    preemptions_total DOUBLE NOT NULL,
    ingested_at DOUBLE NOT NULL
);
-- What each team had in flight on each replica, minute by minute, and what finished in it.
-- in-flight seconds are spread over every slot a request overlaps; counts and tokens land in
-- the slot where the request finished.
CREATE TABLE usage_slots (
    replica VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    slot BIGINT NOT NULL,
    inflight_seconds DOUBLE NOT NULL,
    requests BIGINT NOT NULL,
    failed_requests BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    ttft_seconds_sum DOUBLE NOT NULL,
    ttft_count BIGINT NOT NULL,
    ttft_within_sla BIGINT NOT NULL,
    decode_seconds_sum DOUBLE NOT NULL,
    PRIMARY KEY (replica, team, model, slot)
);
-- GPU time and energy per replica ('': a GPU no replica runs on) and minute. A sample covers
-- the interval before its timestamp and is spread over the slots that interval overlaps.
CREATE TABLE gpu_slots (
    node VARCHAR NOT NULL,
    gpu_model VARCHAR NOT NULL,
    replica VARCHAR NOT NULL,
    slot BIGINT NOT NULL,
    gpu_seconds DOUBLE NOT NULL,
    energy_joules DOUBLE NOT NULL,
    unmeasured_seconds DOUBLE NOT NULL,
    utilization_seconds DOUBLE NOT NULL,  -- utilization x seconds: / gpu_seconds = mean use
    power_watt_seconds DOUBLE NOT NULL,
    samples BIGINT NOT NULL,
    xid_errors BIGINT NOT NULL,
    PRIMARY KEY (node, gpu_model, replica, slot)
);
-- Distribution of time to first token per model, team and slot, in log buckets (see
-- billing.buckets), so percentiles and SLA shares come from a rollup, not from raw rows.
CREATE TABLE ttft_buckets (
    model VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    slot BIGINT NOT NULL,
    bucket SMALLINT NOT NULL,
    requests BIGINT NOT NULL,
    PRIMARY KEY (model, team, slot, bucket)
);
-- A month is open until it is closed; a closed month's statement lines are frozen in
-- statement_lines and never change. dirty: records for it arrived after it was closed.
CREATE TABLE months (
    month VARCHAR PRIMARY KEY,
    closed_at DOUBLE,
    dirty BOOLEAN NOT NULL DEFAULT false
);
CREATE TABLE statement_lines (
    month VARCHAR NOT NULL,
    for_month VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    requests BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    gpu_hours DOUBLE NOT NULL,
    energy_kwh DOUBLE NOT NULL,
    compute_cents BIGINT NOT NULL,
    energy_cents BIGINT NOT NULL,
    idle_cents BIGINT NOT NULL,
    total_cents BIGINT NOT NULL
);
"""

# In-flight seconds per replica and slot, summed over teams: the denominator of the in-flight
# split, kept at ingest so a statement does not regroup every team's rows by minute.
_V2 = """
CREATE TABLE replica_slots (
    replica VARCHAR NOT NULL,
    slot BIGINT NOT NULL,
    inflight_seconds DOUBLE NOT NULL,
    PRIMARY KEY (replica, slot)
);
INSERT INTO replica_slots
SELECT replica, slot, sum(inflight_seconds) FROM usage_slots GROUP BY replica, slot;
"""

# The lifetimes of the instances of a dynamic fleet, as each announced them
# (``infermeter.records.InstanceEvent``).
_V3 = """
CREATE TABLE instance_events (
    event_id VARCHAR NOT NULL,
    instance VARCHAR NOT NULL,
    replica VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    event VARCHAR NOT NULL,
    "timestamp" DOUBLE NOT NULL,
    started_at DOUBLE NOT NULL,
    node VARCHAR NOT NULL,
    gpu_model VARCHAR NOT NULL,
    gpu_count BIGINT NOT NULL,
    gpus VARCHAR NOT NULL DEFAULT '',
    namespace VARCHAR,
    pod_uid VARCHAR,
    engine_metrics_url VARCHAR,
    ingested_at DOUBLE NOT NULL
);
"""

# The allocation unit becomes the instance: each rollup gains ``instance`` (the engine instance,
# ``coalesce(instance, replica)`` of the records; '' with replica '' for a GPU no instance runs
# on) and is keyed by it, so N pods of one replica group are N rows per minute, not one. DuckDB
# cannot change a primary key in place, so each table is rebuilt; rows already kept are a fixed
# replica's, whose one instance is the replica itself.
_V4 = """
CREATE TABLE usage_slots_v4 (
    replica VARCHAR NOT NULL,
    instance VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    slot BIGINT NOT NULL,
    inflight_seconds DOUBLE NOT NULL,
    requests BIGINT NOT NULL,
    failed_requests BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    ttft_seconds_sum DOUBLE NOT NULL,
    ttft_count BIGINT NOT NULL,
    ttft_within_sla BIGINT NOT NULL,
    decode_seconds_sum DOUBLE NOT NULL,
    PRIMARY KEY (replica, instance, team, model, slot)
);
INSERT INTO usage_slots_v4
SELECT replica, replica, team, model, slot, inflight_seconds, requests, failed_requests,
    prompt_tokens, cached_prompt_tokens, completion_tokens, ttft_seconds_sum, ttft_count,
    ttft_within_sla, decode_seconds_sum
FROM usage_slots;
DROP TABLE usage_slots;
ALTER TABLE usage_slots_v4 RENAME TO usage_slots;
CREATE TABLE replica_slots_v4 (
    replica VARCHAR NOT NULL,
    instance VARCHAR NOT NULL,
    slot BIGINT NOT NULL,
    inflight_seconds DOUBLE NOT NULL,
    PRIMARY KEY (replica, instance, slot)
);
INSERT INTO replica_slots_v4 SELECT replica, replica, slot, inflight_seconds FROM replica_slots;
DROP TABLE replica_slots;
ALTER TABLE replica_slots_v4 RENAME TO replica_slots;
CREATE TABLE gpu_slots_v4 (
    node VARCHAR NOT NULL,
    gpu_model VARCHAR NOT NULL,
    replica VARCHAR NOT NULL,
    instance VARCHAR NOT NULL,
    slot BIGINT NOT NULL,
    gpu_seconds DOUBLE NOT NULL,
    energy_joules DOUBLE NOT NULL,
    unmeasured_seconds DOUBLE NOT NULL,
    utilization_seconds DOUBLE NOT NULL,
    power_watt_seconds DOUBLE NOT NULL,
    samples BIGINT NOT NULL,
    xid_errors BIGINT NOT NULL,
    PRIMARY KEY (node, gpu_model, replica, instance, slot)
);
INSERT INTO gpu_slots_v4
SELECT node, gpu_model, replica, replica, slot, gpu_seconds, energy_joules, unmeasured_seconds,
    utilization_seconds, power_watt_seconds, samples, xid_errors
FROM gpu_slots;
DROP TABLE gpu_slots;
ALTER TABLE gpu_slots_v4 RENAME TO gpu_slots;
"""

# The budget overrides admins granted, as the sidecar that took each one recorded it
# (``infermeter.records.BudgetOverride``).
_V5 = """
CREATE TABLE budget_overrides (
    override_id VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    admin_reason VARCHAR NOT NULL,
    until DOUBLE NOT NULL,
    issued_at DOUBLE NOT NULL,
    issued_by VARCHAR NOT NULL,
    ingested_at DOUBLE NOT NULL
);
"""

# What a statement reads, kept at ingest so that it never reads the raw rows nor joins on strings.
#
# Allocation: ``alloc_units`` numbers the instances (replica group, instance) and ``alloc_keys``
# the (instance, team, model) rows of ``usage_slots``; ``alloc_slots`` is ``usage_slots``' in-flight
# seconds under those numbers (one row for each of its rows), so the statement's one big join, every
# team's minutes against its instance's cost, compares integers; ``alloc_hours`` holds the
# requests and tokens per key and hour (of the slot they finished in; a row for every hour a
# key has slots in), so counts and the token and request splits read a few rows per hour.
#
# Reconciliation (``billing.reconciliation``), per instance (``coalesce(instance, replica)``):
# ``usage_hours`` sums the billable records' tokens by the hour of their first token, for the
# records that end at least ``EDGE_SECONDS`` before that hour does; ``usage_edges`` keeps the
# others (ending in the last ``EDGE_SECONDS`` of that hour, or later) one row each. An
# instance-hour whose engine was last read within ``EDGE_SECONDS`` of its end (every hour, for a
# collector reading at least once a minute) holds every record of the first kind whole, so its
# tokens are read from the sums; only the records near an hour's edge are placed one by one.
# ``engine_hours`` holds per instance-hour the engine counters' first and last readings and
# their increases in between, so the hourly engine tokens come from a row per hour, not from
# every sample. These three are filled from the raw rows by ``billing.ledger.migrate`` (with
# ingest's own SQL, once the raw tables have all their fields).
_V6 = f"""
CREATE TABLE alloc_units (
    unit INTEGER PRIMARY KEY,
    replica VARCHAR NOT NULL,
    instance VARCHAR NOT NULL,
    UNIQUE (replica, instance)
);
CREATE TABLE alloc_keys (
    "key" INTEGER PRIMARY KEY,
    unit INTEGER NOT NULL,
    replica VARCHAR NOT NULL,
    instance VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    UNIQUE (replica, instance, team, model)
);
CREATE TABLE alloc_slots (
    "key" INTEGER NOT NULL,
    unit INTEGER NOT NULL,
    slot BIGINT NOT NULL,
    inflight_seconds DOUBLE NOT NULL,
    PRIMARY KEY ("key", slot)
);
CREATE TABLE alloc_hours (
    "key" INTEGER NOT NULL,
    hour BIGINT NOT NULL,
    requests BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    PRIMARY KEY ("key", hour)
);
CREATE TABLE usage_hours (
    instance VARCHAR NOT NULL,
    hour BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    PRIMARY KEY (instance, hour)
);
CREATE TABLE usage_edges (
    instance VARCHAR NOT NULL,
    first_token_at DOUBLE NOT NULL,  -- least(coalesce(first_token_at, finished_at), finished_at)
    finished_at DOUBLE NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL
);
CREATE TABLE engine_hours (
    instance VARCHAR NOT NULL,
    hour BIGINT NOT NULL,
    replica VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    samples BIGINT NOT NULL,
    first_ts DOUBLE NOT NULL,
    last_ts DOUBLE NOT NULL,
    first_prompt_total DOUBLE NOT NULL,
    first_generation_total DOUBLE NOT NULL,
    last_prompt_total DOUBLE NOT NULL,
    last_generation_total DOUBLE NOT NULL,
    prompt_tokens DOUBLE NOT NULL,  -- the counters' increases between the hour's own samples
    generation_tokens DOUBLE NOT NULL,
    PRIMARY KEY (instance, hour)
);
INSERT INTO alloc_units
SELECT row_number() OVER (ORDER BY replica, instance), replica, instance
FROM (SELECT DISTINCT replica, instance FROM usage_slots);
INSERT INTO alloc_keys
SELECT row_number() OVER (ORDER BY k.replica, k.instance, k.team, k.model), u.unit,
    k.replica, k.instance, k.team, k.model
FROM (SELECT DISTINCT replica, instance, team, model FROM usage_slots) k
JOIN alloc_units u USING (replica, instance);
INSERT INTO alloc_slots
SELECT k."key", k.unit, s.slot, s.inflight_seconds
FROM usage_slots s JOIN alloc_keys k USING (replica, instance, team, model);
INSERT INTO alloc_hours
SELECT k."key", s.slot // {HOUR_SECONDS // SLOT_SECONDS}, sum(s.requests), sum(s.prompt_tokens),
    sum(s.completion_tokens)
FROM usage_slots s JOIN alloc_keys k USING (replica, instance, team, model)
GROUP BY ALL;
"""

# One row per instance lifetime (``billing.lifetimes``), folded from ``instance_events`` at ingest
# so that readers never aggregate heartbeats: the latest event's word on the instance (by time,
# then ``latest_event_id``; for a field an event may leave null, the latest word given and the
# event it came from), its first and last event, its stop, how many events and heartbeats
# were counted, and, while it has not stopped, the latest GPU and engine sample attributed to it
# after its last event (evidence of when it ended). Filled from the raw events
# and samples by ``billing.ledger.migrate``, with ingest's own SQL.
_V7 = """
CREATE TABLE lifetimes (
    instance VARCHAR NOT NULL,
    started_at DOUBLE NOT NULL,
    replica VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    node VARCHAR NOT NULL,
    gpu_model VARCHAR NOT NULL,
    gpu_count BIGINT NOT NULL,
    gpus VARCHAR NOT NULL,
    namespace VARCHAR,
    pod_uid VARCHAR,
    engine_metrics_url VARCHAR,
    namespace_from STRUCT(t DOUBLE, id VARCHAR),  -- (time, event id) of the event that gave it
    pod_uid_from STRUCT(t DOUBLE, id VARCHAR),
    engine_metrics_url_from STRUCT(t DOUBLE, id VARCHAR),
    latest_event_id VARCHAR NOT NULL,
    first_seen DOUBLE NOT NULL,
    last_seen DOUBLE NOT NULL,
    stopped_at DOUBLE,
    events BIGINT NOT NULL,
    heartbeats BIGINT NOT NULL,
    gpu_seen_until DOUBLE,
    engine_seen_until DOUBLE,
    PRIMARY KEY (instance, started_at)
);
"""

# The autoscaler's decisions: each change of a model's desired replica count, when and why
# (``infermeter.records.ScalingDecision``), for the fleet view (``billing.fleet``).
_V8 = """
CREATE TABLE scaling_decisions (
    decision_id VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    decided_at DOUBLE NOT NULL,
    previous BIGINT NOT NULL,
    current BIGINT NOT NULL,
    desired BIGINT NOT NULL,
    reasons VARCHAR NOT NULL,
    ingested_at DOUBLE NOT NULL
);
"""

# Reconciliation, second form (``billing.reconciliation``). ``usage_hours`` and ``usage_edges`` hold
# prompt tokens as vLLM counts them, once per choice (``prompt_tokens x choices``), and the replica
# group and model of their records; ``usage_hours`` counts its records, so an hour no engine
# reading covers is reported with its requests. ``usage_hangups`` keeps every client-aborted
# record whole: reconciliation examines only the sample intervals that hold one's end, for the
# tokens vLLM generated after the hang-up. The two tables are rebuilt and all three filled from
# the raw rows by ``billing.ledger.migrate`` (with ingest's own SQL).
_V9 = """
DROP TABLE usage_hours;
CREATE TABLE usage_hours (
    instance VARCHAR NOT NULL,
    hour BIGINT NOT NULL,
    replica VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    requests BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,  -- prompt_tokens x choices
    completion_tokens BIGINT NOT NULL,
    PRIMARY KEY (instance, hour)
);
DROP TABLE usage_edges;
CREATE TABLE usage_edges (
    instance VARCHAR NOT NULL,
    replica VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    first_token_at DOUBLE NOT NULL,  -- least(coalesce(first_token_at, finished_at), finished_at)
    finished_at DOUBLE NOT NULL,
    prompt_tokens BIGINT NOT NULL,  -- prompt_tokens x choices
    completion_tokens BIGINT NOT NULL
);
CREATE TABLE usage_hangups (
    request_id VARCHAR NOT NULL,
    instance VARCHAR NOT NULL,
    replica VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    received_at DOUBLE NOT NULL,
    first_token_at DOUBLE NOT NULL,  -- as in usage_edges
    finished_at DOUBLE NOT NULL,
    prompt_tokens BIGINT NOT NULL,  -- prompt_tokens x choices
    completion_tokens BIGINT NOT NULL,
    choices BIGINT NOT NULL
);
"""

# Records billing keeps but does not bill (``billing.quarantine``): written by a credential that
# may not write them, for a team, model, replica group or node the configuration does not know, or
# in a spool line whose seal does not verify. Each is kept as it arrived, with the writer, the
# reason and its category (``label``, the /metrics label), once per digest of kind, record and
# label, so a resent batch adds nothing.
_V10 = """
CREATE TABLE quarantine (
    digest VARCHAR NOT NULL PRIMARY KEY,
    kind VARCHAR NOT NULL,
    record_id VARCHAR,
    writer VARCHAR,
    label VARCHAR NOT NULL,
    reason VARCHAR NOT NULL,
    record VARCHAR NOT NULL,
    record_time DOUBLE,
    quarantined_at DOUBLE NOT NULL
);
"""

# Keys issued at run time (``infermeter.keys``, ``billing.keys``): never a secret, only its digest;
# a revoked key keeps its row (revoked_at). ``changed_seq`` orders the changes, so the set's
# version (its largest value) tells a sidecar whether its copy is current. And the audit trail
# (``infermeter.audit``): appended, never updated or deleted by any route.
_V11 = """
CREATE TABLE api_keys (
    key_id VARCHAR NOT NULL PRIMARY KEY,
    role VARCHAR NOT NULL,
    team VARCHAR,
    digest VARCHAR NOT NULL,
    created_at DOUBLE NOT NULL,
    created_by VARCHAR NOT NULL,
    member VARCHAR,
    project VARCHAR,
    expires_at DOUBLE,
    revoked_at DOUBLE,
    replaced_by VARCHAR,
    requests_per_minute BIGINT,
    tokens_per_minute BIGINT,
    max_concurrent BIGINT,
    budget_usd_per_month DOUBLE,
    changed_seq BIGINT NOT NULL
);
CREATE TABLE audit_events (
    event_id VARCHAR NOT NULL PRIMARY KEY,
    occurred_at DOUBLE NOT NULL,
    action VARCHAR NOT NULL,
    actor VARCHAR NOT NULL,
    actor_role VARCHAR NOT NULL,
    source VARCHAR NOT NULL,
    address VARCHAR,
    target VARCHAR NOT NULL,
    detail VARCHAR NOT NULL,
    why VARCHAR NOT NULL,
    outcome VARCHAR NOT NULL,
    kept_at DOUBLE NOT NULL
);
"""

# The Parquet archive (``billing.archive``): each retention run per raw table, with the horizon
# below which that table's rows have left the ledger, and the files that hold them now. A run's
# rows are written here in the transaction that deletes what its files hold, so the ledger and
# its list of archived files always agree. ``_archived_before(kind)``: the end of the month of
# the latest horizon (0 before any run), before which ingest refuses records: a record that
# late could already be in the archive, and its month's statement no longer reads raw rows.
# Written to be applied twice harmlessly (IF NOT EXISTS, OR REPLACE): its place in the list may
# move while other migrations are added beside it.
_ARCHIVE = """
CREATE TABLE IF NOT EXISTS archive_runs (
    run_id VARCHAR NOT NULL,
    kind VARCHAR NOT NULL,
    horizon DOUBLE NOT NULL,
    refuse_before DOUBLE NOT NULL,
    root VARCHAR NOT NULL,
    manifest VARCHAR NOT NULL,
    rows BIGINT NOT NULL,
    done_at DOUBLE NOT NULL,
    PRIMARY KEY (run_id, kind)
);
CREATE TABLE IF NOT EXISTS archive_files (
    run_id VARCHAR NOT NULL,
    kind VARCHAR NOT NULL,
    month VARCHAR NOT NULL,
    path VARCHAR NOT NULL PRIMARY KEY,
    rows BIGINT NOT NULL,
    sha256 VARCHAR NOT NULL
);
CREATE OR REPLACE MACRO _archived_before(k) AS
    (SELECT coalesce(max(refuse_before), 0) FROM archive_runs WHERE kind = k);
"""

# Attribution below the team (``billing.breakdown``): the billable records' use per hour, team,
# model, project and end user ('' where a request named none), so a statement line can be split
# by project and user without reading the raw rows (which retention may have archived). Counts
# are in the hour a record finished in, in-flight seconds in the hours they were spent in, as
# ``usage_slots`` places them. Filled from the raw rows by ``billing.ledger.migrate`` (with
# ingest's own SQL, once ``usage`` has its ``user`` and ``project`` columns).
_USAGE_TAGS = """
CREATE TABLE usage_tags (
    hour BIGINT NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    project VARCHAR NOT NULL,
    "user" VARCHAR NOT NULL,
    requests BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    inflight_seconds DOUBLE NOT NULL,
    PRIMARY KEY (hour, team, model, project, "user")
);
"""

# Cloud invoices imported (``billing.invoices``, ``billing.invoice_store``): what each node pool
# was billed per month, in whole cents, from the file (``source``, its ``sha256``) whose rows are
# in force; a re-issued invoice's rows replace them.
_INVOICES = """
CREATE TABLE invoices (
    month VARCHAR NOT NULL,
    pool VARCHAR NOT NULL,
    billed_cents BIGINT NOT NULL,
    line_items BIGINT NOT NULL,
    source VARCHAR NOT NULL,
    sha256 VARCHAR NOT NULL,
    imported_at DOUBLE NOT NULL,
    PRIMARY KEY (month, pool)
);
"""

# A closed month's basis (``list`` or ``allocation``) and its node pools' costs as frozen with
# its lines (``infermeter.statement.POOL_SCHEMA`` rows as JSON), so a later price book or
# invoice cannot change what was issued.
_STATEMENT_BASES = """
CREATE TABLE statement_bases (
    month VARCHAR PRIMARY KEY,
    basis VARCHAR NOT NULL,
    pools VARCHAR NOT NULL
);
"""

# The prompt tokens vLLM served from its prefix cache, per allocation key and hour, so the
# ``tokens`` split weighs them at ``billing.token_weights.cached_prompt``; filled from
# ``usage_slots``, which has always kept them per slot (DuckDB adds no column with a NOT NULL
# constraint: the default and ingest keep it non-null). Applied twice, it sets the same values.
_ALLOC_HOURS_CACHED = f"""
ALTER TABLE alloc_hours ADD COLUMN IF NOT EXISTS cached_prompt_tokens BIGINT DEFAULT 0;
UPDATE alloc_hours h SET cached_prompt_tokens = c.cached
FROM (SELECT k."key", s.slot // {HOUR_SECONDS // SLOT_SECONDS} AS hour,
        sum(s.cached_prompt_tokens)::BIGINT AS cached
    FROM usage_slots s JOIN alloc_keys k USING (replica, instance, team, model)
    GROUP BY ALL) c
WHERE h."key" = c."key" AND h.hour = c.hour;
"""

# A central billing's copy of its clusters' closed months (``billing.federation``): each
# (cluster, month) as the cluster froze it, replaced whole when the cluster's digest of it
# changes; and, per cluster, when it was last pulled and since when pulls have failed.
_FEDERATED_LINES = """
CREATE TABLE IF NOT EXISTS federated_lines (
    cluster VARCHAR NOT NULL,
    month VARCHAR NOT NULL,
    for_month VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    requests BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    gpu_hours DOUBLE NOT NULL,
    energy_kwh DOUBLE NOT NULL,
    compute_cents BIGINT NOT NULL,
    energy_cents BIGINT NOT NULL,
    idle_cents BIGINT NOT NULL,
    total_cents BIGINT NOT NULL,
    digest VARCHAR NOT NULL
);
CREATE TABLE IF NOT EXISTS federated_months (
    cluster VARCHAR NOT NULL,
    month VARCHAR NOT NULL,
    digest VARCHAR NOT NULL,
    basis VARCHAR NOT NULL,
    pools VARCHAR NOT NULL,
    total_cents BIGINT NOT NULL,
    pulled_at DOUBLE NOT NULL,
    PRIMARY KEY (cluster, month)
);
CREATE TABLE IF NOT EXISTS federated_clusters (
    cluster VARCHAR PRIMARY KEY,
    pulled_at DOUBLE,
    failing_since DOUBLE,
    error VARCHAR
);
"""

# The price book a cluster served with each closed month (``infermeter.config.Prices`` as JSON),
# so the central's FOCUS file gives that cluster's unit prices, not the central's.
_FEDERATED_PRICES = """
ALTER TABLE federated_months ADD COLUMN IF NOT EXISTS prices VARCHAR;
"""

# Hourly cost rows (``billing.hourly``): allocation's per-minute split kept per hour, as
# quantities, so a statement prices rows in proportion to hours x instances x teams. Every hour
# with GPU time is marked dirty here, so the rows of a ledger kept before them are built on the
# next rebuild (``billing.allocation_runs.refresh_hours``); until then a statement builds them itself.
_HOURLY_COSTS = """
CREATE TABLE IF NOT EXISTS cost_hours (
    hour BIGINT NOT NULL,
    replica VARCHAR NOT NULL,
    instance VARCHAR NOT NULL,
    node VARCHAR NOT NULL,
    gpu_model VARCHAR NOT NULL,
    gpu_seconds DOUBLE NOT NULL,
    energy_joules DOUBLE NOT NULL,
    busy_gpu_seconds DOUBLE NOT NULL,
    busy_energy_joules DOUBLE NOT NULL,
    peak_slot BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS share_hours (
    hour BIGINT NOT NULL,
    "key" INTEGER NOT NULL,
    node VARCHAR NOT NULL,
    gpu_model VARCHAR NOT NULL,
    gpu_seconds DOUBLE NOT NULL,
    energy_joules DOUBLE NOT NULL
);
CREATE TABLE IF NOT EXISTS hours_dirty (hour BIGINT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS hours_built (heartbeat_seconds DOUBLE NOT NULL);
INSERT INTO hours_dirty SELECT DISTINCT slot // 60 FROM gpu_slots ON CONFLICT DO NOTHING;
"""

# A closed month's hours (``billing.closed_hours``), frozen with its statement: cost per hour,
# replica group and GPU model, usage per hour, team and model, reconciliation per hour, group
# and model; ``closed_hour_months`` names the months closed with them (a month closed before
# has none, and is federated without). The central keeps each cluster's copy beside its lines
# (``federated_*_hours``), replaced with them; ``federated_months.hourly`` says whether the
# cluster sent any (a cluster of an earlier version sends none).
_CLOSED_HOURS = """
CREATE TABLE IF NOT EXISTS closed_hour_months (month VARCHAR PRIMARY KEY);
CREATE TABLE IF NOT EXISTS closed_cost_hours (
    month VARCHAR NOT NULL,
    hour BIGINT NOT NULL,
    replica VARCHAR NOT NULL,
    gpu_model VARCHAR NOT NULL,
    gpu_hours DOUBLE NOT NULL,
    energy_kwh DOUBLE NOT NULL,
    total_cents BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS closed_usage_hours (
    month VARCHAR NOT NULL,
    hour BIGINT NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    requests BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    gpu_hours DOUBLE NOT NULL,
    total_cents BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS closed_reconciled_hours (
    month VARCHAR NOT NULL,
    hour BIGINT NOT NULL,
    replica VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    engine_tokens BIGINT NOT NULL,
    ledger_tokens BIGINT NOT NULL,
    difference_tokens BIGINT NOT NULL,
    hangup_tokens BIGINT NOT NULL,
    unattributed_tokens BIGINT NOT NULL,
    ledger_excess_tokens BIGINT NOT NULL,
    unreconciled_requests BIGINT NOT NULL,
    unreconciled_tokens BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS federated_cost_hours AS
    SELECT ''::VARCHAR AS cluster, * FROM closed_cost_hours LIMIT 0;
CREATE TABLE IF NOT EXISTS federated_usage_hours AS
    SELECT ''::VARCHAR AS cluster, * FROM closed_usage_hours LIMIT 0;
CREATE TABLE IF NOT EXISTS federated_reconciled_hours AS
    SELECT ''::VARCHAR AS cluster, * FROM closed_reconciled_hours LIMIT 0;
ALTER TABLE federated_months ADD COLUMN IF NOT EXISTS hourly BOOLEAN DEFAULT false;
"""

# The lifetimes of a closed month per hour (``billing.closed_hours``), frozen with its other
# hours, and the central's copy of each cluster's.
_LIFETIME_HOURS = """
CREATE TABLE IF NOT EXISTS closed_lifetime_hours (
    month VARCHAR NOT NULL,
    hour BIGINT NOT NULL,
    replica VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    gpu_model VARCHAR NOT NULL,
    instances BIGINT NOT NULL,
    started BIGINT NOT NULL,
    stopped BIGINT NOT NULL,
    ended_without_stop BIGINT NOT NULL,
    instance_hours DOUBLE NOT NULL,
    gpu_hours DOUBLE NOT NULL
);
CREATE TABLE IF NOT EXISTS federated_lifetime_hours AS
    SELECT ''::VARCHAR AS cluster, * FROM closed_lifetime_hours LIMIT 0;
"""

# The month's reconciliation kept per hour (``billing.reconciliation_hours``): ``reconcile``'s
# rows and the hang-up tails per team, for the months of ``reconciliation_built``, whose rows hold
# before ``clean_before``. A ledger kept before them has none: its statements reconcile whole
# months until the upkeep loop has kept them.
_RECONCILIATION_HOURS = """
CREATE TABLE IF NOT EXISTS reconciliation_hours (
    t BIGINT NOT NULL,
    instance VARCHAR NOT NULL,
    replica VARCHAR,
    model VARCHAR,
    engine_prompt_tokens BIGINT,
    engine_completion_tokens BIGINT,
    ledger_prompt_tokens BIGINT,
    ledger_completion_tokens BIGINT,
    engine_tokens BIGINT,
    ledger_tokens BIGINT,
    difference_tokens BIGINT,
    share DOUBLE,
    hangup_prompt_tokens BIGINT,
    hangup_completion_tokens BIGINT,
    hangup_tokens BIGINT,
    unattributed_prompt_tokens BIGINT,
    unattributed_completion_tokens BIGINT,
    unattributed_tokens BIGINT,
    unattributed_share DOUBLE,
    ledger_excess_tokens BIGINT,
    unreconciled_requests BIGINT,
    unreconciled_prompt_tokens BIGINT,
    unreconciled_completion_tokens BIGINT,
    unreconciled_tokens BIGINT
);
CREATE TABLE IF NOT EXISTS reconciliation_tails (
    instance VARCHAR NOT NULL,
    hour BIGINT NOT NULL,
    team VARCHAR,
    model VARCHAR,
    replica VARCHAR,
    prompt_tokens BIGINT,
    completion_tokens BIGINT
);
CREATE TABLE IF NOT EXISTS reconciliation_built (
    first_hour BIGINT NOT NULL,
    end_hour BIGINT NOT NULL,
    clean_before BIGINT NOT NULL,
    PRIMARY KEY (first_hour, end_hour)
);
"""

# A closed month's lines on the usage basis (the price book's prices), frozen with its
# statement lines so that its files keep what matching the invoices moved (FOCUS's ListCost
# beside BilledCost), and so that a late record's adjustment is made on both bases. Every month
# closed from this version on is in statement_usage_months (its lines here, the same as its
# statement lines on the list basis); a month closed before it has none, and its files show
# list cost equal to billed cost, as they did.
_STATEMENT_USAGE_LINES = """
CREATE TABLE statement_usage_lines AS SELECT * FROM statement_lines LIMIT 0;
CREATE TABLE statement_usage_months (month VARCHAR PRIMARY KEY);
"""

MIGRATIONS: Final[tuple[str, ...]] = (
    _V1,
    _V2,
    _V3,
    _V4,
    _V5,
    _V6,
    _V7,
    _V8,
    _V9,
    _V10,
    _V11,
    _ARCHIVE,
    _USAGE_TAGS,
    _INVOICES,
    _ALLOC_HOURS_CACHED,
    _STATEMENT_BASES,
    _FEDERATED_LINES,
    _FEDERATED_PRICES,
    _HOURLY_COSTS,
    _CLOSED_HOURS,
    _LIFETIME_HOURS,
    _RECONCILIATION_HOURS,
    _STATEMENT_USAGE_LINES,
)
LATEST_VERSION: Final = len(MIGRATIONS)
# The migration that makes ``usage_tags`` (its backfill runs with it).
USAGE_TAGS_VERSION: Final = MIGRATIONS.index(_USAGE_TAGS) + 1


def new_field_sql(kind: RecordKind, columns: Collection[str]) -> list[str]:
    """SQL adding to ``kind``'s table the fields it lacks (``columns``: the table's columns now).

    ValueError for a missing field without a default: the rows already kept could not have a
    value for it.
    """
    if not columns:  # no table yet: a later migration makes it with every field it needs
        return []
    statements = []
    for f in kind.fields:
        if f.name in columns:
            continue
        if f.required:
            raise ValueError(
                f"{kind.record.__name__}.{f.name}: a field added to a record kind needs a default "
                f"(the {kind.table} table already holds records without it)"
            )
        statements.append(f"ALTER TABLE {kind.table} ADD COLUMN {column_ddl(f)}")
    return statements
