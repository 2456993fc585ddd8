"""What billing knows of the fleet, who wrote each batch, and the records it keeps but never bills.

The ledger (``billing.ledger``) runs these on its own connection, inside its ingest transaction:
``known_tables`` puts the configuration's teams, models, replica groups and nodes where the trust
checks read them (``billing.trust_sql``), ``writers_table`` the writer of each batch of a
transaction, ``tag_tables`` the projects and users of a transaction's usage records that the
sidecar would have refused, and ``keep_unopened`` the lines billing could not open (a seal
missing or not verifying) in ``quarantine``, beside the well-formed records the checks
quarantine. ``summary`` and ``counts`` read the table back, for the statement and for /metrics.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import orjson
import polars as pl

from billing.keeper import Keeper
from billing.trust_sql import WRITER_COLUMNS, tags_sql
from infermeter.config import Config
from infermeter.records import RecordKind
from infermeter.statement import QUARANTINED_SCHEMA
from infermeter.tags import ProjectRule, project_allowed, user_allowed
from infermeter.writers import Writer

__all__ = [
    "KnownFleet",
    "Unopened",
    "counts",
    "frame_tags",
    "keep_unopened",
    "known_tables",
    "quarantine_counts",
    "quarantined",
    "refused_tags",
    "staged_tags",
    "summary",
    "tag_tables",
    "writers_table",
]


@dataclass(frozen=True, slots=True)
class KnownFleet:
    """The models, replica groups (with their model and node) and nodes of the configuration."""

    models: frozenset[str]
    groups: tuple[tuple[str, str, str], ...]
    nodes: frozenset[str]

    @classmethod
    def of(cls, config: Config) -> KnownFleet:
        """What ``config`` names."""
        return cls(
            frozenset(m.name for m in config.models),
            tuple((r.id, r.model, r.node) for r in config.replicas),
            frozenset(config.node_names()),
        )


def known_tables(
    con: duckdb.DuckDBPyConnection, teams: Sequence[str], fleet: KnownFleet | None
) -> None:
    """(Re)create the temp tables the trust checks read; the fleet's are empty without one."""
    con.execute("CREATE OR REPLACE TEMP TABLE _known_teams (name VARCHAR)")
    con.execute("CREATE OR REPLACE TEMP TABLE _known_models (name VARCHAR)")
    con.execute("CREATE OR REPLACE TEMP TABLE _known_nodes (name VARCHAR)")
    con.execute(
        "CREATE OR REPLACE TEMP TABLE _known_groups (replica VARCHAR, model VARCHAR, node VARCHAR)"
    )
    if teams:
        con.executemany("INSERT INTO _known_teams VALUES (?)", [(t,) for t in teams])
    if fleet is None:
        return
    if fleet.models:
        con.executemany("INSERT INTO _known_models VALUES (?)", [(m,) for m in fleet.models])
    if fleet.nodes:
        con.executemany("INSERT INTO _known_nodes VALUES (?)", [(n,) for n in fleet.nodes])
    if fleet.groups:
        con.executemany("INSERT INTO _known_groups VALUES (?, ?, ?)", list(fleet.groups))


def writers_table(con: duckdb.DuckDBPyConnection, writers: Sequence[Writer | None]) -> None:
    """Temp table ``_writers``: the writer of each batch (``item`` its place); None, the shared
    ingest token's (every column null)."""
    columns = ", ".join(f"{name} {sql}" for name, sql in WRITER_COLUMNS)
    con.execute(f"CREATE OR REPLACE TEMP TABLE _writers ({columns})")
    rows = [_writer_row(i, w) for i, w in enumerate(writers)]
    con.executemany("INSERT INTO _writers VALUES (?, ?, ?, ?, ?, ?, ?)", rows)


def _writer_row(item: int, w: Writer | None) -> tuple[Any, ...]:
    if w is None:
        return (item, None, None, None, None, None, None)
    return (item, str(w.role), w.principal, w.group, w.instance, w.address, list(w.nodes))


def refused_tags(
    rules: Mapping[str, ProjectRule] | None,
    projects: Iterable[tuple[str, str]],
    users: Iterable[str],
) -> tuple[list[tuple[str, str]], list[str]]:
    """Of the (team, project) pairs and the users of some usage records, those the sidecar would
    have refused (``infermeter.tags``). Without ``rules`` (a ledger opened by a tool, which was
    not told the teams' projects) no project is refused; users are, whatever the configuration.
    """
    refused = [] if rules is None else [p for p in projects if not project_allowed(rules, *p)]
    return refused, [u for u in users if not user_allowed(u)]


def tag_tables(
    con: duckdb.DuckDBPyConnection,
    projects: Sequence[tuple[str, str]],
    users: Sequence[str],
) -> None:
    """Temp tables ``_refused_projects(team, project)`` and ``_refused_users(name)``: the tags
    the trust checks quarantine a usage record for (``refused_tags``). Made per transaction from
    its records' distinct tags, a handful, so the team's Python pattern is what judges them."""
    con.execute("CREATE OR REPLACE TEMP TABLE _refused_projects (team VARCHAR, project VARCHAR)")
    con.execute("CREATE OR REPLACE TEMP TABLE _refused_users (name VARCHAR)")
    # One statement each, however many: a forged batch may hold a fresh tag in every record.
    if projects:
        teams, names = [t for t, _ in projects], [p for _, p in projects]
        con.execute(
            "INSERT INTO _refused_projects SELECT unnest(?::VARCHAR[]), unnest(?::VARCHAR[])",
            [teams, names],
        )
    if users:
        con.execute("INSERT INTO _refused_users SELECT unnest(?::VARCHAR[])", [list(users)])


def frame_tags(frame: pl.DataFrame) -> tuple[list[tuple[str, str]], list[str]]:
    """The distinct (team, project) pairs and users of a frame of usage records."""
    projects = frame.select("team", "project").drop_nulls().unique().rows()
    return projects, frame.get_column("user").drop_nulls().unique().to_list()


def staged_tags(
    con: duckdb.DuckDBPyConnection, body: str
) -> tuple[list[tuple[str, str]], list[str]]:
    """``frame_tags`` of a batch's JSON text (the per-record path), read as ``stage_sql`` reads it."""
    rows = con.execute(tags_sql(), {"body": body}).fetchall()
    projects = [(str(a), str(b)) for what, a, b in rows if what == "project"]
    return projects, [str(a) for what, a, _ in rows if what == "user"]


@dataclass(frozen=True, slots=True)
class Unopened:
    """A line billing could not take as its writer's: where it was, what it said, and why."""

    pos: int
    line: bytes
    label: str
    reason: str


def keep_unopened(
    con: duckdb.DuckDBPyConnection,
    kind: RecordKind,
    lines: Sequence[Unopened],
    writer: str | None,
    now: float,
) -> list[tuple[str, str]]:
    """Keep ``lines`` in ``quarantine`` (once each); their (id, reason), ids from the lines.

    ``writer``: the credential that sent them (it did not seal them, or they would have opened).
    """
    rows, answer = [], []
    for u in lines:
        text = u.line.rstrip(b"\n").decode("utf-8", "replace")
        record = _loads(u.line)
        rid = record.get(kind.id_field) if isinstance(record, dict) else None
        rid = rid if isinstance(rid, str) and rid else f"#{u.pos}"
        claimed = record.get(kind.time_field) if isinstance(record, dict) else None
        when = (
            float(claimed)
            if isinstance(claimed, int | float) and not isinstance(claimed, bool)
            else None
        )
        digest = hashlib.sha256(f"{kind.key}\n{text}\n{u.label}".encode()).hexdigest()
        rows.append((digest, kind.key, rid, writer, u.label, u.reason, text, when, now))
        answer.append((rid, u.reason))
    if rows:
        con.executemany(
            "INSERT INTO quarantine VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING", rows
        )
    return answer


def _loads(line: bytes) -> Any:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return None


def summary(cur: duckdb.DuckDBPyConnection, start: float, end: float) -> pl.DataFrame:
    """Records quarantined with a time in ``start``..``end`` (the time they claim, else when they
    arrived), per kind and reason category (``infermeter.statement.QUARANTINED_SCHEMA``)."""
    frame: pl.DataFrame = cur.sql(
        """SELECT kind, label AS reason, count(*) AS records FROM quarantine
        WHERE coalesce(record_time, quarantined_at) >= $start
          AND coalesce(record_time, quarantined_at) < $end
        GROUP BY ALL ORDER BY kind, reason""",
        params={"start": start, "end": end},
    ).pl()
    return frame.cast(QUARANTINED_SCHEMA)  # type: ignore[arg-type]


def counts(cur: duckdb.DuckDBPyConnection) -> list[tuple[str, str, int]]:
    """Every record ever quarantined, per (kind, reason category)."""
    rows = cur.execute("SELECT kind, label, count(*) FROM quarantine GROUP BY ALL").fetchall()
    return [(str(k), str(label), int(n)) for k, label, n in rows]


def quarantined(ledger: Keeper, start: float, end: float) -> pl.DataFrame:
    """Records quarantined for ``start``..``end``, per kind and reason (``QUARANTINED_SCHEMA``)."""
    with ledger.reader() as cur:
        return summary(cur, start, end)


def quarantine_counts(ledger: Keeper) -> list[tuple[str, str, int]]:
    """Every record ever quarantined, per (kind, reason category), for /metrics."""
    with ledger.reader() as cur:
        return counts(cur)
