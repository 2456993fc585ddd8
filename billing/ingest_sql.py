"""SQL that validates a batch of records inside DuckDB, one reason per bad record.

Ingest has to take hundreds of thousands of records a second on a small machine, which rules
out checking each record in Python. Instead the batch's JSON text goes into DuckDB as one
parameter; these builders produce the SQL that unpacks it, checks every field's JSON type and
range, and either casts a record to its column types or names what is wrong with it. The
builders are pure (they return SQL text) and are tested against an in-memory DuckDB.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from billing.bounds import (
    COUNTER_SLACK_SECONDS,
    MAX_BOARD_MIB,
    MAX_COUNTER,
    MAX_GAP_SECONDS,
    MAX_REQUESTS,
    POWER_MARGIN,
)
from billing.buckets import bucket_sql
from billing.columns import COLUMN_TYPES, sql_default
from billing.schema import EDGE_SECONDS, HOUR_SECONDS, SLOT_SECONDS
from billing.trust_sql import record_json_sql, trusted_sql
from infermeter.overrides import ISSUED_BY_BILLING
from infermeter.records import (
    BILLABLE_STATUSES,
    BUDGET_OVERRIDES,
    ENGINE,
    FAILED_STATUSES,
    GPU,
    INSTANCES,
    MAX_DECISION_REASONS,
    MAX_OVERRIDE_REASON,
    MAX_SCALED_REPLICAS,
    SCALING_DECISIONS,
    USAGE,
    Field,
    FieldType,
    InstanceEventType,
    RecordKind,
    RequestStatus,
)

__all__ = [
    "BILLABLE",
    "CHECKS",
    "ENGINE_PROMPT_SQL",
    "FIRST_TOKEN_SQL",
    "STATUSES",
    "append_sql",
    "checked_sql",
    "counter_delta_sql",
    "engine_rollup_sql",
    "fresh_sql",
    "good_sql",
    "gpu_rollup_sql",
    "known_sql",
    "occupancy_rollup_sql",
    "rejected_sql",
    "stage_sql",
    "statement_rollup_sql",
    "summed_sql",
    "tag_rollup_sql",
    "token_hour_sql",
    "token_rollup_sql",
    "ttft_rollup_sql",
    "usage_rollup_sql",
]

# The statuses as SQL tuples, from the one declaration in infermeter.records.
STATUSES: Final = tuple(str(s) for s in RequestStatus)
BILLABLE: Final = repr(tuple(str(s) for s in BILLABLE_STATUSES))
FAILED: Final = repr(tuple(str(s) for s in FAILED_STATUSES))

# Bounds a record must be within: one record must not unroll into unbounded work or money. A
# request is at most a day long (a longer one would spread over ~1,440 minute rows and more), and
# carries at most 100M tokens each way (far beyond any context window).
MAX_REQUEST_SECONDS: Final = 86_400
MAX_TOKENS: Final = 100_000_000
# Choices per prompt (``n``): far beyond any real request, and small enough that prompt tokens
# times choices stays an exact integer.
MAX_CHOICES: Final = 1_000_000
# The longest id a rejection answers with; a longer one is answered as "#<place in the batch>".
MAX_ANSWERED_ID: Final = 256

# What the board a GPU sample names can draw, in W (``billing.bounds``: a macro over a map of the
# boards' limits, made on the ledger's connection).
_BOARD_WATTS = "_board_watts(gpu_model)"
_MOST_WATTS = f"({_BOARD_WATTS} * {1 + POWER_MARGIN})"
_ENGINE_COUNTERS = (
    "prompt_tokens_total",
    "generation_tokens_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "preemptions_total",
)


def _counter_check(name: str) -> tuple[str, str]:
    return (
        f"{name} < 0 OR {name} > {MAX_COUNTER:.0e}",
        f"'{name}: not between 0 and {MAX_COUNTER:.0e}'",
    )


def _archived_check(kind: str, time: str) -> tuple[str, str]:
    """Refuse a record of a month whose raw rows have begun leaving for the archive
    (``billing.archive``): it may be there already, and that month's statement is frozen."""
    return (
        f"{time} < _archived_before('{kind}')",
        f"'{time.strip(chr(34))}: in a month the ledger has archived (before ' || "
        f"strftime(make_timestamp(CAST(_archived_before('{kind}') * 1000000 AS BIGINT)), '%Y-%m-%d') || ' UTC)'",
    )


# The checks beyond types, per kind: (SQL condition that means "bad", reason). The fields, their
# types and defaults come from the record declarations (infermeter.records). A record that passes
# them all may still be quarantined rather than kept: who wrote it, and whether the configuration
# knows its team, model, group and node, are ``billing.trust_sql``'s checks.
CHECKS: Final[Mapping[str, tuple[tuple[str, str], ...]]] = {
    USAGE.key: (
        ("request_id = ''", "'request_id: empty'"),
        (f"status NOT IN {STATUSES!r}", "'status: unknown value ' || to_json(status)"),
        (
            "prompt_tokens < 0 OR cached_prompt_tokens < 0 OR completion_tokens < 0",
            "'token counts must not be negative'",
        ),
        ("cached_prompt_tokens > prompt_tokens", "'cached_prompt_tokens exceeds prompt_tokens'"),
        (
            f"choices < 1 OR choices > {MAX_CHOICES}",
            f"'choices: not between 1 and {MAX_CHOICES:,}'",
        ),
        (
            f"prompt_tokens > {MAX_TOKENS} OR completion_tokens > {MAX_TOKENS}",
            f"'token counts above {MAX_TOKENS:,}'",
        ),
        (
            f"finished_at - received_at > {MAX_REQUEST_SECONDS}",
            f"'finished_at is more than {MAX_REQUEST_SECONDS} s after received_at'",
        ),
        ("received_at < 946684800", "'received_at: not Unix seconds (before 2000)'"),
        ("finished_at < received_at", "'finished_at is before received_at'"),
        (
            "first_token_at IS NOT NULL AND (first_token_at < received_at OR first_token_at > finished_at)",
            "'first_token_at is outside received_at..finished_at'",
        ),
        ("finished_at > $now + $skew", "'timestamp in the future: finished_at'"),
        _archived_check(USAGE.key, "received_at"),
        ("http_status < 100 OR http_status > 599", "'http_status: not an HTTP status'"),
    ),
    GPU.key: (
        ("sample_id = ''", "'sample_id: empty'"),
        ('"timestamp" < 946684800', "'timestamp: not Unix seconds (before 2000)'"),
        ('"timestamp" > $now + $skew', "'timestamp in the future'"),
        _archived_check(GPU.key, '"timestamp"'),
        ("interval_seconds < 0", "'interval_seconds: negative'"),
        (
            "NOT gap AND interval_seconds > _max_measured_seconds()",
            "printf('interval_seconds: a measured interval of %.6g s, longer than %.6g s "
            "(a longer one is a gap)', interval_seconds, _max_measured_seconds())",
        ),
        (
            f"interval_seconds > {MAX_GAP_SECONDS}",
            f"'interval_seconds: longer than {MAX_GAP_SECONDS:.0f} s'",
        ),
        ("utilization < 0 OR utilization > 1", "'utilization: not between 0 and 1'"),
        ("power_watts < 0", "'power_watts: negative'"),
        ("energy_joules < 0", "'energy_joules: negative'"),
        (
            f"power_watts > {_MOST_WATTS}",
            f"printf('power_watts: %.6g W is more than the board can draw (%.6g W for %s, "
            f"+{POWER_MARGIN:.0%}%)', power_watts, {_BOARD_WATTS}, left(gpu_model, 64))",
        ),
        (
            f"energy_joules > {_MOST_WATTS} * (interval_seconds + {COUNTER_SLACK_SECONDS})",
            f"printf('energy_joules: %.6g J is more than the board can draw in %.6g s (%.6g W for "
            f"%s, +{POWER_MARGIN:.0%}%, {COUNTER_SLACK_SECONDS:.0f} s of counter slack)', "
            f"energy_joules, interval_seconds, {_BOARD_WATTS}, left(gpu_model, 64))",
        ),
        ("memory_used_mib < 0 OR memory_free_mib < 0", "'memory must not be negative'"),
        (
            f"memory_used_mib + memory_free_mib > {MAX_BOARD_MIB}",
            f"'memory: more than {MAX_BOARD_MIB:.0f} MiB on one board'",
        ),
        ("xid_errors < 0", "'xid_errors: negative'"),
    ),
    ENGINE.key: (
        ("sample_id = ''", "'sample_id: empty'"),
        ('"timestamp" < 946684800', "'timestamp: not Unix seconds (before 2000)'"),
        ('"timestamp" > $now + $skew', "'timestamp in the future'"),
        _archived_check(ENGINE.key, '"timestamp"'),
        ("requests_running < 0 OR requests_waiting < 0", "'request counts must not be negative'"),
        (
            f"requests_running > {MAX_REQUESTS} OR requests_waiting > {MAX_REQUESTS}",
            f"'request counts above {MAX_REQUESTS:,}'",
        ),
        ("kv_cache_usage < 0 OR kv_cache_usage > 1", "'kv_cache_usage: not between 0 and 1'"),
        *(_counter_check(name) for name in _ENGINE_COUNTERS),
        _counter_check("kv_cache_tokens"),
    ),
    INSTANCES.key: (
        ("event_id = ''", "'event_id: empty'"),
        ("instance = ''", "'instance: empty'"),
        (
            f"event NOT IN {tuple(str(e) for e in InstanceEventType)!r}",
            "'event: unknown value ' || to_json(event)",
        ),
        (
            '"timestamp" < 946684800 OR started_at < 946684800',
            "'timestamp: not Unix seconds (before 2000)'",
        ),
        ('"timestamp" > $now + $skew', "'timestamp in the future'"),
        ('started_at > "timestamp"', "'started_at is after timestamp'"),
        ("gpu_count < 0 OR gpu_count > 64", "'gpu_count: out of range'"),
    ),
    BUDGET_OVERRIDES.key: (
        ("override_id = ''", "'override_id: empty'"),
        ("team NOT IN (SELECT name FROM _known_teams)", "'unknown team ' || to_json(team)"),
        ("trim(admin_reason) = ''", "'admin_reason: empty'"),
        (
            f"length(admin_reason) > {MAX_OVERRIDE_REASON}",
            f"'admin_reason: longer than {MAX_OVERRIDE_REASON} characters'",
        ),
        ("issued_by = ''", "'issued_by: empty'"),
        (
            f"starts_with(issued_by, '{ISSUED_BY_BILLING}')",
            "'issued_by: billing''s own grants are never ingested'",
        ),
        ("issued_at < 946684800", "'issued_at: not Unix seconds (before 2000)'"),
        ("issued_at > $now + $skew", "'timestamp in the future: issued_at'"),
        ("until <= issued_at", "'until is not after issued_at'"),
    ),
    SCALING_DECISIONS.key: (
        ("decision_id = ''", "'decision_id: empty'"),
        ("model NOT IN (SELECT model FROM _sla)", "'unknown model ' || to_json(model)"),
        ("decided_at < 946684800", "'decided_at: not Unix seconds (before 2000)'"),
        ("decided_at > $now + $skew", "'timestamp in the future: decided_at'"),
        (
            f"least(previous, current, desired) < 0 "
            f"OR greatest(previous, current, desired) > {MAX_SCALED_REPLICAS}",
            f"'replica counts: not between 0 and {MAX_SCALED_REPLICAS:,}'",
        ),
        ("previous = desired", "'desired equals previous: not a change'"),
        ("trim(reasons) = ''", "'reasons: empty'"),
        (
            f"length(reasons) > {MAX_DECISION_REASONS}",
            f"'reasons: longer than {MAX_DECISION_REASONS} characters'",
        ),
    ),
}


def _q(name: str) -> str:
    return f'"{name}"'


def _type_check(f: Field) -> tuple[str, str]:
    path = f"'$.{f.name}'"
    jtype = f"json_type(r, {path})"
    allowed = repr(COLUMN_TYPES[f.type].json).replace(",)", ")")
    if f.nullable:
        ok = f"({jtype} IS NULL OR {jtype} = 'NULL' OR {jtype} IN {allowed})"
    elif f.has_default:
        ok = f"({jtype} IS NULL OR {jtype} IN {allowed})"
    else:
        ok = f"{jtype} IN {allowed}"
    noun = COLUMN_TYPES[f.type].noun
    missing = f"{jtype} IS NULL"
    reason = (
        f"CASE WHEN {missing} THEN '{f.name}: missing' "
        f"ELSE '{f.name}: must be {noun}' || CASE WHEN {'true' if f.nullable else 'false'} "
        f"THEN ' or null' ELSE '' END END"
    )
    return f"NOT coalesce({ok}, false)", reason


def _range_check(f: Field) -> tuple[str, str]:
    """A number of the right JSON type that its column cannot hold: an integer in 2^63..2^64-1
    is JSON's UBIGINT, which DuckDB reads as an integer and cannot cast to BIGINT. Refused by
    name, rather than kept as NULL (a NOT NULL column would fail the whole batch, on every
    resend) or as the field's default."""
    sql_type = COLUMN_TYPES[f.type].sql
    path = f"'$.{f.name}'"
    return (
        f"json_type(r, {path}) <> 'NULL' AND TRY_CAST(json_extract(r, {path}) AS {sql_type}) IS NULL",
        f"'{f.name}: out of range (a 64-bit integer is at most 9223372036854775807)'"
        if f.type is FieldType.INT
        else f"'{f.name}: out of range'",
    )


def _value(f: Field) -> str:
    sql_type = COLUMN_TYPES[f.type].sql
    path = f"'$.{f.name}'"
    extracted = f"r->>{path}" if f.type == "string" else f"json_extract(r, {path})"
    value = f"TRY_CAST({extracted} AS {sql_type})"
    if f.has_default:  # only where the field is absent: a value that did not cast is refused
        value = f"CASE WHEN json_type(r, {path}) IS NULL THEN {sql_default(f)} ELSE {value} END"
    return f"{value} AS {_q(f.name)}"


def stage_sql(kind: RecordKind, fleet: bool = False) -> str:
    """SQL creating temp table ``staged``: one row per record of the batch, typed, with a reason.

    Parameters: ``$body`` (the batch's JSON text), ``$now`` and ``$skew`` (seconds). ``reason``
    is NULL for a good record; ``quarantine`` is set for a good one billing does not trust
    (``billing.trust_sql``, which ``fleet`` is passed to); ``dup`` is true for a repeat of an
    earlier id in the same batch, whatever became of the earlier one (``good_sql`` decides
    repeats among the records kept). The batch's writer is item 0 of ``_writers``.
    """
    allowed = "[" + ", ".join(f"'{f.name}'" for f in kind.fields) + "]"
    type_checks = [_type_check(f) for f in kind.fields]
    type_checks += [
        _range_check(f) for f in kind.fields if f.type in (FieldType.INT, FieldType.NUMBER)
    ]
    cases = "\n".join(f"        WHEN {cond} THEN {reason}" for cond, reason in type_checks)
    values = ",\n    ".join(_value(f) for f in kind.fields)
    return f"""
CREATE OR REPLACE TEMP TABLE staged AS
WITH src AS (SELECT CAST(json_extract(CAST($body AS JSON), '$.{kind.key}') AS JSON[]) AS l),
raw AS (SELECT unnest(l) AS r, generate_subscripts(l, 1) AS pos FROM src),
typed AS (
    SELECT 0 AS item, pos,
    CASE
        WHEN json_type(r) IS DISTINCT FROM 'OBJECT' THEN 'not a JSON object'
        WHEN len(json_keys(r)) <> len(list_distinct(json_keys(r))) THEN 'duplicate key(s): '
            || array_to_string(list_distinct(list_filter(json_keys(r),
                   lambda k: len(list_filter(json_keys(r), lambda j: j = k)) > 1)), ', ')
        WHEN NOT list_has_all({allowed}, json_keys(r)) THEN 'unknown key(s): '
            || array_to_string(list_filter(json_keys(r), lambda k: NOT list_contains({allowed}, k)), ', ')
{cases}
    END AS type_reason,
    {values}
    FROM raw
)
{_checked(kind, "typed", fleet=fleet)}
"""


def checked_sql(kind: RecordKind, relation: str, fleet: bool = False) -> str:
    """Like ``stage_sql``'s table, as a query over a relation whose columns have the kind's types.

    The fast path: when a whole batch parses to exactly the expected column types (which is
    what every shipper sends), only the range checks are left to do, and they are computed
    where they are read instead of being copied into a table. Parameters: ``$now``, ``$skew``.
    The relation also carries ``pos`` (the record's place in the batch) and ``dup`` (a repeat
    of an earlier id in the batch), computed where the columns were built.
    """
    cols = ", ".join(_q(f.name) for f in kind.fields)
    return f"""(
WITH typed AS (SELECT item, pos, dup, NULL::VARCHAR AS type_reason, {cols} FROM {relation})
{_checked(kind, "typed", "dup", fleet)}
)"""


def _finite_checks(kind: RecordKind) -> list[tuple[str, str]]:
    """NaN and infinity are refused in every number field (JSON has neither; Arrow has both)."""
    return [
        (f"NOT isfinite({_q(f.name)})", f"'{f.name}: not a finite number'")
        for f in kind.fields
        if f.type is FieldType.NUMBER
    ]


def _checked(kind: RecordKind, relation: str, dup: str | None = None, fleet: bool = False) -> str:
    checks = [*_finite_checks(kind), *CHECKS[kind.key]]
    domain = "\n".join(f"        WHEN {cond} THEN {reason}" for cond, reason in checks)
    columns = "* EXCLUDE (dup)" if dup else "*"
    dup = dup or f"row_number() OVER (PARTITION BY {_q(kind.id_field)} ORDER BY pos) > 1 AS dup"
    checked = f"""(SELECT {columns},
    coalesce(type_reason, CASE
{domain}
    END) AS reason,
    {dup}
FROM {relation} LEFT JOIN _writers USING (item))"""
    return trusted_sql(kind, checked, fleet)


def rejected_sql(kind: RecordKind, checked: str) -> str:
    """SQL keeping the records of ``checked`` that are not kept in ``_rejected``.

    Per record: its batch and place, id, reason; for a quarantined one (``billing.trust_sql``)
    also its ``label``, the record as JSON, the time it claims and its ``writer``.
    """
    quarantined = "quarantine IS NOT NULL"
    # A refused record is answered by its id, unless the id is what is wrong with it (missing,
    # empty, not a string: an array sent as the id is not echoed back) or is longer than an id
    # can be; then by its place, so the answer stays small.
    rid = _q(kind.id_field)
    answered = f"length({rid}) <= {MAX_ANSWERED_ID} AND NOT starts_with(coalesce(reason, ''), '{kind.id_field}:')"
    return f"""CREATE OR REPLACE TEMP TABLE _rejected AS
SELECT item, pos, CASE WHEN {quarantined} OR ({answered}) THEN {rid} END AS id,
    coalesce(reason, quarantine.reason) AS reason,
    quarantine.label AS label,
    CASE WHEN {quarantined} THEN {record_json_sql(kind)} END AS record,
    CASE WHEN {quarantined} THEN TRY_CAST({_q(kind.time_field)} AS DOUBLE) END AS record_time,
    w_principal AS writer
FROM {checked} WHERE reason IS NOT NULL OR {quarantined}"""


def good_sql(kind: RecordKind, source: str, refused: bool = True) -> str:
    """SQL defining view ``_good``: the records of ``source`` that are neither bad nor repeats.

    ``source`` is the batch (typed columns, or the per-record path's ``staged``); the bad ones
    are those in ``_rejected`` (from ``rejected_sql``). A repeat is a later copy of an id among
    the records kept, never among all: a refused or quarantined first copy (another writer's
    forgery sharing the transaction) must not make the good copy after it a "duplicate" that is
    dropped. ``refused``: whether ``_rejected`` holds any record; without one, the batch's own
    ``dup`` (computed where its columns were built) says the same, and no window is needed.
    """
    cols = ", ".join(_q(f.name) for f in kind.fields)
    kept = f"SELECT s.* FROM {source} s ANTI JOIN _rejected r USING (item, pos)"
    if not refused:
        return (
            f"CREATE OR REPLACE TEMP VIEW _good AS SELECT item, {cols} FROM ({kept}) WHERE NOT dup"
        )
    first = f"row_number() OVER (PARTITION BY {_q(kind.id_field)} ORDER BY item, pos) = 1"
    return f"CREATE OR REPLACE TEMP VIEW _good AS SELECT item, {cols} FROM ({kept}) QUALIFY {first}"


def known_sql(kind: RecordKind) -> str:
    """SQL keeping in ``_known`` the ids of ``_good`` that the kind's table already has, ever.

    Normally empty: only a resent batch has any. The lookup is limited to ids between the
    batch's least and greatest id (``$lo``..``$hi``), which is exact whatever times the records
    claim (a resent id with a shifted timestamp is still found). It is also cheap without an
    index of every id in memory: the ids that shippers mint begin with their time (the sidecar's
    request ids, the collector's sample ids), so ids are appended in nearly sorted order and the
    range lets DuckDB skip every row group outside it by its min/max statistics.
    """
    idf = _q(kind.id_field)
    return f"""
CREATE OR REPLACE TEMP TABLE _known AS
SELECT g.{idf} FROM _good g SEMI JOIN {kind.table} t ON t.{idf} BETWEEN $lo AND $hi AND t.{idf} = g.{idf}
"""


def fresh_sql(kind: RecordKind) -> str:
    """SQL defining view ``fresh``: the ``_good`` records not in ``_known`` (``known_sql``).

    A view over the batch, so appending it and rolling it up read the batch, not copies of it.
    """
    return f"CREATE OR REPLACE TEMP VIEW fresh AS SELECT * FROM _good ANTI JOIN _known USING ({_q(kind.id_field)})"


def append_sql(kind: RecordKind, where: str = "true") -> str:
    """SQL appending ``fresh`` (from ``fresh_sql``) to the kind's table. Parameter: ``$now``.

    ``where``: which fresh records are kept raw (instance heartbeats past their retention are
    only folded into ``lifetimes``, see ``billing.lifetimes``).
    """
    cols = ", ".join(_q(f.name) for f in kind.fields)
    return f"INSERT INTO {kind.table} ({cols}, ingested_at) SELECT {cols}, CAST($now AS DOUBLE) FROM fresh WHERE {where}"


def _slots(start: str, end: str) -> str:
    return f"unnest(range(CAST(floor({start} / {SLOT_SECONDS}) AS BIGINT), CAST(floor({end} / {SLOT_SECONDS}) AS BIGINT) + 1))"


def _overlap(start: str, end: str) -> str:
    """Seconds of ``start``..``end`` inside minute ``slot`` (0 when they do not meet)."""
    return f"greatest(0.0, least({end}, (slot + 1) * {SLOT_SECONDS}.0) - greatest({start}, slot * {SLOT_SECONDS}.0))"


def usage_rollup_sql() -> str:
    """SQL adding the ``fresh`` usage records to ``usage_slots``, per instance.

    A record without an instance is a fixed replica's, which is its own one instance.

    The batch's own rollup is kept in temp table ``_usage_delta`` for ``occupancy_rollup_sql``.
    Temp table ``_sla(model, ttft_seconds)`` holds the TTFT targets for the within-SLA count.
    """
    overlap = _overlap("received_at", "finished_at")
    fin = f"(slot = CAST(floor(finished_at / {SLOT_SECONDS}) AS BIGINT))"
    ttft = "(first_token_at - received_at)"
    return f"""
CREATE OR REPLACE TEMP TABLE _usage_delta AS
SELECT replica, coalesce(instance, replica) AS instance, team, model, slot,
    sum({overlap}) AS inflight_seconds,
    count(*) FILTER (WHERE {fin}) AS requests,
    count(*) FILTER (WHERE {fin} AND status IN {FAILED}) AS failed_requests,
    coalesce(sum(prompt_tokens) FILTER (WHERE {fin}), 0) AS prompt_tokens,
    coalesce(sum(cached_prompt_tokens) FILTER (WHERE {fin}), 0) AS cached_prompt_tokens,
    coalesce(sum(completion_tokens) FILTER (WHERE {fin}), 0) AS completion_tokens,
    coalesce(sum({ttft}) FILTER (WHERE {fin} AND first_token_at IS NOT NULL), 0) AS ttft_seconds_sum,
    count(*) FILTER (WHERE {fin} AND first_token_at IS NOT NULL) AS ttft_count,
    count(*) FILTER (WHERE {fin} AND first_token_at IS NOT NULL
        AND {ttft} <= coalesce(sla_ttft, 'inf')) AS ttft_within_sla,
    coalesce(sum(finished_at - first_token_at) FILTER (WHERE {fin} AND first_token_at IS NOT NULL), 0)
        AS decode_seconds_sum
FROM (
    SELECT f.*, s.ttft_seconds AS sla_ttft, {_slots("received_at", "finished_at")} AS slot
    FROM fresh f LEFT JOIN _sla s USING (model)
    WHERE status IN {BILLABLE}
)
GROUP BY ALL;
INSERT INTO usage_slots SELECT * FROM _usage_delta
ON CONFLICT DO UPDATE SET
    inflight_seconds = inflight_seconds + excluded.inflight_seconds,
    requests = requests + excluded.requests,
    failed_requests = failed_requests + excluded.failed_requests,
    prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    cached_prompt_tokens = cached_prompt_tokens + excluded.cached_prompt_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens,
    ttft_seconds_sum = ttft_seconds_sum + excluded.ttft_seconds_sum,
    ttft_count = ttft_count + excluded.ttft_count,
    ttft_within_sla = ttft_within_sla + excluded.ttft_within_sla,
    decode_seconds_sum = decode_seconds_sum + excluded.decode_seconds_sum;
"""


def occupancy_rollup_sql() -> str:
    """SQL adding the in-flight seconds of ``_usage_delta`` (``usage_rollup_sql``) to ``replica_slots``.

    Summed over teams from the batch's rollup rather than from the records again.
    """
    return """
INSERT INTO replica_slots
SELECT replica, instance, slot, sum(inflight_seconds) FROM _usage_delta GROUP BY ALL
ON CONFLICT DO UPDATE SET inflight_seconds = inflight_seconds + excluded.inflight_seconds;
"""


def ttft_rollup_sql() -> str:
    """SQL adding the ``fresh`` usage records' TTFTs to ``ttft_buckets``."""
    ttft = "(first_token_at - received_at)"
    return f"""
INSERT INTO ttft_buckets
SELECT model, team, CAST(floor(finished_at / {SLOT_SECONDS}) AS BIGINT) AS slot,
    {bucket_sql(ttft)} AS bucket, count(*)
FROM fresh WHERE status IN {BILLABLE} AND first_token_at IS NOT NULL
GROUP BY ALL
ON CONFLICT DO UPDATE SET requests = requests + excluded.requests;
"""


def gpu_rollup_sql() -> str:
    """SQL adding the ``fresh`` GPU samples to ``gpu_slots``, spread over the slots they cover.

    A sample's instance is the pod on the GPU, or for a fixed replica the replica itself; a GPU
    no instance runs on is replica and instance ''. A sample's GPU time is its interval times
    its ``share`` of the board (a MIG slice's compute share, a time-sliced board's part), so a
    board cut into parts counts once; its energy and power are already its part's.
    """
    start = '("timestamp" - interval_seconds)'
    overlap = _overlap(start, '"timestamp"')
    share = f"CASE WHEN interval_seconds > 0 THEN {overlap} / interval_seconds ELSE 1.0 END"
    part = f"({overlap} * least(greatest(share, 0.0), 1.0))"
    return f"""
INSERT INTO gpu_slots
SELECT node, gpu_model, coalesce(replica, '') AS replica,
    coalesce(instance, replica, '') AS instance, slot,
    sum({part}),
    sum(coalesce(energy_joules, 0) * {share}),
    sum(CASE WHEN energy_joules IS NULL THEN {part} ELSE 0 END),
    sum(utilization * {part}),
    sum(power_watts * {overlap}),
    count(*),
    sum(CASE WHEN xid_errors > 0 THEN 1 ELSE 0 END)
FROM (SELECT *, {_slots(start, '"timestamp"')} AS slot FROM fresh)
GROUP BY ALL
ON CONFLICT DO UPDATE SET
    gpu_seconds = gpu_seconds + excluded.gpu_seconds,
    energy_joules = energy_joules + excluded.energy_joules,
    unmeasured_seconds = unmeasured_seconds + excluded.unmeasured_seconds,
    utilization_seconds = utilization_seconds + excluded.utilization_seconds,
    power_watt_seconds = power_watt_seconds + excluded.power_watt_seconds,
    samples = samples + excluded.samples,
    xid_errors = xid_errors + excluded.xid_errors;
"""


def statement_rollup_sql() -> str:
    """SQL adding ``_usage_delta`` (``usage_rollup_sql``) to allocation's integer-keyed rollups.

    New instances and (instance, team, model) keys are numbered after the ones already kept;
    then the batch's slots and its counts per hour are added under those numbers.
    """
    per_hour = HOUR_SECONDS // SLOT_SECONDS
    return f"""
INSERT INTO alloc_units
SELECT (SELECT coalesce(max(unit), 0) FROM alloc_units) + row_number() OVER (ORDER BY replica, instance),
    replica, instance
FROM (SELECT DISTINCT replica, instance FROM _usage_delta) d
ANTI JOIN alloc_units u USING (replica, instance);
INSERT INTO alloc_keys
SELECT (SELECT coalesce(max("key"), 0) FROM alloc_keys)
        + row_number() OVER (ORDER BY d.replica, d.instance, d.team, d.model),
    u.unit, d.replica, d.instance, d.team, d.model
FROM (SELECT DISTINCT replica, instance, team, model FROM _usage_delta
      ANTI JOIN alloc_keys USING (replica, instance, team, model)) d
JOIN alloc_units u USING (replica, instance);
CREATE OR REPLACE TEMP TABLE _keyed_delta AS
SELECT k."key", k.unit, d.slot, d.inflight_seconds, d.requests, d.prompt_tokens, d.completion_tokens,
    d.cached_prompt_tokens
FROM _usage_delta d JOIN alloc_keys k USING (replica, instance, team, model);
INSERT INTO alloc_slots SELECT "key", unit, slot, inflight_seconds FROM _keyed_delta
ON CONFLICT DO UPDATE SET inflight_seconds = inflight_seconds + excluded.inflight_seconds;
INSERT INTO alloc_hours ("key", hour, requests, prompt_tokens, completion_tokens, cached_prompt_tokens)
SELECT "key", slot // {per_hour}, sum(requests), sum(prompt_tokens), sum(completion_tokens),
    sum(cached_prompt_tokens)
FROM _keyed_delta GROUP BY ALL
ON CONFLICT DO UPDATE SET
    requests = requests + excluded.requests,
    prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens,
    cached_prompt_tokens = cached_prompt_tokens + excluded.cached_prompt_tokens;
"""


# When a record's prompt tokens count for the engine: at its first token (at its end without one).
FIRST_TOKEN_SQL: Final = "least(coalesce(first_token_at, finished_at), finished_at)"
# A record's prompt tokens as vLLM counts them: once per choice (the usage object: once).
ENGINE_PROMPT_SQL: Final = "prompt_tokens * choices"


def token_hour_sql(tp: str = FIRST_TOKEN_SQL) -> str:
    """The hour (Unix hours) of a record's first token ``tp``: its hour in ``usage_hours``."""
    return f"CAST(floor({tp} / {HOUR_SECONDS}) AS BIGINT)"


def summed_sql(tp: str = FIRST_TOKEN_SQL, tf: str = "finished_at") -> str:
    """Whether a record is summed in ``usage_hours`` (else kept whole in ``usage_edges``).

    It is when it ends at least ``EDGE_SECONDS`` before the end of its first token's hour.
    """
    return f"{tf} < ({token_hour_sql(tp)} + 1) * {HOUR_SECONDS}.0 - {EDGE_SECONDS}"


def token_rollup_sql() -> str:
    """SQL adding the ``fresh`` usage records to reconciliation's ``usage_hours``, ``usage_edges``
    and ``usage_hangups``.

    Per instance, by the hour of the first token (as ``billing.reconciliation`` places prompt
    tokens): a record that ends at least ``EDGE_SECONDS`` before that hour does is summed, any
    other is kept whole; prompt tokens as the engine counts them (``ENGINE_PROMPT_SQL``). Every
    client-aborted record is also kept whole in ``usage_hangups``, where reconciliation looks for
    the tokens vLLM generated after the hang-up.
    """
    tp, hour, summed, p = FIRST_TOKEN_SQL, token_hour_sql(), summed_sql(), ENGINE_PROMPT_SQL
    return f"""
INSERT INTO usage_hours
SELECT coalesce(instance, replica), {hour}, max(replica), max(model), count(*), sum({p}),
    sum(completion_tokens)
FROM fresh WHERE status IN {BILLABLE} AND {summed}
GROUP BY ALL
ON CONFLICT DO UPDATE SET
    replica = greatest(replica, excluded.replica),
    model = greatest(model, excluded.model),
    requests = requests + excluded.requests,
    prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens;
INSERT INTO usage_edges
SELECT coalesce(instance, replica), replica, model, {tp}, finished_at, {p}, completion_tokens
FROM fresh WHERE status IN {BILLABLE} AND NOT ({summed});
INSERT INTO usage_hangups
SELECT request_id, coalesce(instance, replica), replica, team, model, received_at, {tp},
    finished_at, {p}, completion_tokens, choices
FROM fresh WHERE status = '{RequestStatus.CLIENT_ABORTED}';
"""


def counter_delta_sql(value: str, previous: str) -> str:
    """A counter's increase since the previous sample; after a drop (a restart), its value."""
    return f"CASE WHEN {previous} IS NULL THEN 0.0 WHEN {value} < {previous} THEN {value} ELSE {value} - {previous} END"


def engine_rollup_sql(bounded: bool = True) -> str:
    """SQL recomputing ``engine_hours`` for the instance-hours the ``fresh`` samples fall in.

    Each such hour is read again from ``engine_samples`` whole (a sample may arrive between two
    kept ones). ``bounded``: parameters ``$lo``..``$hi`` (Unix seconds) bound the fresh samples'
    times, so only the row groups of their hours are read. Deltas within the hour are ordered by
    time, then sample id, as ``billing.reconciliation`` orders them.
    """
    hour = f'CAST(floor("timestamp" / {HOUR_SECONDS}) AS BIGINT)'
    within = (
        f"""e."timestamp" >= floor($lo / {HOUR_SECONDS}) * {HOUR_SECONDS}
        AND e."timestamp" < (floor($hi / {HOUR_SECONDS}) + 1) * {HOUR_SECONDS}"""
        if bounded
        else "true"
    )
    return f"""
INSERT OR REPLACE INTO engine_hours
WITH touched AS (SELECT DISTINCT coalesce(instance, replica) AS i, {hour} AS hour FROM fresh),
samples AS (
    SELECT coalesce(e.instance, e.replica) AS i, {hour} AS hour, e.replica, e.model, e."timestamp",
        e.sample_id, e.prompt_tokens_total AS p, e.generation_tokens_total AS c
    FROM engine_samples e SEMI JOIN touched t ON t.i = coalesce(e.instance, e.replica) AND t.hour = {hour}
    WHERE {within}
),
ordered AS (
    SELECT *, row_number() OVER w AS n, count(*) OVER (PARTITION BY i, hour) AS samples,
        {counter_delta_sql("p", "lag(p) OVER w")} AS dp, {counter_delta_sql("c", "lag(c) OVER w")} AS dc
    FROM samples
    WINDOW w AS (PARTITION BY i, hour ORDER BY "timestamp", sample_id)
)
SELECT i, hour, max(replica), max(model), max(samples), min("timestamp"), max("timestamp"),
    max(p) FILTER (WHERE n = 1), max(c) FILTER (WHERE n = 1),
    max(p) FILTER (WHERE n = samples), max(c) FILTER (WHERE n = samples), sum(dp), sum(dc)
FROM ordered GROUP BY i, hour
"""


def tag_rollup_sql() -> str:
    """SQL adding the ``fresh`` billable usage records to ``usage_tags`` (``billing.breakdown``).

    Per hour, team, model, project and end user ('' for none): counts in the hour the record
    finished in, in-flight seconds spread over the hours they were spent in, as ``usage_slots``
    places them by the minute.
    """
    start, end = "received_at", "finished_at"
    hours = f"unnest(range(CAST(floor({start} / {HOUR_SECONDS}) AS BIGINT), CAST(floor({end} / {HOUR_SECONDS}) AS BIGINT) + 1))"
    overlap = f"greatest(0.0, least({end}, (hour + 1) * {HOUR_SECONDS}.0) - greatest({start}, hour * {HOUR_SECONDS}.0))"
    fin = f"(hour = CAST(floor({end} / {HOUR_SECONDS}) AS BIGINT))"
    return f"""
INSERT INTO usage_tags
SELECT hour, team, model, coalesce(project, ''), coalesce("user", ''),
    count(*) FILTER (WHERE {fin}),
    coalesce(sum(prompt_tokens) FILTER (WHERE {fin}), 0),
    coalesce(sum(cached_prompt_tokens) FILTER (WHERE {fin}), 0),
    coalesce(sum(completion_tokens) FILTER (WHERE {fin}), 0),
    sum({overlap})
FROM (SELECT *, {hours} AS hour FROM fresh WHERE status IN {BILLABLE})
GROUP BY ALL
ON CONFLICT DO UPDATE SET
    requests = requests + excluded.requests,
    prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    cached_prompt_tokens = cached_prompt_tokens + excluded.cached_prompt_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens,
    inflight_seconds = inflight_seconds + excluded.inflight_seconds;
"""
