"""The DuckDB ledger: the one module that opens database connections, and the one that keeps.

One process owns the file (DuckDB allows a single writer), and every read and write goes
through a ``Ledger``: its cursors (``reader``), its read transactions (``snapshot``: many
queries, one committed state) and its writing transactions (``writing``, under the writer's
lock). Writes are serialised by that lock, each ingest batch is one transaction (batches that
arrive together share one), and a batch is acknowledged only after its transaction commits, so
a batch that was acknowledged survives a crash and a batch that was not is simply resent by its
shipper. Reads use their own cursors and run beside the writer.

What the ledger does itself is keep: open and migrate the file, take batches in (checks,
quarantine, the raw rows) and, in the same transaction, what ingest derives from them (the
minute rollups, the lifetimes fold, the hours and months marked dirty). Everything that reads
or computes from what it keeps builds its SQL as pure functions and runs it through those
transactions, in modules of its own: the month's allocation (``billing.allocation_runs``), the
months and their frozen statements (``billing.closing``), the registry (``billing.registry``),
reconciliation (``billing.reconciled``), invoices (``billing.invoice_store``), the Parquet
export (``billing.parquet_export``). They ask for the ledger by its shape
(``billing.keeper.Keeper``); the few month reads that the archive and federation call on the
ledger itself are one-line forwards to ``billing.closing``.

The few connections that are not the service's ledger (a backup being restored, a scratch
database for allocation over frames) are opened here too (``connect``), so a reader looking for
what can hold a ledger file open reads one module; ``tests/test_architecture.py`` fails on a
``duckdb.connect`` anywhere else.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import duckdb
import orjson
import polars as pl

from billing import (
    hourly,
    ingest_sql,
    lifetimes,
    quarantine,
    reconciliation_hours,
    trust_sql,
)
from billing.bounds import SampleBounds, bounds_tables
from billing.fastpath import arrow_frame, ndjson_frame, typed_frame
from billing.group_commit import GroupCommit, Ticket
from billing.jsonkeys import NestedTooDeeplyError, duplicate_key
from billing.keeper import LedgerError, LedgerUnavailableError
from billing.lifetimes import (
    DEFAULT_HEARTBEAT_SECONDS,
    HEARTBEAT_RETENTION_SECONDS,
    Restart,
)
from billing.quarantine import KnownFleet, Unopened
from billing.schema import (
    HOUR_SECONDS,
    LATEST_VERSION,
    MIGRATIONS,
    USAGE_TAGS_VERSION,
    new_field_sql,
)
from infermeter.errors import BadRequest
from infermeter.months import month_of
from infermeter.records import KINDS, USAGE, RecordKind
from infermeter.tags import ProjectRule
from infermeter.wire import arrow_extent, line_count
from infermeter.writers import Writer

__all__ = [
    "BatchTooLargeError",
    "IngestResult",
    "Ledger",
    "LedgerError",
    "LedgerUnavailableError",
    "Rejection",
    "connect",
]


def connect(
    path: str | Path | None = None,
    *,
    read_only: bool = False,
    config: Mapping[str, Any] | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection to the file at ``path``, or to a scratch in-memory database (None).

    Raises ``duckdb.Error`` as DuckDB does (a file another process holds, a file that is not a
    database): the callers say what that means for them.
    """
    target = ":memory:" if path is None else str(path)
    return duckdb.connect(target, read_only=read_only, config=dict(config or {}))


class BatchTooLargeError(BadRequest):
    """More records in one batch than the service accepts (``billing.max_batch_records``)."""


@dataclass(frozen=True, slots=True)
class Rejection:
    """A record billing will not keep, and why."""

    id: str
    reason: str


@dataclass(frozen=True, slots=True)
class IngestResult:
    """What happened to one batch: kept, already known, refused with a reason, or quarantined.

    A quarantined record is well formed but not one billing trusts (``billing.trust_sql``): it
    is kept in the ``quarantine`` table, never billed, so its shipper need not keep it.
    """

    kind: str
    accepted: int
    duplicates: int
    rejected: list[Rejection] = field(default_factory=list)
    quarantined: list[Rejection] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ingest API's answer."""
        return {
            "kind": self.kind,
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "rejected": [{"id": r.id, "reason": r.reason} for r in self.rejected],
            "quarantined": [{"id": r.id, "reason": r.reason} for r in self.quarantined],
        }


# A transaction takes batches up to this many records in all (a larger single batch goes alone),
# which bounds the memory a group holds and how long its callers wait for their answer.
MAX_GROUP_RECORDS: Final = 500_000
# While other batches are still being parsed, a smaller transaction waits this long for them: an
# append of a whole DuckDB row group (122,880 rows) goes straight to the file compressed, which
# is much cheaper per record than logging it and checkpointing it later.
GROUP_TARGET_RECORDS: Final = 122_880
GROUP_MAX_WAIT_SECONDS: Final = 0.1


@dataclass(frozen=True, slots=True)
class _Pending:
    """A parsed batch waiting for its transaction."""

    kind: RecordKind
    frame: pl.DataFrame | None  # typed columns (fast path), or None
    raw: bytes | None  # the batch as {"<kind>": [...]} JSON, for the per-record path
    malformed: frozenset[int]
    now: float | None
    skew: float
    # Who sent it (None: the shared ingest token, or a caller inside billing).
    writer: Writer | None = None


class Ledger:
    """The ledger file, its schema, and the only writer to it."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        teams: Sequence[str],
        ttft_sla_seconds: dict[str, float],
        kinds: Mapping[str, RecordKind] = KINDS,
        heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
        fleet: KnownFleet | None = None,
        bounds: SampleBounds | None = None,
        projects: Mapping[str, ProjectRule] | None = None,
    ) -> None:
        self._con = con
        # What a sample may physically claim (``billing.bounds``); the defaults without one.
        self.bounds = bounds or SampleBounds()
        # The configuration's models, groups and nodes, for the trust checks (``billing.trust_sql``);
        # None (a ledger opened by a tool): only teams are checked.
        self.fleet = fleet
        # Each team's project tags (``infermeter.tags``), which a usage record's project must be
        # one of; None (a ledger opened by a tool): projects are not checked, users still are.
        self.projects = projects
        self.kinds = kinds
        # The sidecars' heartbeat (``sidecar.heartbeat_seconds``): where allocation ends a
        # lifetime that never stopped (``billing.lifetimes``).
        self.heartbeat_seconds = float(heartbeat_seconds)
        # Heartbeats before this time have been pruned from ``instance_events`` (by this process).
        self._pruned_before = float("-inf")
        self._write_lock = threading.Lock()
        # Committed ingest transactions and the records they kept, for /metrics (written only
        # under the writer lock): their ratio is how well group commit is grouping.
        self.ingest_transactions = 0
        self.ingest_records = 0
        self._group: GroupCommit[_Pending, IngestResult] = GroupCommit(
            self._run_group,
            self._write_lock,
            MAX_GROUP_RECORDS,
            GROUP_TARGET_RECORDS,
            GROUP_MAX_WAIT_SECONDS,
        )
        self._touched_lock = threading.Lock()
        self._touched: tuple[float, float] | None = None
        # What the instance registry needs to judge liveness across this process's start.
        self.restart = Restart(time.time(), self._last_heard())
        self.teams = list(teams)
        self.ttft_sla = dict(ttft_sla_seconds)
        self._set_teams(self.teams)

    def _last_heard(self) -> float | None:
        """The latest instance event the ledger holds (None: none, or no lifetimes table)."""
        try:
            row = self._con.execute("SELECT max(last_seen) FROM lifetimes").fetchone()
        except duckdb.CatalogException:
            return None
        return float(row[0]) if row and row[0] is not None else None

    @classmethod
    def open(
        cls,
        path: str | Path,
        teams: Sequence[str],
        ttft_sla_seconds: dict[str, float],
        memory_limit: str = "2GB",
        threads: int | None = None,
        kinds: Mapping[str, RecordKind] = KINDS,
        heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
        fleet: KnownFleet | None = None,
        bounds: SampleBounds | None = None,
        projects: Mapping[str, ProjectRule] | None = None,
    ) -> Ledger:
        """Open (or create) the ledger at ``path`` (":memory:" for a throw-away one) and migrate it."""
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {"memory_limit": memory_limit}
        if threads:
            config["threads"] = threads
        try:
            con = connect(path, config=config)
        except duckdb.Error as exc:
            raise LedgerError(f"{path}: cannot open the ledger: {exc}") from None
        migrate(con, str(path), kinds.values())
        return cls(con, teams, ttft_sla_seconds, kinds, heartbeat_seconds, fleet, bounds, projects)

    def close(self) -> None:
        """Checkpoint and close the file."""
        with self._write_lock:
            self._con.execute("CHECKPOINT")
            self._con.close()

    def _set_teams(self, teams: Sequence[str]) -> None:
        quarantine.known_tables(self._con, teams, self.fleet)
        bounds_tables(self._con, self.bounds)
        self._con.execute("CREATE OR REPLACE TEMP TABLE _sla (model VARCHAR, ttft_seconds DOUBLE)")
        if self.ttft_sla:
            self._con.executemany("INSERT INTO _sla VALUES (?, ?)", list(self.ttft_sla.items()))

    def reconfigure(
        self,
        teams: Sequence[str],
        ttft_sla_seconds: dict[str, float],
        fleet: KnownFleet | None = None,
        projects: Mapping[str, ProjectRule] | None = None,
    ) -> None:
        """Adopt a new team list, SLA targets, fleet and project rules (after a config reload);
        the next ingest transaction checks by them."""
        with self._write_lock:
            self.fleet = fleet if fleet is not None else self.fleet
            self.projects = projects if projects is not None else self.projects
            self.teams = list(teams)
            self.ttft_sla = dict(ttft_sla_seconds)
            self._set_teams(self.teams)

    @contextmanager
    def reader(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor for reading, usable from any thread while the writer works.

        Nothing of the ledger's file is written through it. The one writer it serves is the
        dashboards' coarse copies (``billing.rollups``), which live in an in-memory database
        attached beside the file: no ingest transaction touches them, so their transactions
        need not, and must not, wait for the writer's lock.
        """
        cursor = self._con.cursor()
        try:
            yield cursor
        finally:
            cursor.close()

    @contextmanager
    def writing(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor in a transaction of its own, under the writer's lock: committed when the block
        ends, rolled back if it raises. For the few rows billing writes itself (keys, audit)."""
        with self._write_lock, self.reader() as cursor:
            cursor.execute("BEGIN TRANSACTION")
            try:
                yield cursor
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            commit(cursor)

    @contextmanager
    def snapshot(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor whose every query reads the ledger as one committed state.

        A statement is many queries (the GPU costs, the in-flight seconds that split them, the
        engines' counters); read one by one while batches commit in between, the shares of one
        state would be applied to the costs of another. One transaction makes them all read the
        state it began with; its temp tables go with it.
        """
        with self.reader() as cursor:
            cursor.execute("BEGIN TRANSACTION")
            try:
                yield cursor
            finally:
                cursor.execute("ROLLBACK")

    # -- ingest ---------------------------------------------------------------------------

    def ingest(
        self,
        body: str | bytes,
        now: float | None = None,
        skew_seconds: float = 300.0,
        max_records: int | None = None,
        writer: Writer | None = None,
    ) -> IngestResult:
        """Validate and keep one batch ``{"<kind>": [records...]}`` in one transaction.

        Raises ``BadRequest`` when the body itself is not a batch (the whole request is bad);
        a bad record only lands in ``rejected``, an untrusted one in ``quarantined``. ``writer``:
        whose credential sent it (None: trusted to write as anyone; the configuration is still
        checked).
        """
        raw = body.encode() if isinstance(body, str) else body
        # orjson keeps the last of two equal keys and DuckDB the first: a batch whose readers
        # could disagree on what it holds is refused whole, before either reads it.
        try:
            key = duplicate_key(raw)
        except NestedTooDeeplyError as exc:
            raise _not_a_batch(f"the body is {exc}") from None
        if key is not None:
            raise _not_a_batch(f"duplicate key {key!r} in a JSON object")
        kind, records = self._batch(raw, max_records)
        return self._commit(kind, typed_frame(kind, records), raw, now, skew_seconds, writer=writer)

    def announce(self) -> AbstractContextManager[Ticket[_Pending, IngestResult]]:
        """Say a batch is on its way, before its body has even arrived (``GroupCommit.announce``).

        The API does this when a request starts, so that a transaction about to start small
        waits briefly for batches that are still being received.
        """
        return self._group.announce()

    def ingest_lines(
        self,
        kind_key: str,
        body: bytes,
        now: float | None = None,
        skew_seconds: float = 300.0,
        max_records: int | None = None,
        ticket: Ticket[_Pending, IngestResult] | None = None,
        writer: Writer | None = None,
    ) -> IngestResult:
        """Validate and keep one NDJSON batch of ``kind_key`` records, one per line.

        A spool segment's lines as they are on disk (what a shipper sends when its lines do not
        convert to Arrow). Typed batches may share their transaction with others. A line that is not
        JSON is refused like any other bad record ("not valid JSON"), and the rest is kept.
        Raises ``BadRequest`` for an unknown kind.
        """
        kind = self._kind(kind_key)
        lines = line_count(body)
        _check_size(lines, max_records)
        with ExitStack() as stack:
            ticket = ticket or stack.enter_context(self._group.announce())
            frame = ndjson_frame(kind, body, lines)
            if frame is not None:
                batch = _Pending(kind, frame, None, frozenset(), now, skew_seconds, writer)
                return ticket.submit(batch, frame.height)
            texts, records, malformed, duplicates = _ndjson_records(body)
            # A line with a duplicate key is checked in DuckDB from its own text, which names it;
            # orjson's reading of it (the last value wins) is never used.
            frame = None if duplicates else typed_frame(kind, records)
            raw = None if frame is not None else _json_batch(kind, texts)
            batch = _Pending(kind, frame, raw, malformed, now, skew_seconds, writer)
            return ticket.submit(batch, frame.height if frame is not None else 1)

    def ingest_arrow(
        self,
        kind_key: str,
        body: bytes,
        now: float | None = None,
        skew_seconds: float = 300.0,
        max_records: int | None = None,
        ticket: Ticket[_Pending, IngestResult] | None = None,
        max_bytes: int | None = None,
        writer: Writer | None = None,
    ) -> IngestResult:
        """Keep one Arrow IPC batch of ``kind_key`` records (``infermeter.wire``), as shippers send.

        The columns are typed already, so only the range checks are left; the batch may share
        its transaction with others. Raises
        ``BadRequest`` when the stream is not the kind's schema (nothing is kept), and
        ``BatchTooLargeError`` when it holds more than ``max_records`` records or decodes to
        more than ``max_bytes``; both are read from the batches' headers
        (``infermeter.wire.arrow_extent``) before anything is decompressed.
        """
        kind = self._kind(kind_key)
        if max_records is not None or max_bytes is not None:
            _check_extent(body, max_records, max_bytes)
        with ExitStack() as stack:
            ticket = ticket or stack.enter_context(self._group.announce())
            frame = arrow_frame(kind, body)
            _check_size(frame.height, max_records)
            batch = _Pending(kind, frame, None, frozenset(), now, skew_seconds, writer)
            return ticket.submit(batch, frame.height)

    def _commit(
        self,
        kind: RecordKind,
        frame: pl.DataFrame | None,
        raw: bytes | None,
        now: float | None,
        skew: float,
        malformed: frozenset[int] = frozenset(),
        writer: Writer | None = None,
    ) -> IngestResult:
        """Keep a batch, typed ``frame`` (fast path) or ``raw`` JSON text, in a committed transaction.

        Batches on the fast path may share their transaction with others (group commit).
        ``malformed``: places of records that were not JSON at all (sent as null), so that
        their reason says so.
        """
        size = frame.height if frame is not None else 1
        return self._group.submit(_Pending(kind, frame, raw, malformed, now, skew, writer), size)

    def _run_group(self, group: Sequence[_Pending]) -> list[IngestResult | BaseException]:
        """Commit ``group`` (under the writer lock): fast-path batches of one kind together."""
        outcomes: dict[int, IngestResult | BaseException] = {}
        shared: dict[tuple[str, float | None, float], list[int]] = {}
        alone: list[list[int]] = []  # the per-record path: a transaction of its own
        for i, p in enumerate(group):
            if p.frame is None:
                alone.append([i])
            else:
                shared.setdefault((p.kind.key, p.now, p.skew), []).append(i)
        for members in [*shared.values(), *alone]:
            results: Sequence[IngestResult | BaseException]
            try:
                results = self._transaction([group[i] for i in members])
            except Exception as exc:
                results = [exc] * len(members)
            outcomes.update(zip(members, results, strict=True))
        return [outcomes[i] for i in range(len(group))]

    def _transaction(self, batches: Sequence[_Pending]) -> Sequence[IngestResult]:
        first = batches[0]
        now = time.time() if first.now is None else first.now
        frame = None
        if first.frame is not None:
            frames = [
                b.frame.with_columns(item=pl.lit(i, pl.Int32))
                for i, b in enumerate(batches)
                if b.frame is not None
            ]
            frame = pl.concat(frames) if len(frames) > 1 else frames[0]
            if len(frames) > 1:  # an id repeated across the batches is a repeat too
                frame = frame.with_columns(dup=~pl.col(first.kind.id_field).is_first_distinct())
        con, n = self._con, len(batches)
        con.execute("BEGIN TRANSACTION")
        try:
            try:
                quarantine.writers_table(con, [b.writer for b in batches])
                results, span = self._ingest(
                    con, first.kind, first.raw, frame, now, first.skew, first.malformed, n
                )
            except BaseException:
                con.execute("ROLLBACK")
                raise
            commit(con)
        finally:
            if frame is not None:
                con.unregister("_batch")
        self.ingest_transactions += 1
        self.ingest_records += sum(r.accepted for r in results)
        if span is not None:
            self.retouch(span)
        return results

    @property
    def waiting_batches(self) -> int:
        """Batches queued for the next ingest transaction."""
        return self._group.waiting

    def take_touched(self) -> tuple[float, float] | None:
        """The time span (Unix seconds) new records fell in since the last call, and forget it.

        Whoever keeps copies derived from the ledger (the dashboards' coarse rollups) asks, so
        that a record arriving long after its time still reaches them.
        """
        with self._touched_lock:
            span, self._touched = self._touched, None
        return span

    def retouch(self, span: tuple[float, float]) -> None:
        """Add ``span`` to the touched span (also: give back a span whose refresh failed)."""
        with self._touched_lock:
            old = self._touched
            self._touched = span if old is None else (min(old[0], span[0]), max(old[1], span[1]))

    def quarantine_lines(
        self,
        kind_key: str,
        lines: Sequence[Unopened],
        writer: Writer | None,
        now: float | None = None,
    ) -> list[Rejection]:
        """Keep lines that could not be opened as their writer's (``billing.writers``) in
        quarantine, in one transaction; each one's (id, reason). ``writer``: who sent them."""
        kind = self._kind(kind_key)
        now = time.time() if now is None else now
        principal = writer.principal if writer is not None else None
        with self._write_lock:
            con = self._con
            con.execute("BEGIN TRANSACTION")
            try:
                kept = quarantine.keep_unopened(con, kind, lines, principal, now)
            except BaseException:
                con.execute("ROLLBACK")
                raise
            commit(con)
        return [Rejection(rid, reason) for rid, reason in kept]

    def _kind(self, key: str) -> RecordKind:
        kind = self.kinds.get(key)
        if kind is None:
            raise _not_a_batch(f"unknown record kind {key!r}; one of: {', '.join(self.kinds)}")
        return kind

    def _batch(self, body: bytes, max_records: int | None) -> tuple[RecordKind, list[Any]]:
        """The batch's kind and records; BadRequest when the body is not a batch."""
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise _not_a_batch("the body is not valid JSON") from None
        if not isinstance(parsed, dict):
            raise _not_a_batch('the body must be a JSON object such as {"usage": [...]}')
        if len(parsed) != 1 or next(iter(parsed)) not in self.kinds:
            known = ", ".join(self.kinds)
            raise _not_a_batch(f"the body must have exactly one key, one of: {known}")
        key, records = next(iter(parsed.items()))
        if not isinstance(records, list):
            raise _not_a_batch(f"{key} must be a JSON array of records")
        _check_size(len(records), max_records)
        return self.kinds[key], records

    def _ingest(
        self,
        con: duckdb.DuckDBPyConnection,
        kind: RecordKind,
        raw: bytes | None,
        frame: pl.DataFrame | None,
        now: float,
        skew: float,
        malformed: frozenset[int],
        batches: int,
    ) -> tuple[list[IngestResult], tuple[float, float] | None]:
        """Keep ``batches`` batches (told apart by column ``item``) in the open transaction."""
        params = {"now": now, "skew": skew}
        totals = [0] * batches
        fleet = self.fleet is not None
        if kind.key == USAGE.key:
            self._refused_tags(con, frame, raw)
        if frame is not None:
            con.register("_batch", frame)
            source, checked = "_batch", ingest_sql.checked_sql(kind, "_batch", fleet)
            for item, n in frame.group_by("item").len().iter_rows():
                totals[item] = n
        else:
            assert raw is not None
            con.execute(ingest_sql.stage_sql(kind, fleet), {"body": raw.decode(), **params})
            row = con.execute("SELECT count(*) FROM staged").fetchone()
            source, checked, totals[0] = "staged", "staged", int(row[0]) if row else 0
        con.execute(ingest_sql.rejected_sql(kind, checked), params if frame is not None else None)
        rejected: list[list[Rejection]] = [[] for _ in range(batches)]
        quarantined: list[list[Rejection]] = [[] for _ in range(batches)]
        for item, pos, rid, reason, label in con.execute(
            "SELECT item, pos, id, reason, label FROM _rejected ORDER BY item, pos"
        ).fetchall():
            rid = str(rid) if rid is not None else f"#{pos}"
            if label is not None:
                quarantined[item].append(Rejection(rid, reason))
                continue
            rejected[item].append(Rejection(rid, "not valid JSON" if pos in malformed else reason))
        if any(quarantined):
            con.execute(trust_sql.quarantine_sql(kind), {"now": now})
        good = [t - len(r) - len(q) for t, r, q in zip(totals, rejected, quarantined, strict=True)]
        fresh = [0] * batches
        span = None
        if sum(good):
            refused = any(rejected) or any(quarantined)
            con.execute(ingest_sql.good_sql(kind, source, refused))
            idf = f'"{kind.id_field}"'
            lo, hi = con.execute(f"SELECT min({idf}), max({idf}) FROM _good").fetchone() or ("", "")
            con.execute(ingest_sql.known_sql(kind), {"lo": lo, "hi": hi})
            con.execute(ingest_sql.fresh_sql(kind))
            for item, n in con.execute("SELECT item, count(*) FROM fresh GROUP BY item").fetchall():
                fresh[item] = n
        if sum(fresh):
            if kind.key == "instances":  # heartbeats older than their retention are not kept raw
                con.execute(
                    ingest_sql.append_sql(kind, lifetimes.RAW_KEPT),
                    {"now": now, "old_before": now - HEARTBEAT_RETENTION_SECONDS},
                )
            else:
                con.execute(ingest_sql.append_sql(kind), {"now": now})
            row = con.execute(f"SELECT min(t), max(t) FROM ({_SPANS[kind.key]})").fetchone()
            assert row is not None
            assert row[0] is not None
            span = (float(row[0]), float(row[1]))
            self._roll_up(con, kind, span, now)
        results = [
            IngestResult(kind.key, f, g - f, r, q)
            for f, g, r, q in zip(fresh, good, rejected, quarantined, strict=True)
        ]
        return results, span

    def _refused_tags(
        self, con: duckdb.DuckDBPyConnection, frame: pl.DataFrame | None, raw: bytes | None
    ) -> None:
        """Judge the distinct tags of a transaction's usage records, for the trust checks."""
        if frame is not None:
            projects, users = quarantine.frame_tags(frame)
        else:
            assert raw is not None
            projects, users = quarantine.staged_tags(con, raw.decode())
        quarantine.tag_tables(con, *quarantine.refused_tags(self.projects, projects, users))

    def _roll_up(
        self,
        con: duckdb.DuckDBPyConnection,
        kind: RecordKind,
        span: tuple[float, float],
        now: float,
    ) -> None:
        if kind.key == "instances":
            self._refolding(con, True, lambda: self._fold_lifetimes(con, now))
            return
        if kind.key in ("gpu_samples", "engine_samples"):
            fold = lifetimes.sample_fold_sql(kind.table)
            self._refolding(con, False, lambda: con.execute(fold))
        if kind.key == "usage":
            con.execute(ingest_sql.usage_rollup_sql())
            con.execute(hourly.dirty_usage_sql())
            con.execute(ingest_sql.occupancy_rollup_sql())
            con.execute(ingest_sql.statement_rollup_sql())
            con.execute(ingest_sql.token_rollup_sql())
            con.execute(reconciliation_hours.mark_usage_sql())
            con.execute(ingest_sql.ttft_rollup_sql())
            con.execute(ingest_sql.tag_rollup_sql())
        elif kind.key == "gpu_samples":
            con.execute(ingest_sql.gpu_rollup_sql())
            con.execute(hourly.dirty_samples_sql())
        elif kind.key == "engine_samples":
            con.execute(reconciliation_hours.mark_samples_sql())
            con.execute(ingest_sql.engine_rollup_sql(), {"lo": span[0], "hi": span[1]})
            return
        else:
            return
        first, last = month_of(span[0]), month_of(span[1])
        if first == last:  # nearly every batch: no need to look at each record's month
            months = "SELECT $month AS m"
            params: dict[str, Any] = {"month": first}
        else:
            months = f"SELECT DISTINCT strftime(make_timestamp(CAST(t * 1000000 AS BIGINT)), '%Y-%m') AS m FROM ({_SPANS[kind.key]})"
            params = {}
        con.execute(f"INSERT INTO months (month) {months} ON CONFLICT DO NOTHING", params)
        con.execute(
            f"UPDATE months SET dirty = true WHERE closed_at IS NOT NULL AND month IN ({months})",
            params,
        )

    def _refolding(
        self, con: duckdb.DuckDBPyConnection, events: bool, fold: Callable[[], object]
    ) -> None:
        """Run ``fold`` (a change to ``lifetimes``) and mark dirty the hours whose GPU time it
        moved into or out of a lifetime (``billing.hourly.dirty_lifetimes_sql``)."""
        before = hourly.windows_sql(self.heartbeat_seconds, events)
        con.execute(f"CREATE OR REPLACE TEMP TABLE _lives_before AS {before}")
        fold()
        after = hourly.windows_sql(self.heartbeat_seconds, events, "_lives_before")
        con.execute(f"CREATE OR REPLACE TEMP TABLE _lives_after AS {after}")
        con.execute(hourly.dirty_lifetimes_sql("_lives_before", "_lives_after"))

    def _fold_lifetimes(self, con: duckdb.DuckDBPyConnection, now: float) -> None:
        """Fold the ``fresh`` instance events into ``lifetimes``; prune old heartbeats hourly."""
        con.execute(lifetimes.delta_sql(), {"old_before": now - HEARTBEAT_RETENTION_SECONDS})
        con.execute(lifetimes.fold_sql())
        _read_samples_again(con)
        # The hour boundary keeps this to one delete an hour, whatever the rate of batches.
        before = (now - HEARTBEAT_RETENTION_SECONDS) // HOUR_SECONDS * HOUR_SECONDS
        if before > self._pruned_before:
            con.execute(lifetimes.prune_sql(), {"before": before})
            self._pruned_before = before


# The times a kind's fresh records cover: a request from arrival to end, a sample its interval.
_SPANS = {
    "usage": "SELECT received_at AS t FROM fresh UNION ALL SELECT finished_at FROM fresh",
    "gpu_samples": 'SELECT "timestamp" - interval_seconds AS t FROM fresh UNION ALL SELECT "timestamp" FROM fresh',
    "engine_samples": 'SELECT "timestamp" AS t FROM fresh',
    "instances": 'SELECT "timestamp" AS t FROM fresh',
    "budget_overrides": "SELECT issued_at AS t FROM fresh",
    "scaling_decisions": "SELECT decided_at AS t FROM fresh",
}


def _check_size(records: int, max_records: int | None) -> None:
    if max_records is not None and records > max_records:
        raise BatchTooLargeError(
            f"{records} records in one batch; at most {max_records} (billing.max_batch_records)"
        )


def _check_extent(body: bytes, max_records: int | None, max_bytes: int | None) -> None:
    records, size = arrow_extent(body, max_records or sys.maxsize, max_bytes or sys.maxsize)
    _check_size(records, max_records)
    if max_bytes is not None and size > max_bytes:
        raise BatchTooLargeError(
            f"the Arrow stream decodes to more than {max_bytes} bytes (billing.max_body_bytes)"
        )


def _ndjson_records(body: bytes) -> tuple[list[bytes], list[Any], frozenset[int], bool]:
    """Each line's text and JSON value (``null`` and None where a line is not JSON), those lines'
    1-based places, and whether any line has a duplicate key.

    Lines are split at "\n" only, as ``line_count`` counts them; a blank line is not JSON.
    """
    lines = body.split(b"\n")
    if body.endswith(b"\n"):
        lines.pop()
    texts: list[bytes] = []
    records: list[Any] = []
    malformed = set()
    duplicates = False
    for pos, line in enumerate(lines, start=1):
        try:
            records.append(orjson.loads(line))
            texts.append(line)
            duplicates = duplicates or duplicate_key(line) is not None
        except NestedTooDeeplyError:
            # DuckDB reads it from its own text, and names what is wrong with the record.
            duplicates = True
        except orjson.JSONDecodeError:
            records.append(None)
            texts.append(b"null")
            malformed.add(pos)
    return texts, records, frozenset(malformed), duplicates


def _json_batch(kind: RecordKind, texts: Sequence[bytes]) -> bytes:
    """``{"<kind>": [records]}`` from each record's own JSON text, for the per-record path."""
    return b'{"' + kind.key.encode() + b'": [' + b",".join(texts) + b"]}"


def _not_a_batch(message: str) -> BadRequest:
    """The body is not a batch of the kind: the caller's to fix (HTTP 400)."""
    return BadRequest(message, code="invalid_value")


def commit(con: duckdb.DuckDBPyConnection) -> None:
    """COMMIT the transaction open on ``con``; LedgerUnavailableError when it cannot be written.

    DuckDB rolls back a COMMIT it could not write (a full disk: the WAL's write fails), so no
    ROLLBACK may follow: it would fail with "no transaction is active", and that error, a 500,
    would stand for the full disk, where the caller is owed a 503 to retry and the reason.
    """
    try:
        con.execute("COMMIT")
    except duckdb.Error as exc:
        raise LedgerUnavailableError(f"the ledger could not commit: {exc}") from exc


def migrate(
    con: duckdb.DuckDBPyConnection, source: str, kinds: Iterable[RecordKind] = KINDS.values()
) -> int:
    """Apply the migrations ``con`` lacks, then add fields new to ``kinds``; returns the version."""
    con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER, applied_at DOUBLE)")
    row = con.execute("SELECT max(version) FROM schema_version").fetchone()
    current = int(row[0]) if row and row[0] is not None else 0
    if current > LATEST_VERSION:
        raise LedgerError(
            f"{source}: ledger schema version {current} is newer than this infermeter "
            f"understands ({LATEST_VERSION}); upgrade infermeter"
        )
    for version in range(current + 1, LATEST_VERSION + 1):
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute(MIGRATIONS[version - 1])
            backfill = _BACKFILLS.get(version)
            if backfill is not None:
                # The raw rows are read with every field they have today, so fields first.
                _add_new_fields(con, kinds)
                for statement in backfill:
                    con.execute(statement)
            con.execute("INSERT INTO schema_version VALUES (?, ?)", [version, time.time()])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    _add_new_fields(con, kinds)
    return LATEST_VERSION


# Rollups that a migration fills from the raw rows once, with the SQL ingest keeps them by.
_BACKFILLS: Final[Mapping[int, tuple[str, ...]]] = {
    # (usage_hours and usage_edges are rebuilt and filled by migration 9.)
    6: (
        "CREATE OR REPLACE TEMP VIEW fresh AS SELECT * FROM engine_samples",
        ingest_sql.engine_rollup_sql(bounded=False),
        "DROP VIEW fresh",
    ),
    7: (
        "CREATE OR REPLACE TEMP VIEW fresh AS SELECT * FROM instance_events",
        lifetimes.delta_sql(old_before="'-infinity'::DOUBLE"),  # every kept event counts
        lifetimes.fold_sql(),
        lifetimes.touched_sql(),
        lifetimes.seen_sql(since="'-infinity'::DOUBLE"),
        "DROP VIEW fresh",
    ),
    9: (
        "CREATE OR REPLACE TEMP VIEW fresh AS SELECT * FROM usage",
        ingest_sql.token_rollup_sql(),
        "DROP VIEW fresh",
    ),
    USAGE_TAGS_VERSION: (
        "CREATE OR REPLACE TEMP VIEW fresh AS SELECT * FROM usage",
        ingest_sql.tag_rollup_sql(),
        "DROP VIEW fresh",
    ),
}


def _read_samples_again(con: duckdb.DuckDBPyConnection) -> None:
    """Read the samples of the lifetimes ``lifetimes.touched_sql`` picks from the raw rows.

    The scan starts at the earliest of their last events, as a constant, so DuckDB skips every
    row group of samples before it.
    """
    con.execute(lifetimes.touched_sql())
    row = con.execute("SELECT min(last_seen) FROM _touched").fetchone()
    if row is not None and row[0] is not None:
        con.execute(lifetimes.seen_sql(), {"since": row[0]})


def _add_new_fields(con: duckdb.DuckDBPyConnection, kinds: Iterable[RecordKind]) -> None:
    """Add to each kind's table the fields declared since the table was made."""
    for kind in kinds:
        columns = [
            r[0]
            for r in con.execute(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = ? AND schema_name = 'main'",
                [kind.table],
            ).fetchall()
        ]
        for statement in new_field_sql(kind, columns):
            con.execute(statement)
