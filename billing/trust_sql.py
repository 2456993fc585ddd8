"""SQL deciding which well-formed records billing trusts, and keeping the others in quarantine.

A record can be well formed (every check of ``billing.ingest_sql`` passes) and still not be one to
bill: written by a credential that may not write it (another instance's usage, another node's GPU
samples, an engine address that is not the instance's own), or naming a team, model, replica
group or node the configuration does not know. Those are quarantined: kept whole in the
``quarantine`` table with the writer and the reason, counted on /metrics and shown on the
statement, never billed and never dropped.

Each batch's writer is a row of temp table ``_writers`` (``item``, and ``w_role``,
``w_principal``, ``w_group``, ``w_instance``, ``w_address``, ``w_nodes`` from
``infermeter.writers.Writer``; all null for the shared ingest token, whose records are checked
against the configuration only). What the configuration knows is in ``_known_teams(name)``,
``_known_models(name)``, ``_known_groups(replica, model, node)`` and ``_known_nodes(name)``;
the model, group and node checks are left out when the ledger was not told the fleet
(``fleet=False``), as for a ledger opened by a tool. The usage records' tags the sidecar would
have refused are in ``_refused_projects(team, project)`` and ``_refused_users(name)``, judged in
Python for each transaction (``billing.quarantine.tag_tables``): a team's ``project_pattern``
is a Python regular expression, which DuckDB's RE2 functions may read otherwise.

The builders are pure; the checks are (condition, label, reason) over the checked batch ``t``,
the label being the bounded category /metrics counts by.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from infermeter.records import (
    BILLABLE_STATUSES,
    BUDGET_OVERRIDES,
    ENGINE,
    GPU,
    INSTANCES,
    SCALING_DECISIONS,
    USAGE,
    RecordKind,
)
from infermeter.tags import MAX_PROJECT_CHARS, MAX_USER_CHARS
from infermeter.writers import KINDS_BY_ROLE

__all__ = [
    "LABELS",
    "WRITER_COLUMNS",
    "quarantine_sql",
    "tags_sql",
    "trusted_sql",
]

# The categories a quarantined record is counted by (a bounded /metrics label).
LABELS: Final = (
    "unsealed",
    "bad_seal",
    "foreign_writer",
    "foreign_address",
    "unknown_team",
    "unknown_model",
    "unknown_replica",
    "unknown_node",
    "project_not_allowed",
    "bad_user",
)
# The columns of ``_writers``, with their types.
WRITER_COLUMNS: Final = (
    ("item", "INTEGER"),
    ("w_role", "VARCHAR"),
    ("w_principal", "VARCHAR"),
    ("w_group", "VARCHAR"),
    ("w_instance", "VARCHAR"),
    ("w_address", "VARCHAR"),
    ("w_nodes", "VARCHAR[]"),
)

_BILLABLE = repr(tuple(str(s) for s in BILLABLE_STATUSES))
_ENGINE_OF = "coalesce(t.instance, t.replica)"
_BY = "' (written by ' || w_principal || ')'"

Check = tuple[str, str, str]


def _roles(kind: str) -> Check:
    roles = tuple(sorted(str(r) for r, kinds in KINDS_BY_ROLE.items() if kind in kinds))
    allowed = repr(roles).replace(",)", ")") if roles else "('')"
    return (
        f"w_role IS NOT NULL AND w_role NOT IN {allowed}",
        "foreign_writer",
        f"'a ' || w_role || ' may not write {kind}' || {_BY}",
    )


def _not_its_instance(instance: str, group: str) -> Check:
    return (
        f"w_role = 'instance' AND ({group} IS DISTINCT FROM w_group OR {instance} IS DISTINCT FROM w_instance)",
        "foreign_writer",
        f"'instance ' || to_json({instance}) || ' of group ' || to_json({group}) || "
        f"' is not the credential''s' || {_BY}",
    )


def _own_id(kind: RecordKind, rest: str, prefix: bool = False) -> Check:
    """A record whose id is not the one its own fields give (``infermeter.ids.sample_id``).

    Ids are kept once, across every writer and forever, and the ids a writer mints are
    predictable (the time and what was read): unchecked, node-a's collector could send samples of
    its own node under node-b's coming ids, and node-b's real ones would then be answered as
    repeats and never billed. Bound to the record's own fields (its node, instance, team or
    model, which the checks before this one hold to the credential), an id can only be taken by
    the writer that may write it. The id's time is the record's in milliseconds, either way of
    a half (Python's ``round`` and SQL's differ there). ``rest``: what follows the time, all of it
    or (``prefix``) its start, as for a GPU of a MIG slice or a shared board, whose last parts
    are not fields. Writers with a credential only: the shared ingest token writes as anyone.
    """
    rid = f"t.{_q(kind.id_field)}"
    x = f"(t.{_q(kind.time_field)} * 1000)"
    ms = f"split_part({rid}, '/', 1)"
    near = (
        f"(({ms} = printf('%013d', TRY_CAST(floor({x}) AS BIGINT)) AND {x} - floor({x}) <= 0.5)"
        f" OR ({ms} = printf('%013d', TRY_CAST(ceil({x}) AS BIGINT)) AND ceil({x}) - {x} <= 0.5))"
    )
    after = f"substr({rid}, length({ms}) + 2)"
    own = f"starts_with({after}, {rest} || '/')" if prefix else f"{after} = {rest}"
    expected = f"printf('%013d', TRY_CAST(round({x}) AS BIGINT)) || '/' || {rest}"
    more = "/..." if prefix else ""
    return (
        f"w_role IS NOT NULL AND NOT coalesce({near} AND {own}, false)",
        "foreign_writer",
        f"'{kind.id_field}: not the id its own fields give (' || coalesce({expected}, 'none')"
        f" || '{more})' || {_BY}",
    )


def _q(name: str) -> str:
    return f'"{name}"'


# The instance ``t`` names runs on one of the collector's nodes: its lifetime says so, or it is
# a fixed replica of a group configured there.
_ON_COLLECTOR_NODES = f"""(EXISTS (SELECT 1 FROM lifetimes l WHERE l.instance = {_ENGINE_OF}
        AND list_contains(t.w_nodes, l.node))
    OR EXISTS (SELECT 1 FROM _known_groups g WHERE t.instance IS NULL AND g.replica = t.replica
        AND list_contains(t.w_nodes, g.node)))"""


def _known(column: str, table: str, label: str, noun: str, guard: str = "true") -> Check:
    return (
        f"{guard} AND {column} IS NOT NULL AND {column} NOT IN (SELECT name FROM {table})",
        label,
        f"'unknown {noun} ' || to_json({column})",
    )


def _group_known(guard: str = "true") -> Check:
    return (
        f"{guard} AND t.replica IS NOT NULL AND t.replica NOT IN (SELECT replica FROM _known_groups)",
        "unknown_replica",
        "'unknown replica group ' || to_json(t.replica)",
    )


def _group_serves(guard: str = "true") -> Check:
    return (
        f"""{guard} AND t.replica IN (SELECT replica FROM _known_groups) AND NOT EXISTS (
            SELECT 1 FROM _known_groups g WHERE g.replica = t.replica AND g.model = t.model)""",
        "unknown_model",
        "'replica group ' || to_json(t.replica) || ' does not serve model ' || to_json(t.model)",
    )


# What a usage record is tagged with must be what the sidecar lets a request carry
# (``infermeter.tags``), whatever its status: the sidecar never writes a tag it refused, and a
# record's project and user become rows of the statement's breakdown and of the exports.
_TAG_CHECKS: Final[tuple[Check, ...]] = (
    (
        "t.project IS NOT NULL AND EXISTS (SELECT 1 FROM _refused_projects p "
        "WHERE p.team = t.team AND p.project = t.project)",
        "project_not_allowed",
        f"'project ' || to_json(left(t.project, {MAX_PROJECT_CHARS})) || ' is not one team ' "
        "|| to_json(t.team) || ' allows'",
    ),
    (
        't."user" IS NOT NULL AND t."user" IN (SELECT name FROM _refused_users)',
        "bad_user",
        f"'user: not a string of 1 to {MAX_USER_CHARS} printable characters'",
    ),
)


def _identity_checks() -> Mapping[str, tuple[Check, ...]]:
    """Who may write each kind's records, whatever the configuration knows."""
    # A collector writes the usage a gone sidecar's admission journal holds, on the nodes it
    # reads: each request's ending as the sidecar kept it (a sidecar killed after a request
    # ended and before its record was written leaves that ending), else interrupted. So any
    # status, as the sidecar itself would have written it; the node is what bounds it.
    return {
        USAGE.key: (
            _roles(USAGE.key),
            _not_its_instance(_ENGINE_OF, "t.replica"),
            (
                f"w_role = 'collector' AND NOT {_ON_COLLECTOR_NODES}",
                "foreign_writer",
                f"'instance ' || to_json({_ENGINE_OF}) || ' is not on the collector''s nodes' || {_BY}",
            ),
        ),
        GPU.key: (
            _roles(GPU.key),
            (
                "w_role = 'collector' AND NOT list_contains(w_nodes, t.node)",
                "foreign_writer",
                f"'node ' || to_json(t.node) || ' is not the collector''s' || {_BY}",
            ),
            _own_id(GPU, "t.node || '/' || t.uuid", prefix=True),
        ),
        ENGINE.key: (
            _roles(ENGINE.key),
            (
                "w_role = 'collector' AND (t.node IS NULL OR NOT list_contains(w_nodes, t.node))",
                "foreign_writer",
                f"'engine on node ' || coalesce(to_json(t.node), 'null') || ', not the collector''s' || {_BY}",
            ),
            (
                f"""w_role = 'collector' AND (
                    (EXISTS (SELECT 1 FROM lifetimes l WHERE l.instance = {_ENGINE_OF})
                     AND NOT EXISTS (SELECT 1 FROM lifetimes l WHERE l.instance = {_ENGINE_OF}
                                     AND l.node = t.node))
                    OR EXISTS (SELECT 1 FROM _known_groups g WHERE t.instance IS NULL
                               AND g.replica = t.replica AND g.node <> t.node))""",
                "foreign_writer",
                f"'engine ' || to_json({_ENGINE_OF}) || ' does not run on node ' || to_json(t.node) || {_BY}",
            ),
            _own_id(ENGINE, _ENGINE_OF),
        ),
        INSTANCES.key: (
            _roles(INSTANCES.key),
            _not_its_instance("t.instance", "t.replica"),
            (
                "w_role = 'instance' AND t.engine_metrics_url IS NOT NULL AND "
                "t.engine_metrics_url IS DISTINCT FROM ('http://' || w_address || '/engine/metrics')",
                "foreign_address",
                "'engine_metrics_url ' || to_json(t.engine_metrics_url) || ' is not the instance''s "
                f"own address (' || coalesce(w_address, 'none in its credential') || ')' || {_BY}",
            ),
            _own_id(INSTANCES, "t.instance || '/' || t.event"),
        ),
        BUDGET_OVERRIDES.key: (
            _roles(BUDGET_OVERRIDES.key),
            _not_its_instance("t.issued_by", "w_group"),
            _own_id(BUDGET_OVERRIDES, "t.issued_by || '/' || t.team"),
        ),
        SCALING_DECISIONS.key: (
            _roles(SCALING_DECISIONS.key),
            _own_id(SCALING_DECISIONS, "'scale/' || t.model"),
        ),
    }


def _knowledge_checks(fleet: bool) -> Mapping[str, tuple[Check, ...]]:
    """What each kind must name that the configuration knows (with ``fleet``, beyond teams), and
    the usage records' tags it allows."""
    billable = f"t.status IN {_BILLABLE}"
    usage = [_known("t.team", "_known_teams", "unknown_team", "team", billable)]
    gpu: list[Check] = []
    engine: list[Check] = []
    instances: list[Check] = []
    if fleet:
        usage += [
            _known("t.model", "_known_models", "unknown_model", "model", billable),
            _group_known(billable),
            _group_serves(billable),
        ]
        gpu += [
            _known("t.node", "_known_nodes", "unknown_node", "node"),
            _known("t.model", "_known_models", "unknown_model", "model"),
            _group_known(),
        ]
        engine += [
            _known("t.node", "_known_nodes", "unknown_node", "node"),
            _known("t.model", "_known_models", "unknown_model", "model"),
            _group_known(),
        ]
        instances += [
            _known("t.node", "_known_nodes", "unknown_node", "node"),
            _known("t.model", "_known_models", "unknown_model", "model"),
            _group_known(),
            _group_serves(),
        ]
    return {
        USAGE.key: (*usage, *_TAG_CHECKS),
        GPU.key: tuple(gpu),
        ENGINE.key: tuple(engine),
        INSTANCES.key: tuple(instances),
    }


def tags_sql() -> str:
    """SQL reading a usage batch's JSON text (``$body``) for its distinct tags: rows
    ('project', team, project) and ('user', user, null), each field read as ``stage_sql`` reads
    it. A record that is not well formed may add a row; it is rejected before any tag counts."""
    return f"""
WITH src AS (SELECT CAST(json_extract(CAST($body AS JSON), '$.{USAGE.key}') AS JSON[]) AS l),
raw AS (SELECT unnest(l) AS r FROM src)
SELECT DISTINCT 'project', r->>'$.team', r->>'$.project' FROM raw
    WHERE r->>'$.team' IS NOT NULL AND r->>'$.project' IS NOT NULL
UNION ALL
SELECT DISTINCT 'user', r->>'$.user', NULL FROM raw WHERE r->>'$.user' IS NOT NULL
"""


def trusted_sql(kind: RecordKind, checked: str, fleet: bool) -> str:
    """``checked`` (a query with ``reason``) with ``quarantine``: a struct (label, reason) for a
    well-formed record billing does not trust, null for one it does and for a malformed one.

    ``checked`` must carry the ``_writers`` columns of its batch.
    """
    checks = [*_identity_checks()[kind.key], *_knowledge_checks(fleet).get(kind.key, ())]
    if not checks:
        return f"SELECT *, NULL::STRUCT(label VARCHAR, reason VARCHAR) AS quarantine FROM {checked}"
    cases = "\n".join(
        f"        WHEN {cond} THEN struct_pack(label := '{label}', reason := {reason})"
        for cond, label, reason in checks
    )
    return f"""SELECT t.*, CASE WHEN t.reason IS NULL THEN CASE
{cases}
    END END AS quarantine
FROM {checked} t"""


def record_json_sql(kind: RecordKind) -> str:
    """A checked record as one JSON object, as the ``quarantine`` table keeps it."""
    pairs = ", ".join(f"'{f.name}', \"{f.name}\"" for f in kind.fields)
    return f"json_object({pairs})"


def quarantine_sql(kind: RecordKind) -> str:
    """SQL keeping the quarantined rows of ``_rejected`` (those with a label) in ``quarantine``.

    Once per digest: a batch sent again adds nothing. Parameter ``$now``. Its result is the
    number of rows added.
    """
    return f"""
INSERT INTO quarantine (digest, kind, record_id, writer, label, reason, record, record_time,
    quarantined_at)
SELECT digest, '{kind.key}', id, writer, label, reason, record, record_time, CAST($now AS DOUBLE)
FROM (
    SELECT *, sha256('{kind.key}' || chr(10) || record || chr(10) || label) AS digest
    FROM _rejected WHERE label IS NOT NULL
    QUALIFY row_number() OVER (PARTITION BY digest ORDER BY item, pos) = 1
) ANTI JOIN quarantine USING (digest)
"""
