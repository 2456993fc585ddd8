"""The DuckDB ledger: the one module that opens database connections.

One process owns the file (DuckDB allows a single writer), and every read and write goes
through a ``Ledger``. The few connections that are not the service's ledger (a backup being
restored, a scratch database for allocation over frames) are opened here too (``connect``), so
a reader looking for what can hold a ledger file open reads one module;
``tests/test_architecture.py`` fails on a ``duckdb.connect`` anywhere else. Writes are serialised by a lock, each ingest batch is one transaction,
and a batch is acknowledged only after its transaction commits, so a batch that was
acknowledged survives a crash and a batch that was not is simply resent by its shipper.
Reads use their own cursors and run beside the writer.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

import duckdb
import orjson
import polars as pl

from billing import (
    allocation,
    audit,
    bases,
    hourly,
    ingest_sql,
    invoice_store,
    lifetimes,
    quarantine,
    reconciliation,
    trust_sql,
)
from billing.allocation import Allocation, Policy
from billing.bounds import SampleBounds, bounds_tables
from billing.fastpath import arrow_frame, ndjson_frame, typed_frame
from billing.fleet import asked_sql
from billing.group_commit import GroupCommit, Ticket
from billing.invoice_store import Stored
from billing.invoices import Invoice
from billing.jsonkeys import NestedTooDeeplyError, duplicate_key
from billing.lifetimes import (
    COLUMNS as LIFETIME_COLUMNS,
    DEFAULT_HEARTBEAT_SECONDS,
    HEARTBEAT_RETENTION_SECONDS,
    GroupCaps,
    LiveBound,
    Restart,
    lifetimes_sql,
    live_counts_sql,
    slot_windows_sql,
)
from billing.quarantine import KnownFleet, Unopened
from billing.schema import (
    HOUR_SECONDS,
    LATEST_VERSION,
    MIGRATIONS,
    SLOT_SECONDS,
    USAGE_TAGS_VERSION,
    new_field_sql,
)
from infermeter.audit import AuditEvent
from infermeter.errors import BadRequest
from infermeter.months import month_bounds, month_of
from infermeter.records import KINDS, RecordKind
from infermeter.statement import POOL_SCHEMA, empty_pools
from infermeter.wire import arrow_extent, line_count
from infermeter.writers import Writer

__all__ = [
    "BatchTooLargeError",
    "IngestResult",
    "Ledger",
    "LedgerError",
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


class LedgerError(Exception):
    """The ledger file cannot be used (newer schema, unreadable, or a refused operation)."""


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
    ) -> None:
        self._con = con
        # What a sample may physically claim (``billing.bounds``); the defaults without one.
        self.bounds = bounds or SampleBounds()
        # The configuration's models, groups and nodes, for the trust checks (``billing.trust_sql``);
        # None (a ledger opened by a tool): only teams are checked.
        self.fleet = fleet
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
        return cls(con, teams, ttft_sla_seconds, kinds, heartbeat_seconds, fleet, bounds)

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
    ) -> None:
        """Adopt a new team list, SLA targets and fleet (after a config reload)."""
        with self._write_lock:
            self.fleet = fleet if fleet is not None else self.fleet
            self.teams = list(teams)
            self.ttft_sla = dict(ttft_sla_seconds)
            self._set_teams(self.teams)

    @contextmanager
    def reader(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor for reading, usable from any thread while the writer works."""
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
            cursor.execute("COMMIT")

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
        con = self._con
        con.execute("BEGIN TRANSACTION")
        try:
            quarantine.writers_table(con, [b.writer for b in batches])
            results, span = self._ingest(
                con, first.kind, first.raw, frame, now, first.skew, first.malformed, len(batches)
            )
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
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
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        return [Rejection(rid, reason) for rid, reason in kept]

    def quarantined(self, start: float, end: float) -> pl.DataFrame:
        """Records quarantined for ``start``..``end``, per kind and reason (``QUARANTINED_SCHEMA``)."""
        with self.reader() as cur:
            return quarantine.summary(cur, start, end)

    def quarantine_counts(self) -> list[tuple[str, str, int]]:
        """Every record ever quarantined, per (kind, reason category), for /metrics."""
        with self.reader() as cur:
            return quarantine.counts(cur)

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
            con.execute(ingest_sql.good_sql(kind, source))
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
            con.execute(ingest_sql.ttft_rollup_sql())
            con.execute(ingest_sql.tag_rollup_sql())
        elif kind.key == "gpu_samples":
            con.execute(ingest_sql.gpu_rollup_sql())
            con.execute(hourly.dirty_samples_sql())
        elif kind.key == "engine_samples":
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

    # -- months ---------------------------------------------------------------------------

    def months(self) -> list[dict[str, Any]]:
        """Every month the ledger has data for, with whether it is closed."""
        with self.reader() as cur:
            rows = cur.execute(
                "SELECT month, closed_at, dirty FROM months ORDER BY month"
            ).fetchall()
        return [
            {"month": m, "closed": c is not None, "closed_at": c, "late_records": d}
            for m, c, d in rows
        ]

    def month_state(self, month: str) -> tuple[bool, bool]:
        """(closed, has late records) for ``month``; an unknown month is open and clean."""
        with self.reader() as cur:
            row = cur.execute(
                "SELECT closed_at, dirty FROM months WHERE month = ?", [month]
            ).fetchone()
        return (False, False) if row is None else (row[0] is not None, bool(row[1]))

    def dirty_closed_months(self, before: str) -> list[str]:
        """Closed months before ``before`` that received records after they were closed."""
        with self.reader() as cur:
            rows = cur.execute(
                "SELECT month FROM months WHERE closed_at IS NOT NULL AND dirty AND month < ? ORDER BY month",
                [before],
            ).fetchall()
        return [r[0] for r in rows]

    # -- invoices -------------------------------------------------------------------------

    def import_invoice(
        self, invoice: Invoice, now: float | None = None, events: Sequence[AuditEvent] = ()
    ) -> Stored:
        """Keep ``invoice``'s totals per (month, pool), and ``events`` on the audit trail, in one
        transaction (``billing.invoice_store``: the same file again changes nothing; a closed
        month whose rows change is marked dirty)."""
        now = time.time() if now is None else now
        with self.writing() as cur:
            stored = invoice_store.store(cur, invoice, now)
            audit.append(cur, events, now)
        return stored

    def invoices(self, month: str) -> dict[str, int]:
        """``month``'s invoiced cost per node pool, in whole cents (pools with no invoice absent)."""
        with self.reader() as cur:
            return invoice_store.by_pool(cur, month)

    def invoice_rows(self, month: str | None = None) -> list[dict[str, Any]]:
        """The invoice rows in force, of ``month`` or all (``invoice_store.COLUMNS``)."""
        with self.reader() as cur:
            return invoice_store.listing(cur, month)

    def invoice_imports(self) -> list[dict[str, Any]]:
        """Each imported file with rows in force: months, pools, cents, items; newest first."""
        with self.reader() as cur:
            return invoice_store.imports(cur)

    def issued_lines(self, month: str | None = None, for_month: str | None = None) -> pl.DataFrame:
        """Frozen statement lines, by the statement they are on and/or the month they charge."""
        where, params = [], []
        if month is not None:
            where.append("month = ?")
            params.append(month)
        if for_month is not None:
            where.append("for_month = ?")
            params.append(for_month)
        sql = "SELECT * FROM statement_lines" + (" WHERE " + " AND ".join(where) if where else "")
        with self.reader() as cur:
            return _frame(cur, sql + " ORDER BY month, for_month, team, model", params)

    def issued_basis(self, month: str) -> tuple[str, pl.DataFrame]:
        """A closed month's basis and node pools, as frozen with it (``list`` and none if it was
        closed before bases were kept)."""
        with self.reader() as cur:
            row = cur.execute(
                "SELECT basis, pools FROM statement_bases WHERE month = ?", [month]
            ).fetchone()
        if row is None:
            return "list", empty_pools()
        rows = orjson.loads(row[1])
        return str(row[0]), pl.DataFrame(rows, schema=POOL_SCHEMA) if rows else empty_pools()

    def freeze(
        self,
        month: str,
        lines: pl.DataFrame,
        adjusted: Sequence[str],
        now: float,
        basis: str = "list",
        pools: pl.DataFrame | None = None,
    ) -> None:
        """Close ``month``: store its statement lines, basis and node pools, and clear the late
        flag of ``adjusted``."""
        with self._write_lock:
            con = self._con
            con.execute("BEGIN TRANSACTION")
            try:
                row = con.execute(
                    "SELECT closed_at FROM months WHERE month = ?", [month]
                ).fetchone()
                if row is not None and row[0] is not None:
                    raise LedgerError(f"month {month} is already closed")
                con.execute("INSERT INTO months (month) VALUES (?) ON CONFLICT DO NOTHING", [month])
                con.register("_lines", lines)
                con.execute(
                    "INSERT INTO statement_lines SELECT month, for_month, team, model, requests, "
                    "prompt_tokens, completion_tokens, gpu_hours, energy_kwh, compute_cents, "
                    "energy_cents, idle_cents, total_cents FROM _lines"
                )
                con.unregister("_lines")
                frozen = orjson.dumps([] if pools is None else pools.to_dicts()).decode()
                con.execute("INSERT INTO statement_bases VALUES (?, ?, ?)", [month, basis, frozen])
                con.execute(
                    "UPDATE months SET closed_at = ?, dirty = false WHERE month = ?", [now, month]
                )
                if adjusted:
                    con.execute(
                        "UPDATE months SET dirty = false WHERE list_contains(?, month)",
                        [list(adjusted)],
                    )
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise

    # -- reads for allocation -----------------------------------------------------------

    def allocate(self, policy: Policy, month: str) -> tuple[pl.DataFrame, int]:
        """``month``'s allocation lines (money in micro-cents) and fleet cost, from the rollups.

        Tokens the engines counted and no record carries are lines of their own, costed out of
        the idle capacity (``billing.reconciliation``). Read in one snapshot: the lines add up
        to the fleet cost while batches keep arriving.
        """
        claims = reconciliation.claims(policy, *month_bounds(month))
        with self.snapshot() as cur:
            return allocation.run(cur, self._month_sql(cur, policy, month), policy, claims)

    def allocate_bases(
        self,
        policy: Policy,
        month: str,
        invoices: Mapping[str, int],
        split_by_instance: bool = False,
    ) -> tuple[Allocation, Allocation | None]:
        """``month``'s allocation at list prices and, when ``invoices`` (pool -> cents) covers a
        pool, at the allocation basis (``billing.bases``): both read in one snapshot, so the
        scale is worked out from exactly the GPU time it then divides. With
        ``split_by_instance``, the basis the lines are on carries its lines per instance
        (``Allocation.instances``), from the same run."""
        claims = reconciliation.claims(policy, *month_bounds(month))
        with self.snapshot() as cur:
            listed = allocation.run_all(
                cur,
                self._month_sql(cur, policy, month),
                policy,
                claims,
                split_by_instance and not invoices,
            )
            listed = replace(listed, reconciled=claims.reconciled)
            if not invoices:
                return listed, None
            scaled_policy = bases.scaled_policy(policy, listed.pools, listed.commitments, invoices)
            scaled = allocation.run_all(
                cur,
                self._month_sql(cur, scaled_policy, month),
                scaled_policy,
                claims,
                split_by_instance,
            )
            return listed, bases.with_unmeasured(scaled, listed, invoices, policy.platform_account)

    def by_instance(
        self, policy: Policy, month: str, invoices: Mapping[str, int] | None = None
    ) -> pl.DataFrame:
        """``month``'s lines per instance, in micro-cents (``billing.allocation.by_instance``),
        at the allocation basis when ``invoices`` covers a pool."""
        with self.snapshot() as cur:
            queries = self._month_sql(cur, policy, month)
            if invoices:
                use, held = allocation.pool_use(cur, queries, policy)
                policy = bases.scaled_policy(policy, use, held, invoices)
                queries = self._month_sql(cur, policy, month)
            return allocation.by_instance(cur, queries, policy)

    def _month_sql(
        self, cur: duckdb.DuckDBPyConnection, policy: Policy, month: str
    ) -> allocation.AllocationSql:
        """``month``'s allocation queries over its hourly cost rows (``billing.hourly``).

        The clean hours' rows are the ledger's; the hours still marked dirty in this snapshot
        (a batch committed since the last rebuild) are built here, into temp tables, from the
        same rollups, so a statement never reads a stale hour.
        """
        lo, hi = _slot_range(month)
        h0, h1 = lo // hourly.HOUR_SLOTS, hi // hourly.HOUR_SLOTS
        in_month = f"hour >= {h0} AND hour < {h1}"
        built = cur.execute("SELECT heartbeat_seconds FROM hours_built").fetchall()
        if built and float(built[0][0]) == self.heartbeat_seconds:
            stale = f"SELECT hour FROM hours_dirty WHERE {in_month}"
            fresh = "hour IN (SELECT hour FROM hours_dirty)"
        else:  # rows built under another heartbeat, or none built yet: every hour is stale
            stale = f"SELECT DISTINCT slot // {hourly.HOUR_SLOTS} FROM gpu_slots WHERE slot >= {lo} AND slot < {hi}"
            fresh = "true"
        dirty = [int(h) for (h,) in cur.execute(stale).fetchall()]
        cur.execute("CREATE OR REPLACE TEMP TABLE _fresh_costs AS SELECT * FROM cost_hours LIMIT 0")
        cur.execute(
            "CREATE OR REPLACE TEMP TABLE _fresh_shares AS SELECT * FROM share_hours LIMIT 0"
        )
        for first, after in hourly.runs(dirty, hourly.REBUILD_HOURS):
            self._build_hours(cur, first, after, "_fresh_costs", "_fresh_shares")
        rows = hourly.HourRows(
            f"(SELECT * FROM cost_hours WHERE {in_month} AND NOT {fresh} UNION ALL BY NAME SELECT * FROM _fresh_costs)",
            f"(SELECT * FROM share_hours WHERE {in_month} AND NOT {fresh} UNION ALL BY NAME SELECT * FROM _fresh_shares)",
            "alloc_keys",
            f"(SELECT * FROM alloc_hours WHERE {in_month})",
        )
        return allocation.priced_sql_of(policy, rows, period=month_bounds(month))

    def _build_hours(
        self, cur: duckdb.DuckDBPyConnection, first: int, after: int, costs: str, shares: str
    ) -> None:
        """Append the hourly cost rows of hours ``first``..``after`` to ``costs`` and ``shares``."""
        lo, hi = first * hourly.HOUR_SLOTS, after * hourly.HOUR_SLOTS
        within = f"slot >= {lo} AND slot < {hi}"
        # Materialised once: the rebuild reads the windows for every GPU row.
        windows = slot_windows_sql(lo, hi, self.heartbeat_seconds)
        cur.execute(f"CREATE OR REPLACE TEMP TABLE _lifetimes AS SELECT * FROM {windows}")
        # No lifetime in the range (a fleet of fixed replicas): nothing to bound, and the check
        # of every GPU minute against them is skipped.
        known = bool(cur.execute("SELECT 1 FROM _lifetimes LIMIT 1").fetchall())
        cur.execute(
            hourly.minutes_sql(
                f"(SELECT * FROM gpu_slots WHERE {within})",
                f"(SELECT replica, instance, slot, inflight_seconds AS occupied FROM replica_slots WHERE {within})",
                "alloc_units",
                "_lifetimes" if known else None,
                (lo, hi),
            )
        )
        cur.execute(f"INSERT INTO {costs} BY NAME {hourly.cost_rows_sql()}")
        slots = f"(SELECT * FROM alloc_slots WHERE {within})"
        cur.execute(f"INSERT INTO {shares} BY NAME {hourly.share_rows_sql(slots, (lo, hi))}")

    def mark_all_hours_dirty(self) -> None:
        """Mark every hour with GPU time for a rebuild (after a change the marks cannot see)."""
        with self.writing() as cur:
            cur.execute(hourly.DIRTY_ALL)

    def refresh_hours(self) -> int:
        """Rebuild the hourly cost rows of the hours marked dirty; how many hours were rebuilt.

        A run of hours at a time, each in a transaction of its own (``writing``): ingest waits
        for one run, never for a whole backlog. A change of ``heartbeat_seconds`` moves every
        lifetime's end, so it marks every hour dirty first.
        """
        with self.writing() as cur:
            built = cur.execute("SELECT heartbeat_seconds FROM hours_built").fetchall()
            if not built or float(built[0][0]) != self.heartbeat_seconds:
                cur.execute(hourly.DIRTY_ALL)
                cur.execute("DELETE FROM hours_built")
                cur.execute("INSERT INTO hours_built VALUES (?)", [self.heartbeat_seconds])
            dirty = [int(h) for (h,) in cur.execute("SELECT hour FROM hours_dirty").fetchall()]
        for first, after in hourly.runs(dirty, hourly.REBUILD_HOURS):
            with self.writing() as cur:
                span = f"hour >= {first} AND hour < {after}"
                cur.execute(f"DELETE FROM cost_hours WHERE {span}")
                cur.execute(f"DELETE FROM share_hours WHERE {span}")
                self._build_hours(cur, first, after, "cost_hours", "share_hours")
                cur.execute(f"DELETE FROM hours_dirty WHERE {span}")
        return len(dirty)

    def live_instances(
        self,
        now: float,
        heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
        bound: LiveBound | None = None,
    ) -> list[tuple[str, str, int]]:
        """(replica group, model, live instances), for /metrics; within ``bound`` when given."""
        with self.reader() as cur:
            caps = _caps(cur, bound, now)
            sql, params = live_counts_sql(now, heartbeat_seconds, self.restart, caps)
            return [(str(r), str(m), int(n)) for r, m, n in cur.execute(sql, params).fetchall()]

    def lifetimes(
        self,
        now: float,
        heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
        state: Literal["live", "all"] = "all",
        replica: str | None = None,
        limit: int | None = None,
        bound: LiveBound | None = None,
    ) -> list[dict[str, Any]]:
        """Instance lifetimes as ``billing.lifetimes`` defines them, one dict per lifetime.

        ``bound``: the live ones are at most what the configuration allows (``LiveBound``).
        """
        with self.reader() as cur:
            caps = _caps(cur, bound, now) if state == "live" else None
            sql, params = lifetimes_sql(
                now, heartbeat_seconds, state, replica, limit, self.restart, caps
            )
            rows = cur.execute(sql, params).fetchall()
        return [dict(zip(LIFETIME_COLUMNS, row, strict=True)) for row in rows]

    def reconciliation(self, start: float, end: float) -> pl.DataFrame:
        """Engine counters against the ledger per instance, for the hours ``start``..``end`` touches.

        One row per instance and hour, as ``billing.reconciliation.reconciliation_sql`` says.
        """
        with self.reader() as cur:
            table = reconciliation.reconcile(cur, *reconciliation.hours(start, end))
            return _frame(cur, f"SELECT * FROM {table}", [])

    def latest_month(self) -> str:
        """The newest month with data, or the current month."""
        with self.reader() as cur:
            row = cur.execute("SELECT max(month) FROM months").fetchone()
        return row[0] if row and row[0] else month_of(time.time())

    def table_names(self) -> list[str]:
        """The ledger's own tables (not temporary ones)."""
        with self.reader() as cur:
            rows = cur.execute(
                "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' AND NOT temporary "
                "ORDER BY table_name"
            ).fetchall()
        return [r[0] for r in rows]

    def export_table(self, table: str, directory: str | Path, partitioned: bool = False) -> Path:
        """Write ``table`` to Parquet under ``directory``; returns the path written.

        With ``partitioned``, raw tables are written Hive-style by month
        (``usage/month=2026-11/...``), so an engine reading object storage opens only the
        months it needs.
        """
        if table not in self.table_names():
            raise LedgerError(f"no table {table!r} in the ledger")
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        time_col = _TIME_COLUMNS.get(table)
        with self.reader() as cur:
            if partitioned and time_col:
                target = out / table
                month = f"strftime(make_timestamp(CAST({time_col} * 1000000 AS BIGINT)), '%Y-%m')"
                cur.execute(
                    f"COPY (SELECT *, {month} AS month FROM {table}) TO '{_sql_path(target)}' "
                    "(FORMAT parquet, PARTITION_BY (month), OVERWRITE_OR_IGNORE)"
                )
            else:
                target = out / f"{table}.parquet"
                cur.execute(f"COPY {table} TO '{_sql_path(target)}' (FORMAT parquet)")
        return target

    def export_parquet(self, directory: str | Path, partitioned: bool = False) -> list[Path]:
        """Write every table to Parquet under ``directory``; returns the paths written."""
        return [self.export_table(t, directory, partitioned) for t in self.table_names()]

    # -- the Parquet archive (``billing.archive``) ----------------------------------------

    def archive_runs(self) -> set[tuple[str, str]]:
        """(run, table) of every retention run the ledger has completed."""
        with self.reader() as cur:
            rows = cur.execute("SELECT run_id, kind FROM archive_runs").fetchall()
        return {(str(r), str(k)) for r, k in rows}

    def archive_horizons(self) -> dict[str, float]:
        """Per raw table, the time before which its rows are in the archive."""
        with self.reader() as cur:
            rows = cur.execute(
                "SELECT kind, max(horizon) FROM archive_runs GROUP BY kind"
            ).fetchall()
        return {str(k): float(h) for k, h in rows}

    def archived_files(self) -> dict[str, list[str]]:
        """Per raw table, the archive's files that hold its rows that left the ledger."""
        with self.reader() as cur:
            rows = cur.execute(
                "SELECT f.kind, r.root || '/' || f.path FROM archive_files f "
                "JOIN archive_runs r USING (run_id, kind) ORDER BY f.path"
            ).fetchall()
        files: dict[str, list[str]] = {}
        for kind, path in rows:
            files.setdefault(str(kind), []).append(str(path))
        return files


# The times a kind's fresh records cover: a request from arrival to end, a sample its interval.
_SPANS = {
    "usage": "SELECT received_at AS t FROM fresh UNION ALL SELECT finished_at FROM fresh",
    "gpu_samples": 'SELECT "timestamp" - interval_seconds AS t FROM fresh UNION ALL SELECT "timestamp" FROM fresh',
    "engine_samples": 'SELECT "timestamp" AS t FROM fresh',
    "instances": 'SELECT "timestamp" AS t FROM fresh',
    "budget_overrides": "SELECT issued_at AS t FROM fresh",
    "scaling_decisions": "SELECT decided_at AS t FROM fresh",
}
# A raw table's time column, for partitioning its Parquet export by month.
_TIME_COLUMNS = {k.table: f'"{k.time_field}"' for k in KINDS.values()}


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


def _frame(
    cur: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] | Mapping[str, Any]
) -> pl.DataFrame:
    """A query's result as a Polars frame (through Arrow, without copying row by row)."""
    frame: pl.DataFrame = cur.sql(sql, params=params).pl()
    return frame


def _sql_path(path: Path) -> str:
    return str(path).replace("'", "''")


def _caps(cur: duckdb.DuckDBPyConnection, bound: LiveBound | None, now: float) -> GroupCaps | None:
    """``bound``'s caps, given what the autoscaler asked for lately; None without a bound."""
    if bound is None:
        return None
    sql, params = asked_sql(now - bound.asked_seconds)
    return bound.caps({str(m): int(n) for m, n in cur.execute(sql, params).fetchall()})


def _slot_range(month: str) -> tuple[int, int]:
    start, end = month_bounds(month)
    return int(start // SLOT_SECONDS), int(end // SLOT_SECONDS)


def _not_a_batch(message: str) -> BadRequest:
    """The body is not a batch of the kind: the caller's to fix (HTTP 400)."""
    return BadRequest(message, code="invalid_value")


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
