"""Retention: raw rows older than ``billing.retention.raw_days`` leave the ledger for Parquet.

What moves, and why only that. A month's statement reads the rollups (``usage_slots``,
``gpu_slots``, ``alloc_*``, ``usage_hours``, ``engine_hours``...) and the lifetimes, which never
leave the ledger; it reads raw ``usage`` and ``engine_samples`` only for the hours reconciliation
cannot take from the rollups (hang-ups, records it places one by one), within
``billing.reconciliation.LOOKBACK_SECONDS`` of the month, and a request runs at most
``billing.ingest_sql.MAX_REQUEST_SECONDS``. So the raw rows of ``usage``, ``gpu_samples`` and
``engine_samples`` before the *horizon* move, where the horizon is the earliest of:

- ``raw_days`` before now;
- ``MARGIN_SECONDS`` before the first month still computed from the ledger: one not closed, or
  closed with late records waiting for their adjustment (the current month always is);

floored to the day (UTC), and never moved back: runs more often than daily find nothing new, so
the archive holds about one file per table and day, not per run. Instance events, lifetimes, statements, quarantine,
keys and audit stay. Ingest refuses a record before the end of the horizon's month (the macro
``_archived_before`` in ``billing.schema``): it could be in the archive already (its id could
not be found to drop it as a repeat), and its month's statement is frozen.

The archive is plain Hive-partitioned Parquet,
``<root>/kind=<table>/cluster=<billing.cluster_name>/month=YYYY-MM/part-<run>.parquet``, readable
by any engine (one dataset per table, its clusters and months as columns, so several clusters
may share one bucket); a run's manifest, ``<root>/_manifests/<run>-<table>.json`` (files,
rows, SHA-256 of each file, time range, horizon), is written last. Clusters that share a root
see only their own partition and manifests (``_owned``): one cluster's retention never completes
or removes another's files. ``_``-prefixed paths are
skipped by Hive readers.

Crash safety, step by step (``retain``):

1. Each file is published whole under its final name (``billing.archive_store``: a flushed
   rename in a directory, a single upload to an object store). 2. The manifest likewise, after
   every file. 3. One ledger transaction deletes the rows
   whose ids the files hold (not "every row before the horizon": a record that arrived during the
   run stays for the next one) and records the run and its files. A crash before 2 leaves files
   no manifest names: the next run deletes them. A crash between 2 and 3 leaves a manifest the
   ledger does not know: the next run checks its files' checksums and completes it. Nothing is
   deleted from the ledger before its rows are durable in the archive, and a row is in the
   ledger or in exactly one listed file, never both for a reader of the ledger
   (``reader``), which reads only the files the ledger lists.

The archive is a local directory (a mounted volume) or any fsspec URL (an object store:
``billing.archive_store`` says how each publishes a file whole without a rename); one retention
runs at a time per archive (the service's timer, or the command with the service stopped).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import duckdb
import orjson

from billing import closing
from billing.archive_store import Store, fsync_path, open_store, readable, sha256_of, temp_name
from infermeter.months import month_bounds, month_of
from infermeter.records import ENGINE, GPU, USAGE, RecordKind

if TYPE_CHECKING:
    from billing.keeper import Keeper
    from infermeter.config import RetentionSettings

log = logging.getLogger("infermeter.billing")

__all__ = [
    "MARGIN_SECONDS",
    "RAW_KINDS",
    "ArchiveError",
    "Manifest",
    "Report",
    "archived_files",
    "fsync_path",
    "horizon",
    "horizons",
    "open_store",
    "part_path",
    "reader",
    "retain",
    "retaining",
    "runs",
    "sha256_of",
    "view_sql",
]

# What leaves the ledger: the raw tables that grow with traffic.
RAW_KINDS: Final[tuple[RecordKind, ...]] = (USAGE, GPU, ENGINE)
# A request runs at most a day (MAX_REQUEST_SECONDS) and reconciliation looks two hours back:
# two days before the first month still computed covers both.
MARGIN_SECONDS: Final = 2 * 86_400
DAY_SECONDS: Final = 86_400
MANIFESTS: Final = "_manifests"


class ArchiveError(Exception):
    """The archive does not hold what its manifest says (a missing or altered file)."""


@dataclass(frozen=True, slots=True)
class Report:
    """What one retention run did, per raw table: rows moved and runs completed or cleaned."""

    horizon: float
    moved: Mapping[str, int]
    completed: Sequence[str]
    removed: Sequence[str]

    def to_json(self) -> dict[str, Any]:
        """The API's and the command's answer."""
        return {
            "horizon": self.horizon,
            "moved": dict(self.moved),
            "completed": list(self.completed),
            "removed": list(self.removed),
        }


@dataclass(frozen=True, slots=True)
class Manifest:
    """One run's files for one raw table, as written last to ``_manifests``."""

    run_id: str
    kind: str
    horizon: float
    refuse_before: float
    files: tuple[dict[str, Any], ...]  # path (relative), month, rows, sha256, bytes
    time_range: tuple[float, float] | None

    @property
    def rows(self) -> int:
        return sum(int(f["rows"]) for f in self.files)

    def to_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "run_id": self.run_id,
                "kind": self.kind,
                "horizon": self.horizon,
                "refuse_before": self.refuse_before,
                "rows": self.rows,
                "time_range": list(self.time_range) if self.time_range else None,
                "files": list(self.files),
            },
            option=orjson.OPT_INDENT_2,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        doc = orjson.loads(data)
        span = doc.get("time_range")
        return cls(
            doc["run_id"],
            doc["kind"],
            float(doc["horizon"]),
            float(doc["refuse_before"]),
            tuple(doc["files"]),
            (float(span[0]), float(span[1])) if span else None,
        )


# -- pure ----------------------------------------------------------------------------------


def horizon(now: float, raw_days: int, computed_months: Iterable[str]) -> float:
    """Where raw rows stop leaving the ledger (module docstring): a day boundary (UTC)."""
    first = min([month_of(now), *computed_months])
    edge = min(now - raw_days * DAY_SECONDS, month_bounds(first)[0] - MARGIN_SECONDS)
    return float(edge // DAY_SECONDS * DAY_SECONDS)


def refuse_before(edge: float) -> float:
    """The end of the month ``edge`` falls in: ingest refuses records before it."""
    return float(month_bounds(month_of(edge))[1]) if edge > 0 else 0.0


def part_path(table: str, month: str, run_id: str, cluster: str = "default") -> str:
    """A run's file of ``cluster``'s ``table`` rows of ``month``, relative to the archive's root
    (Hive style)."""
    return f"kind={table}/cluster={cluster}/month={month}/part-{run_id}.parquet"


def manifest_path(run_id: str, table: str, cluster: str = "default") -> str:
    """Where ``cluster``'s run ``run_id`` of ``table`` lists its files (its commit point)."""
    return f"{MANIFESTS}/cluster={cluster}/{run_id}-{table}.json"


def _owned(rel: str, cluster: str) -> bool:
    """Whether the archive's file ``rel`` is this cluster's to complete or remove.

    Several clusters may share one archive root: each sees only its own partition
    (``cluster=<name>``), and the files of the layout before it (``kind=<t>/month=...``,
    ``_manifests/<run>.json``), which a single ledger wrote.
    """
    parts = rel.split("/")
    if parts[0] == MANIFESTS:
        return len(parts) == 2 or parts[1] == f"cluster={cluster}"
    return len(parts) > 1 and (parts[1] == f"cluster={cluster}" or parts[1].startswith("month="))


def months_between(lo: float, hi: float) -> list[str]:
    """Every month from the one of ``lo`` to the one of ``hi`` (inclusive)."""
    months, t = [], lo
    while t <= hi:
        months.append(month_of(t))
        t = month_bounds(month_of(t))[1]
    return months


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def files_sql(paths: Sequence[str]) -> str:
    """A DuckDB list literal of ``paths``."""
    return "[" + ", ".join(_quoted(p) for p in paths) + "]"


def view_sql(database: str, table: str, paths: Sequence[str]) -> str:
    """A temp view named ``table`` over the ledger's own rows and the archived ``paths``.

    Temporary objects are found before the database's own, so a query written for the ledger
    reads both unchanged; ``database`` names the file's catalog so the view does not read itself.
    """
    own = f'"{database}".main.{table}'
    archived = f"read_parquet({files_sql(paths)}, union_by_name = true, hive_partitioning = false)"
    return (
        f"CREATE OR REPLACE TEMP VIEW {table} AS "
        f"SELECT * FROM {own} UNION ALL BY NAME SELECT * FROM {archived}"
    )


def _select_sql(kind: RecordKind, lo: float, hi: float) -> str:
    t = f'"{kind.time_field}"'
    return f"SELECT * FROM {kind.table} WHERE {t} >= {lo!r} AND {t} < {hi!r} ORDER BY {t}"


# -- files ---------------------------------------------------------------------------------


def _manifests(store: Store, cluster: str) -> list[tuple[str, Manifest]]:
    """``cluster``'s manifests in the archive, each with where it is."""
    return [
        (rel, Manifest.from_bytes(store.read_bytes(rel)))
        for rel in store.files(MANIFESTS)
        if rel.endswith(".json") and _owned(rel, cluster)
    ]


def _check(store: Store, manifest: Manifest) -> None:
    for f in manifest.files:
        if store.sha256(f["path"]) != f["sha256"]:
            raise ArchiveError(
                f"{store.root}/{f['path']}: missing or not what manifest "
                f"{manifest.run_id}-{manifest.kind} says "
                "(its rows are still in the ledger; restore the file or remove the manifest)"
            )


# -- what the ledger lists of the archive ---------------------------------------------


def runs(ledger: Keeper) -> set[tuple[str, str]]:
    """(run, table) of every retention run the ledger has completed."""
    with ledger.reader() as cur:
        rows = cur.execute("SELECT run_id, kind FROM archive_runs").fetchall()
    return {(str(r), str(k)) for r, k in rows}


def horizons(ledger: Keeper) -> dict[str, float]:
    """Per raw table, the time before which its rows are in the archive."""
    with ledger.reader() as cur:
        rows = cur.execute("SELECT kind, max(horizon) FROM archive_runs GROUP BY kind").fetchall()
    return {str(k): float(h) for k, h in rows}


def archived_files(ledger: Keeper) -> dict[str, list[str]]:
    """Per raw table, the archive's files (their locations) that hold rows that left the ledger."""
    with ledger.reader() as cur:
        rows = cur.execute(
            "SELECT f.kind, r.root || '/' || f.path FROM archive_files f "
            "JOIN archive_runs r USING (run_id, kind) ORDER BY f.path"
        ).fetchall()
    files: dict[str, list[str]] = {}
    for kind, path in rows:
        files.setdefault(str(kind), []).append(str(path))
    return files


# -- the run -------------------------------------------------------------------------------


def retain(
    ledger: Keeper,
    root: str | Path,
    raw_days: int,
    now: float | None = None,
    cluster: str = "default",
) -> Report:
    """Move raw rows before the horizon to the archive at ``root`` (module docstring): a
    directory or any fsspec URL (``billing.archive_store``).

    Runs one at a time per archive (``Store.lock``): the service's timer and the command wait
    for each other rather than remove each other's files. ``cluster``: this ledger's
    ``billing.cluster_name``, a partition of every file it writes.
    """
    store = open_store(root)
    with store.lock():
        return _retain(ledger, store, raw_days, time.time() if now is None else now, cluster)


def _retain(ledger: Keeper, store: Store, raw_days: int, now: float, cluster: str) -> Report:
    completed = _complete(ledger, store, cluster)
    removed = _remove_orphans(store, cluster)
    computed = [m["month"] for m in closing.months(ledger) if not m["closed"] or m["late_records"]]
    edge = horizon(now, raw_days, computed)
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(4)
    moved: dict[str, int] = {}
    for kind in RAW_KINDS:
        manifest = _export(ledger, store, kind, run_id, edge, cluster)
        if manifest is not None:
            rel = manifest_path(run_id, kind.table, cluster)
            store.write_bytes(rel, manifest.to_bytes())
            _commit(ledger, store, manifest, rel)
        moved[kind.table] = manifest.rows if manifest else 0
    return Report(edge, moved, completed, removed)


def _export(
    ledger: Keeper, store: Store, kind: RecordKind, run_id: str, edge: float, cluster: str
) -> Manifest | None:
    """Write ``kind``'s rows before ``edge`` still in the ledger, one file per month."""
    t = f'"{kind.time_field}"'
    with ledger.snapshot() as cur:
        row = cur.execute(
            f"SELECT min({t}), max({t}), count(*) FROM {kind.table} WHERE {t} < ?", [edge]
        ).fetchone()
        if row is None or not row[2]:
            return None
        lo, hi = float(row[0]), float(row[1])
        files = []
        for month in months_between(lo, hi):
            a, b = month_bounds(month)
            rel = part_path(kind.table, month, run_id, cluster)
            staged = store.staging(rel)
            sql = _select_sql(kind, max(a, lo), min(b, edge))
            n = cur.execute(
                f"COPY ({sql}) TO {_quoted(str(staged))} (FORMAT parquet, COMPRESSION zstd)"
            ).fetchone()
            rows = int(n[0]) if n else 0
            if not rows:
                staged.unlink()
                continue
            digest = sha256_of(staged)
            size = staged.stat().st_size
            store.publish(staged, rel)
            files.append(
                {"path": rel, "month": month, "rows": rows, "sha256": digest, "bytes": size}
            )
    current = horizons(ledger).get(kind.table, 0.0)
    return Manifest(
        run_id,
        kind.table,
        max(edge, current),
        refuse_before(max(edge, current)),
        tuple(files),
        (lo, hi),
    )


def _commit(ledger: Keeper, store: Store, manifest: Manifest, rel: str) -> None:
    """Delete from the ledger the rows ``manifest`` (at ``rel``) lists, and list its files, at once."""
    kind = next(k for k in RAW_KINDS if k.table == manifest.kind)
    paths = [f"{store.root}/{f['path']}" for f in manifest.files]
    idf, t = f'"{kind.id_field}"', f'"{kind.time_field}"'
    with ledger.writing() as cur:
        if paths:
            store.register(cur)
            cur.execute(
                f"DELETE FROM {kind.table} WHERE {t} < ? AND {idf} IN "
                f"(SELECT {idf} FROM read_parquet({files_sql(paths)}))",
                [manifest.horizon],
            )
        cur.execute(
            "INSERT INTO archive_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [
                manifest.run_id,
                kind.table,
                manifest.horizon,
                manifest.refuse_before,
                store.root,
                rel,
                manifest.rows,
                time.time(),
            ],
        )
        if manifest.files:
            cur.executemany(
                "INSERT INTO archive_files VALUES (?, ?, ?, ?, ?, ?)",
                [
                    [manifest.run_id, kind.table, f["month"], f["path"], f["rows"], f["sha256"]]
                    for f in manifest.files
                ],
            )


def _complete(ledger: Keeper, store: Store, cluster: str) -> list[str]:
    """Finish this cluster's runs whose manifest is written but which the ledger does not list."""
    known = runs(ledger)
    done = []
    for rel, manifest in _manifests(store, cluster):
        if (manifest.run_id, manifest.kind) in known:
            continue
        _check(store, manifest)
        _commit(ledger, store, manifest, rel)
        done.append(f"{manifest.run_id}-{manifest.kind}")
    return done


def _remove_orphans(store: Store, cluster: str) -> list[str]:
    """Delete this cluster's files no manifest names (a run that stopped before its manifest)
    and temp files; another cluster's, sharing the root, are not this ledger's to judge."""
    named = {f["path"] for _, m in _manifests(store, cluster) for f in m.files}
    removed = []
    for kind in RAW_KINDS:
        for rel in store.files(f"kind={kind.table}"):
            if not _owned(rel, cluster):
                continue
            if temp_name(rel) or rel not in named:
                store.remove(rel)
                removed.append(rel)
    return removed


@contextmanager
def reader(
    ledger: Keeper, span: tuple[float, float] | None = None
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A cursor on ``ledger`` whose raw tables also hold their archived rows (temp views).

    ``span``: only the files of the months it touches (a query's range), so a query of this
    week opens none.
    """
    files = archived_files(ledger)
    if span is not None:
        months = {f"/month={m}/" for m in months_between(*span)}
        files = {t: [p for p in paths if any(m in p for m in months)] for t, paths in files.items()}
        files = {t: paths for t, paths in files.items() if paths}
    with ledger.reader() as cursor:
        if files:
            readable(cursor, [p for paths in files.values() for p in paths])
            row = cursor.execute("SELECT current_database()").fetchone()
            assert row is not None
            for table, paths in files.items():
                cursor.execute(view_sql(str(row[0]), table, paths))
        yield cursor


async def retaining(ledger: Keeper, settings: RetentionSettings, cluster: str = "default") -> None:
    """Run retention every ``settings.interval_seconds`` until cancelled (the billing service).

    A failed run is logged and tried again at the next interval: what it had not committed is
    still in the ledger, and the next run completes or removes what it left in the archive.
    """
    while True:
        await asyncio.sleep(settings.interval_seconds)
        try:
            report = await asyncio.to_thread(
                retain, ledger, settings.archive, settings.raw_days, None, cluster
            )
        except (ArchiveError, OSError, duckdb.Error) as exc:
            log.warning(
                "billing: retention failed, retried in %.0f s: %s", settings.interval_seconds, exc
            )
            continue
        if any(report.moved.values()) or report.completed or report.removed:
            log.info("billing: retention moved %s to %s", report.moved, settings.archive)
