"""Instance lifetimes: when each engine instance of a dynamic fleet ran, kept at ingest.

An instance's sidecar ships ``start``, a ``heartbeat`` every ``sidecar.heartbeat_seconds`` and
``stop`` once drained (``infermeter.records.InstanceEvent``), and every event repeats the
instance's ``started_at``. One lifetime is one (instance, started_at): a pod name that comes back
(a StatefulSet's ``vllm-0`` restarted) is a new lifetime. Its state:

``stopped``  it said ``stop``
``live``     it did not, and its last event is younger than ``LIVE_HEARTBEATS`` heartbeats
             plus ``SHIP_ALLOWANCE_SECONDS`` (the time an event may take to reach billing)
``lost``     it did not, and has been silent longer than that

**Kept at ingest.** Table ``lifetimes`` holds one row per lifetime, folded from the events in the
transaction that keeps them (``delta_sql``, ``fold_sql``): the latest event's word on what the
instance is (by time, then event id, so the order events arrive in does not matter), the first
and last event, the stop, and counts. Every field is a minimum, a maximum or the latest of
something, so an event folded twice changes nothing; the counts grow only by events that were
not kept before (ingest skips a known event id before any rollup). Every reader (the registry,
live counts, allocation's windows) reads ``lifetimes``, never the events, so its cost follows
the number of lifetimes, not of heartbeats.

**Heartbeats are kept raw for ``HEARTBEAT_RETENTION_SECONDS``** (by their own time), then pruned
(``prune_sql``); start and stop events stay. A week of them answers "when exactly was this pod
last heard, were there gaps" while an incident is looked at, and lets ingest recognise a resent
heartbeat by its id. A heartbeat already older than that when it arrives (a spool shipped after
a long outage) cannot be told from a resend of a pruned one: its time is folded (which is
idempotent) but it is neither kept raw nor counted, so a resend never counts twice.

**Where a lifetime ends** (``ended_sql``). At its ``stop``. One that never said stop (``kill
-9``, a lost node) ends at the best evidence of when the pod was gone: the latest of

- its last event;
- the last GPU sample the collector attributed to it (``gpu_samples.instance``), but never past
  ``last event + heartbeat_seconds``, the heartbeat that should have come: a GPU sample only says
  the board was reported under the pod's name, which dcgm-exporter may go on doing for a while
  after the pod is gone;
- the last engine sample the collector read from it (``engine_samples.instance``), uncapped: the
  engine answering is proof that the pod ran, however long after its last heartbeat.

A sample counts for the lifetime of its instance that started last before it (never for an
earlier lifetime of a pod name that came back). Ingest keeps the latest of each kind of sample
per lifetime (``sample_fold_sql``; again a maximum, so resends and order do not matter); a
lifetime that appears after its samples, or whose pod name comes back, is read again from the
samples once (``touched_sql``, ``seen_sql``). The cap is applied when lifetimes are read, with
the configured heartbeat.

**The live answer is bounded** (``LiveBound``). Instances announce themselves, so what the
registry calls live steers the collectors (which engines they read) and the sidecars' fail-open
limits (split by the live count). Per replica group, no more instances are live than the
configuration lets the group have (``infermeter.fleet_bound.group_bound``: its replica and
``scaling.max_replicas`` more; without a ceiling, ``min_replicas`` more, or what the autoscaler
has asked for lately, whichever is more); every group the configuration does not list shares one
such bound. Past it, the instances that started first are kept: an instance forged now cannot
push out the engines that were already running.

The builders are pure (SQL and parameters); ``billing.ledger`` runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from billing.schema import SLOT_SECONDS
from infermeter.config import Config, ScalingPolicy
from infermeter.fleet_bound import group_bound

__all__ = [
    "COLUMNS",
    "DEFAULT_HEARTBEAT_SECONDS",
    "HEARTBEAT_RETENTION_SECONDS",
    "LIVE_HEARTBEATS",
    "RAW_KEPT",
    "SHIP_ALLOWANCE_SECONDS",
    "GroupCaps",
    "LiveBound",
    "Restart",
    "State",
    "delta_sql",
    "ended_sql",
    "fold_sql",
    "heartbeat_seconds",
    "lifetimes_sql",
    "live_bound",
    "live_counts_sql",
    "live_since",
    "live_window_seconds",
    "prune_sql",
    "sample_fold_sql",
    "seen_sql",
    "slot_windows_sql",
    "touched_sql",
]

DEFAULT_HEARTBEAT_SECONDS: Final = 30.0
# Heartbeats an instance may miss (a slow shipper, a billing restart) and still count as live.
LIVE_HEARTBEATS: Final = 3
# On top of those, how late an event may reach billing: it travels through the sidecar's spool
# (a segment is shipped once 2 s old), the shipper (every second, backing off after a failure) and
# a group commit. Without it, an instance heartbeating every few seconds reads as lost, and
# drops out of the collectors' targets and the autoscaler's count, each time shipping lags.
SHIP_ALLOWANCE_SECONDS: Final = 10.0
# How long heartbeats stay in ``instance_events`` after their time (see the module docstring).
HEARTBEAT_RETENTION_SECONDS: Final = 7 * 86_400
COLUMNS: Final = (
    "instance",
    "replica",
    "model",
    "node",
    "gpu_model",
    "gpu_count",
    "gpus",
    "namespace",
    "pod_uid",
    "engine_metrics_url",
    "started_at",
    "last_seen",
    "stopped_at",
    "state",
)

State = Literal["live", "stopped", "lost"]

# What an instance says of itself may change between events (a metrics URL learned late): the
# latest event's word is kept. A field an event may leave empty keeps the latest word given, with
# the (time, event id) of the event that gave it in ``<field>_from``.
_LATEST = (
    "replica",
    "model",
    "node",
    "gpu_model",
    "gpu_count",
    "gpus",
    "namespace",
    "pod_uid",
    "engine_metrics_url",
)
_NULLABLE = ("namespace", "pod_uid", "engine_metrics_url")
_COUNTED_FIELDS = ("events", "heartbeats")
# The order of events: by time, then by event id.
_KEY = 'struct_pack(t := "timestamp", id := event_id)'

# An event kept raw in ``instance_events``: any but a heartbeat older than the retention.
# Parameter ``$old_before``: the time before which a heartbeat is that old.
RAW_KEPT: Final = """NOT (event = 'heartbeat' AND "timestamp" < $old_before)"""

# A sample's instance: the pod, or for a fixed replica the replica itself (as the rollups say).
_SAMPLE_INSTANCE = "coalesce(instance, replica)"
_SAMPLE_COLUMNS: Final = {"gpu_samples": "gpu_seen_until", "engine_samples": "engine_seen_until"}
# Only real readings are evidence: a recorded gap says the board was not read.
_EVIDENCE: Final = {"gpu_samples": "NOT gap", "engine_samples": "true"}


def heartbeat_seconds(config: Config) -> float:
    """How often sidecars heartbeat (``sidecar.heartbeat_seconds``)."""
    return float(config.sidecar.heartbeat_seconds)


# -- kept at ingest -------------------------------------------------------------------------


def delta_sql(old_before: str = "$old_before") -> str:
    """SQL folding the ``fresh`` instance events per lifetime into temp table ``_lifetime_delta``.

    ``old_before``: a SQL value; a heartbeat older than it is folded but not counted (see
    ``RAW_KEPT``). The latest fields come from the event latest by (time, event id); a field
    that may be null, from the latest event that gave it (``arg_max`` skips nulls).
    """
    by = '("timestamp", event_id)'
    latest = ",\n    ".join(
        [f"arg_max({c}, {by}) AS {c}" for c in _LATEST]
        + [f"max({_KEY}) FILTER (WHERE {c} IS NOT NULL) AS {c}_from" for c in _NULLABLE]
    )
    counted = f"""NOT (event = 'heartbeat' AND "timestamp" < {old_before})"""
    return f"""
CREATE OR REPLACE TEMP TABLE _lifetime_delta AS
SELECT instance, started_at,
    {latest},
    arg_max(event_id, {by}) AS latest_event_id,
    min("timestamp") AS first_seen,
    max("timestamp") AS last_seen,
    min("timestamp") FILTER (WHERE event = 'stop') AS stopped_at,
    count(*) FILTER (WHERE {counted}) AS events,
    count(*) FILTER (WHERE event = 'heartbeat' AND {counted}) AS heartbeats
FROM fresh
GROUP BY instance, started_at"""


def fold_sql() -> str:
    """SQL adding ``_lifetime_delta`` (``delta_sql``) to ``lifetimes``; new ones in ``_new_lifetimes``.

    An existing lifetime takes the delta's descriptive fields only when the delta's latest event
    is later (by time, then event id) than the one it holds. A sample kept as evidence of its
    end is dropped once an event as late or later arrives, or a stop: what is kept then depends
    only on the events and samples, not on the order they came in.
    """
    newer = (
        "(excluded.last_seen > last_seen OR "
        "(excluded.last_seen = last_seen AND excluded.latest_event_id > latest_event_id))"
    )
    given = "({0}_from IS NULL OR excluded.{0}_from > {0}_from)"
    open_after = "least(stopped_at, excluded.stopped_at) IS NULL AND {0} > greatest(last_seen, excluded.last_seen)"
    seen = ",\n    ".join(
        f"{c} = CASE WHEN {open_after.format(c)} THEN {c} END" for c in _SAMPLE_COLUMNS.values()
    )
    latest = ",\n    ".join(
        [
            f"{c} = CASE WHEN {newer} THEN excluded.{c} ELSE {c} END"
            for c in (*_LATEST, "latest_event_id")
            if c not in _NULLABLE
        ]
        + [
            f"{c} = CASE WHEN {given.format(c)} THEN excluded.{c} ELSE {c} END, "
            f"{c}_from = CASE WHEN {given.format(c)} THEN excluded.{c}_from ELSE {c}_from END"
            for c in _NULLABLE
        ]
    )
    counts = ",\n    ".join(f"{c} = {c} + excluded.{c}" for c in _COUNTED_FIELDS)
    columns = ", ".join(
        (
            "instance",
            "started_at",
            *_LATEST,
            *(f"{c}_from" for c in _NULLABLE),
            "latest_event_id",
            "first_seen",
            "last_seen",
            "stopped_at",
            *_COUNTED_FIELDS,
        )
    )
    return f"""
CREATE OR REPLACE TEMP TABLE _new_lifetimes AS
SELECT instance, started_at FROM _lifetime_delta ANTI JOIN lifetimes USING (instance, started_at);
INSERT INTO lifetimes ({columns})
SELECT {columns} FROM _lifetime_delta
ON CONFLICT DO UPDATE SET
    {latest},
    {seen},
    first_seen = least(first_seen, excluded.first_seen),
    last_seen = greatest(last_seen, excluded.last_seen),
    stopped_at = least(stopped_at, excluded.stopped_at),
    {counts};
"""


def touched_sql() -> str:
    """SQL choosing in temp table ``_touched`` the lifetimes whose samples must be read again.

    Of the instances in ``_lifetime_delta``, the open lifetimes that are new (their samples may
    have come first) or that hold a sample at or after the start of the instance's next lifetime
    (the pod name came back: the sample is the next one's). With each: its last event and the
    next lifetime's start (null: none).
    """
    return """
CREATE OR REPLACE TEMP TABLE _touched AS
SELECT instance, started_at, last_seen, next_start FROM (
    SELECT *, lead(started_at) OVER (PARTITION BY instance ORDER BY started_at) AS next_start
    FROM lifetimes WHERE instance IN (SELECT instance FROM _lifetime_delta)
)
WHERE stopped_at IS NULL AND (
    (instance, started_at) IN (SELECT instance, started_at FROM _new_lifetimes)
    OR greatest(gpu_seen_until, engine_seen_until) >= next_start
)"""


def seen_sql(since: str = "$since") -> str:
    """SQL setting the latest GPU and engine sample of each ``_touched`` lifetime, from the raw rows.

    Samples after the lifetime's last event and before the next lifetime's start; null when
    there is none (one before the last event never moves the end). ``since`` (a SQL value, at
    most every touched lifetime's last event) bounds the scan, so that only the row groups of
    recent samples are read.
    """
    latest = []
    for table, column in _SAMPLE_COLUMNS.items():
        latest.append(f"""{column} AS (
    SELECT t.instance, t.started_at, max(s."timestamp") AS seen
    FROM _touched t JOIN (
        SELECT {_SAMPLE_INSTANCE} AS instance, "timestamp" FROM {table}
        WHERE "timestamp" > {since} AND {_EVIDENCE[table]}
            AND {_SAMPLE_INSTANCE} IN (SELECT instance FROM _touched)
    ) s ON s.instance = t.instance AND s."timestamp" > t.last_seen
        AND s."timestamp" < coalesce(t.next_start, 'infinity'::DOUBLE)
    GROUP BY ALL
)""")
    return f"""
UPDATE lifetimes l SET gpu_seen_until = s.gpu, engine_seen_until = s.engine
FROM (
    WITH {", ".join(latest)}
    SELECT t.instance, t.started_at, g.seen AS gpu, e.seen AS engine
    FROM _touched t
    LEFT JOIN gpu_seen_until g USING (instance, started_at)
    LEFT JOIN engine_seen_until e USING (instance, started_at)
) s
WHERE l.instance = s.instance AND l.started_at = s.started_at"""


def sample_fold_sql(table: str) -> str:
    """SQL raising each open lifetime's latest sample of ``table`` by the ``fresh`` samples.

    ``table``: ``gpu_samples`` or ``engine_samples``. A sample belongs to the lifetime of its
    instance that started last at or before it; one not after the lifetime's last event is no
    evidence of its end and is left out. (A join on the instance and the latest start, rather
    than DuckDB's ASOF join: twice as fast for the few hundred samples of a collector's batch.)
    """
    column = _SAMPLE_COLUMNS[table]
    return f"""
UPDATE lifetimes l SET {column} = d.seen
FROM (
    SELECT instance, started_at, max(ts) AS seen FROM (
        SELECT f.instance, f.ts, max(m.started_at) AS started_at
        FROM (SELECT DISTINCT {_SAMPLE_INSTANCE} AS instance, "timestamp" AS ts FROM fresh
              WHERE {_SAMPLE_INSTANCE} IS NOT NULL AND {_EVIDENCE[table]}) f
        JOIN lifetimes m ON m.instance = f.instance AND m.started_at <= f.ts
        GROUP BY ALL
    )
    GROUP BY ALL
) d
WHERE l.instance = d.instance AND l.started_at = d.started_at AND l.stopped_at IS NULL
    AND d.seen > greatest(l.last_seen, l.{column})"""


def prune_sql() -> str:
    """SQL deleting the heartbeats older than ``$before`` from ``instance_events``.

    They are folded into ``lifetimes`` already (in the transaction that kept them).
    """
    return """DELETE FROM instance_events WHERE event = 'heartbeat' AND "timestamp" < $before"""


# -- read -----------------------------------------------------------------------------------


def ended_sql(heartbeat_seconds: float) -> str:
    """The SQL value of a ``lifetimes`` row's end, by the rule in the module docstring."""
    capped_gpu = (
        f"least(coalesce(gpu_seen_until, last_seen), last_seen + {float(heartbeat_seconds)!r})"
    )
    return f"coalesce(stopped_at, greatest(last_seen, {capped_gpu}, engine_seen_until))"


def live_counts_sql(
    now: float,
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
    restart: Restart | None = None,
    caps: GroupCaps | None = None,
) -> tuple[str, dict[str, Any]]:
    """Live instances per replica group and model (replica, model, instances)."""
    sql, params = lifetimes_sql(now, heartbeat_seconds, "live", restart=restart, caps=caps)
    return (
        f"SELECT replica, model, count(*) AS instances FROM ({sql}) GROUP BY ALL ORDER BY ALL",
        params,
    )


def live_window_seconds(heartbeat_seconds: float) -> float:
    """How long after its last event an instance that never said stop still counts as live."""
    return LIVE_HEARTBEATS * heartbeat_seconds + SHIP_ALLOWANCE_SECONDS


@dataclass(frozen=True, slots=True)
class Restart:
    """When this billing process began, and the latest instance event its ledger held then."""

    at: float
    last_heard: float | None


def live_since(now: float, heartbeat_seconds: float, restart: Restart | None = None) -> float:
    """The oldest last event an instance may have and still be live at ``now``.

    Billing hears nothing while it is down; the events the sidecars spooled meanwhile arrive
    only once it is back. Until it has been up a whole live window, an instance last heard of
    before it stopped is judged from that moment, not from now: a billing restart must not
    read the whole fleet as lost (the collectors would drop every engine, the autoscaler would
    count none, and fail-open limits would split by one).
    """
    window = live_window_seconds(heartbeat_seconds)
    since = now - window
    if restart is not None and restart.last_heard is not None and now - restart.at < window:
        since = min(since, restart.last_heard - window)
    return since


@dataclass(frozen=True, slots=True)
class GroupCaps:
    """The most live instances of each configured replica group, and of all the others together."""

    groups: Mapping[str, int]
    other: int


@dataclass(frozen=True, slots=True)
class LiveBound:
    """What the configuration lets each replica group run (see the module docstring)."""

    scaling: ScalingPolicy
    # Each configured replica group and the model it serves (the autoscaler decides per model).
    groups: Mapping[str, str]
    # How far back the autoscaler's asks still count: an instance it asked for before a
    # scale-down drains, and may stay live, that long after.
    asked_seconds: float

    def caps(self, asked: Mapping[str, int]) -> GroupCaps:
        """The caps, given the most the autoscaler lately asked for of each model."""
        groups = {g: group_bound(self.scaling, asked.get(m, 0)) for g, m in self.groups.items()}
        return GroupCaps(groups, group_bound(self.scaling))


def live_bound(config: Config) -> LiveBound:
    """The bound of ``config``'s fleet; asks count for a drain plus a live window."""
    window = config.sidecar.drain_seconds + live_window_seconds(heartbeat_seconds(config))
    return LiveBound(config.scaling, {r.id: r.model for r in config.replicas}, window)


def lifetimes_sql(
    now: float,
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
    state: Literal["live", "all"] = "all",
    replica: str | None = None,
    limit: int | None = None,
    restart: Restart | None = None,
    caps: GroupCaps | None = None,
) -> tuple[str, dict[str, Any]]:
    """Every lifetime (``COLUMNS``), or the live ones, optionally of one replica group.

    Ordered by group, instance and start; at most ``limit`` rows. ``last_seen`` is the last
    event: what the instance itself last said. ``restart``: see ``live_since``. ``caps``: the
    live ones are at most these, per group, the first started kept (the module docstring).
    """
    params: dict[str, Any] = {"since": live_since(float(now), heartbeat_seconds, restart)}
    where = []
    if state == "live":
        where.append("stopped_at IS NULL AND last_seen > $since")
    columns = ", ".join(COLUMNS[:-1])
    source = "lifetimes"
    if state == "live" and caps is not None:
        source, capped = _capped_sql(caps)
        params.update(capped)
    if replica is not None:
        where.append("replica = $replica")
        params["replica"] = replica
    sql = f"""
SELECT {columns}, CASE WHEN stopped_at IS NOT NULL THEN 'stopped'
    WHEN last_seen > $since THEN 'live' ELSE 'lost' END AS state
FROM {source} {"WHERE " + " AND ".join(where) if where else ""}
ORDER BY replica, instance, started_at"""
    if limit is not None:
        sql += "\nLIMIT $limit"
        params["limit"] = int(limit)
    return sql, params


def _capped_sql(caps: GroupCaps) -> tuple[str, dict[str, Any]]:
    """The live lifetimes within ``caps``, as a subquery, and its parameters.

    Ranked per group by start (then name), a group the configuration does not list ranked with
    every other such group, so forged groups share one cap instead of having one each.
    """
    params: dict[str, Any] = {"other_cap": int(caps.other)}
    rows = []
    for i, (group, cap) in enumerate(sorted(caps.groups.items())):
        rows.append(f"($cap_group_{i}, $cap_{i})")
        params[f"cap_group_{i}"], params[f"cap_{i}"] = group, int(cap)
    known = (
        f"(VALUES {', '.join(rows)}) AS c(cap_group, cap)"
        if rows
        else "(SELECT NULL::VARCHAR AS cap_group, NULL::BIGINT AS cap WHERE false) AS c"
    )
    sql = f"""(
SELECT l.* FROM lifetimes AS l LEFT JOIN {known} ON c.cap_group = l.replica
WHERE l.stopped_at IS NULL AND l.last_seen > $since
QUALIFY row_number() OVER (PARTITION BY c.cap_group ORDER BY l.started_at, l.instance)
    <= coalesce(c.cap, $other_cap)) AS live"""
    return sql, params


def slot_windows_sql(lo: int, hi: int, heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS) -> str:
    """The lifetimes as whole slots (instance, replica, first_slot, last_slot), for allocation.

    Every lifetime of an instance seen in slots ``lo``..``hi`` (any month's: an instance with a
    lifetime only elsewhere is still known, and its time here lies outside it). A lifetime holds
    the slots from the one it started in to the one holding the last instant before its end
    (``ended_sql``): a pod gone at 12:03:00 had none of minute 12:03.
    """
    first = f"CAST(floor(started_at / {SLOT_SECONDS}) AS BIGINT)"
    last = f"CAST(ceil({ended_sql(heartbeat_seconds)} / {SLOT_SECONDS}) AS BIGINT) - 1"
    return f"""(
SELECT instance, replica, {first} AS first_slot, greatest({first}, {last}) AS last_slot
FROM lifetimes
WHERE instance IN (SELECT DISTINCT instance FROM gpu_slots WHERE slot >= {int(lo)} AND slot < {int(hi)}))"""
