"""``GET /v1/query/{name}``: the dashboards' read API over the ledger's rollups.

The billing service owns the DuckDB file, so the dashboards read through it, with the caller's
own credential: the admin key sees every team; a team key is held to its own team (asking for
another is 403) and may not read fleet-wide telemetry (GPUs, engines), which spans every team.
Answers are ``{"columns": [...], "rows": [[...], ...]}`` plus the range actually served.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Annotated, Any

import duckdb
import orjson
import polars as pl
from fastapi import APIRouter, Header, Query
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from billing import queries
from billing.access import Caller, Forbidden, identify
from billing.chargeback import Chargeback
from billing.ledger import Ledger
from billing.statement import Statement
from infermeter.auth import KeyRing
from infermeter.config import Config
from infermeter.months import check_month, month_of

__all__ = [
    "CachedChargeback",
    "Rollups",
    "query_router",
    "refresh_if_stale",
    "scope",
    "statement_json",
]

log = logging.getLogger("infermeter.billing")


def scope(caller: Caller, query: queries.Query, team: str | None) -> str | None:
    """The team filter ``caller`` gets for ``query`` when it asks for ``team``.

    The admin gets what it asks for (None: every team). A team always gets its own team;
    Forbidden when it asks for another, for a fleet-wide query, or when the caller is another
    role (metrics, ingest).
    """
    if caller.is_admin:
        return team
    own = caller.team
    if own is None:
        raise Forbidden("this credential may not read the ledger")
    if not query.per_team:
        raise Forbidden("fleet-wide telemetry is for the admin credential")
    if team is not None and team != own:
        caller.require_team(team)
    return own


class Rollups:
    """The coarse copies of the minute rollups (see ``billing.queries``) and what they cover.

    Built from the whole ledger the first time, then every ``interval_seconds`` the periods that
    ended in the last ``reroll_minutes`` are recomputed, so records that arrive a little late are
    included; only periods that ended ``settle_seconds`` ago are copied. The 5-minute copy keeps
    ``keep_5m_days`` days (ranges that use it span at most ``MAX_POINTS`` x 5 minutes). Refreshes
    run inside a query (one at a time; a query that finds one running does not wait) and
    cost tens of milliseconds; the first, over the whole ledger, runs when the router is made.
    """

    def __init__(self, ledger: Ledger, interval_seconds: float = 60.0, settle_seconds: float = 120.0,
                 reroll_minutes: int = 180, keep_5m_days: int = 3) -> None:  # fmt: skip
        self._ledger = ledger
        self._interval = interval_seconds
        self._settle = settle_seconds
        self._reroll = reroll_minutes
        self._keep_5m = keep_5m_days * 1440
        self._lock = threading.Lock()
        self._running = threading.Lock()
        self._spans: dict[tuple[str, int], tuple[int, int]] = {}
        self._last = float("-inf")

    def coverage(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(table, period) -> [first, after-last) slots each coarse copy holds now."""
        with self._lock:
            return dict(self._spans)

    def refresh_if_due(self, now: float) -> None:
        """Refresh when ``interval_seconds`` have passed, unless another caller is refreshing."""
        if now - self._last < self._interval or not self._running.acquire(blocking=False):
            return
        try:
            self._last = now
            self._refresh(now)
        except duckdb.Error as exc:  # the copies stay as they were; answers stay right
            log.warning("dashboard rollups not refreshed: %s", exc)
        finally:
            self._running.release()

    def refresh(self, now: float) -> None:
        """Bring every coarse copy up to the periods that ended ``settle_seconds`` before ``now``."""
        with self._running:
            self._last = now
            self._refresh(now)

    def _refresh(self, now: float) -> None:
        # Records that arrived since the last refresh, however old their time: their periods
        # are recomputed too, not only the last ``reroll_minutes``.
        touched = self._ledger.take_touched()
        try:
            with self._ledger.reader() as cur:
                for statement in queries.rollup_setup_sql():
                    cur.execute(statement)
                for name, copy in queries.COPIES.items():
                    first_row = cur.execute(copy.first).fetchone()
                    if first_row is None or first_row[0] is None:
                        continue
                    for period in queries.PERIODS:
                        self._refresh_one(cur, name, period, int(first_row[0]), now, touched)
        except BaseException:
            if touched is not None:
                self._ledger.retouch(touched)
            raise

    def _refresh_one(self, cur: duckdb.DuckDBPyConnection, name: str, period: int,
                     first: int, now: float, touched: tuple[float, float] | None = None) -> None:  # fmt: skip
        done = int((now - self._settle) // 60) // period * period
        old = self.coverage().get((name, period))
        start = first // period * period
        if period < max(queries.PERIODS):
            start = max(start, (done - self._keep_5m) // period * period)
        lo = start if old is None else max(start, (old[1] - self._reroll) // period * period)
        if touched is not None and old is not None:
            lo = min(lo, max(start, int(touched[0] // 60) // period * period))
        if lo >= done:
            return
        cur.execute("BEGIN TRANSACTION")
        try:
            for statement in queries.rollup_sql(name, period, lo, done):
                cur.execute(statement)
            # Rows below the new start are dropped a day late: a query that read the old
            # coverage a moment ago may still be reading them.
            cur.execute(queries.trim_sql(name, period, start - 1440))
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        with self._lock:
            self._spans[(name, period)] = (start, done)


class CachedChargeback(Chargeback):
    """Statements reused for ``ttl_seconds``, so pages that refresh often do not recompute them.

    A statement is computed from a month of minute rollups, which takes seconds on a large
    ledger; the teams and chargeback pages ask for it on every refresh. A fresh entry is served
    as is; a stale one is served too, and recomputed after the response (``stale`` says so);
    only a month never computed is computed while the caller waits. ``spend`` reads the same
    cached statement of the current month.
    """

    def __init__(self, ledger: Ledger, config: Config, ttl_seconds: float = 300.0) -> None:
        super().__init__(ledger, config)
        self._ttl = ttl_seconds
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, Statement]] = {}
        self._computing: set[str] = set()

    def statement(self, month: str) -> Statement:
        """The cached statement of ``month`` (computed now if there is none)."""
        with self._lock:
            entry = self._entries.get(month)
        return entry[1] if entry is not None else self.recompute(month)

    def stale(self, month: str, now: float) -> bool:
        """True when ``month``'s entry is older than the TTL and nobody is recomputing it."""
        with self._lock:
            entry = self._entries.get(month)
            return (
                entry is not None and now - entry[0] >= self._ttl and month not in self._computing
            )

    def recompute(self, month: str) -> Statement:
        """Compute ``month``'s statement from the ledger and keep it."""
        with self._lock:
            self._computing.add(month)
        try:
            started = time.monotonic()
            statement = super().statement(month)
            with self._lock:
                self._entries[month] = (started, statement)
            return statement
        finally:
            with self._lock:
                self._computing.discard(month)


def statement_json(statement: Statement, team: str | None) -> dict[str, Any]:
    """A statement as billing's chargeback API answers it: a team gets only its own lines."""
    lines = statement.lines if team is None else statement.lines.filter(pl.col("team") == team)
    body: dict[str, Any] = {
        "month": statement.month,
        "closed": statement.closed,
        "lines": lines.to_dicts(),
        "total_cents": int(lines["total_cents"].sum()) if lines.height else 0,
    }
    if team is None:
        body |= {"fleet_cents": statement.fleet_cents, "adjustment_cents": statement.adjustment_cents,
                 "reconciles": statement.reconciles}  # fmt: skip
    return body


def query_router(ledger: Ledger, ring: KeyRing, config: Config, rollups: Rollups | None = None,
                 statements: CachedChargeback | None = None) -> APIRouter:  # fmt: skip
    """The query routes over ``ledger``, authorising callers against ``ring``."""
    router = APIRouter()
    if rollups is None:
        rollups = Rollups(ledger)
        rollups.refresh(time.time())
    teams = [t.name for t in config.teams]
    cache = statements or CachedChargeback(ledger, config)

    def reader(authorization: str | None) -> Caller:
        who = identify(ring, authorization)
        if not (who.is_admin or who.team is not None):
            raise Forbidden("this credential may not read the ledger")
        return who

    @router.get("/v1/query/statement/{month}")
    async def statement(
        month: str, authorization: Annotated[str | None, Header()] = None
    ) -> Response:
        """A month's statement (as ``/v1/chargeback/{month}``), reused for a few minutes."""
        who = reader(authorization)
        check_month(month)
        body = statement_json(await run_in_threadpool(cache.statement, month), who.team)
        return _json(body, refresh_if_stale(cache, month))

    @router.get("/v1/query/spend")
    async def spend(authorization: Annotated[str | None, Header()] = None) -> Response:
        """Month-to-date spend, budget and forecast (as ``/v1/spend``), from the cached statement."""
        who = reader(authorization)
        now = time.time()
        rows = await run_in_threadpool(cache.spend, now)
        body = [_vars(s) for s in rows if who.is_admin or s.team == who.team]
        return _json(body, refresh_if_stale(cache, month_of(now)))

    @router.get("/v1/query")
    async def index(authorization: Annotated[str | None, Header()] = None) -> dict[str, Any]:
        """The queries there are, and who the caller is (the dashboard's sign-in check)."""
        who = reader(authorization)
        visible = teams if who.is_admin else [who.team]
        return {
            "caller": {"name": who.name, "team": who.team, "is_admin": who.is_admin},
            "teams": visible,
            "queries": {
                name: q.doc for name, q in queries.QUERIES.items() if who.is_admin or q.per_team
            },
        }

    @router.get("/v1/query/{name}")
    async def query(
        name: str,
        start: Annotated[float | None, Query(alias="from")] = None,
        end: Annotated[float | None, Query(alias="to")] = None,
        step: Annotated[int | None, Query()] = None,
        team: Annotated[str | None, Query()] = None,
        model: Annotated[str | None, Query()] = None,
        authorization: Annotated[str | None, Header()] = None,
    ) -> Response:
        """Run query ``name`` over ``from``..``to`` (Unix seconds; default: the last hour)."""
        who = identify(ring, authorization)
        spec = queries.QUERIES.get(name)
        if spec is None:
            known = ", ".join(queries.QUERIES)
            body = {"message": f"no query {name!r}; known: {known}", "type": "invalid_request_error",
                    "param": "name", "code": "unknown_query"}  # fmt: skip
            return JSONResponse({"error": body}, status_code=404)
        now = time.time()
        end = now if end is None else end
        start = end - 3600 if start is None else start
        params = queries.params_from(
            start, end, step, scope(who, spec, team), model, rollups.coverage()
        )
        frame = await run_in_threadpool(_run, ledger, rollups, name, params, now)
        return _json(
            {
                "name": name,
                "from": params.start,
                "to": params.end,
                "step": params.step,
                "team": params.team,
                "model": params.model,
                "columns": frame.columns,
                "rows": frame.rows(),
            }
        )

    return router


def _json(body: Any, background: BackgroundTask | None = None) -> Response:
    # NaN (an empty mean) becomes null, which JSON clients can read.
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
                    media_type="application/json", background=background)  # fmt: skip


def refresh_if_stale(cache: CachedChargeback, month: str) -> BackgroundTask | None:
    """Recompute a stale statement after the response is sent (the server waits for it on exit)."""
    if not cache.stale(month, time.monotonic()):
        return None
    return BackgroundTask(run_in_threadpool, cache.recompute, month)


def _vars(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


def _run(ledger: Ledger, rollups: Rollups, name: str, params: queries.QueryParams,
         now: float) -> Any:  # fmt: skip
    rollups.refresh_if_due(now)
    with ledger.reader() as cursor:
        return queries.run(cursor, name, params)
