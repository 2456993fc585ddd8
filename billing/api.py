"""The billing service's HTTP API (FastAPI): ingest, statements, spend, exports, /metrics.

Handlers are thin: they identify the caller, run the ledger or chargeback call in a worker
thread (DuckDB blocks), and shape the answer. Errors are OpenAI-style JSON, like the sidecar's,
so the same clients can read both.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated, Any

import duckdb
import orjson
from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.concurrency import run_in_threadpool

from billing.access import (
    ADMIN,
    INGEST,
    METRICS,
    Caller,
    Forbidden,
    Unauthenticated,
    identify,
    keyring,
)
from billing.chargeback import Chargeback
from billing.ledger import BatchTooLargeError, IngestResult, Ledger, LedgerError
from billing.metrics import LedgerCollector, SpendCollector
from billing.query_api import CachedChargeback, query_router, refresh_if_stale, statement_json
from exporters.chargeback_csv import chargeback_frame, write_csv
from exporters.focus import focus_frame
from infermeter.config import Config
from infermeter.months import check_month, month_of
from infermeter.wire import ARROW_STREAM

__all__ = ["create_app"]

log = logging.getLogger("infermeter.billing")


def _error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


def _ingested(result: IngestResult) -> Response:
    if result.rejected:
        log.warning("ingest: %d %s record(s) rejected, first: %s", len(result.rejected),
                    result.kind, result.rejected[0].reason)  # fmt: skip
    return _json(result.to_json())


def create_app(config: Config, ledger: Ledger) -> FastAPI:
    """The API over ``ledger``; the caller owns (opens and closes) the ledger."""
    app = FastAPI(title="infermeter billing", version="1", docs_url=None, redoc_url=None)
    ring = keyring(config)
    chargeback = Chargeback(ledger, config)
    # Exports and /v1/chargeback compute statements afresh; /metrics and the dashboards' query
    # routes share one cache, so a scrape does not recompute the month.
    statements = CachedChargeback(ledger, config)
    budgets = {t.name: t.budget_usd_per_month for t in config.teams}
    registry = CollectorRegistry()
    registry.register(SpendCollector(statements))
    registry.register(LedgerCollector(ledger))
    records = Counter("infermeter_billing_ingest_records", "Records received by ingest, by outcome.",
                      ["kind", "outcome"], registry=registry)  # fmt: skip
    batches = Counter("infermeter_billing_ingest_batches", "Batches acknowledged by ingest, by wire format.",
                      ["kind", "format"], registry=registry)  # fmt: skip

    def ingested(result: IngestResult, wire_format: str) -> Response:
        batches.labels(result.kind, wire_format).inc()
        records.labels(result.kind, "accepted").inc(result.accepted)
        records.labels(result.kind, "duplicate").inc(result.duplicates)
        records.labels(result.kind, "rejected").inc(len(result.rejected))
        return _ingested(result)

    app.state.ledger = ledger
    app.state.chargeback = chargeback

    def caller(authorization: str | None) -> Caller:
        return identify(ring, authorization)

    @app.exception_handler(Unauthenticated)
    async def _unauthenticated(_: Request, exc: Unauthenticated) -> JSONResponse:
        return _error(401, str(exc), "invalid_request_error", "invalid_api_key")

    @app.exception_handler(Forbidden)
    async def _forbidden(_: Request, exc: Forbidden) -> JSONResponse:
        return _error(403, str(exc), "permission_error", "forbidden")

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error", "invalid_value")

    @app.exception_handler(LedgerError)
    async def _refused(_: Request, exc: LedgerError) -> JSONResponse:
        return _error(409, str(exc), "invalid_request_error", "conflict")

    @app.exception_handler(duckdb.IOException)
    async def _io(_: Request, exc: duckdb.IOException) -> JSONResponse:
        log.error("ledger write failed: %s", exc)
        return _error(503, "the ledger cannot be written (disk full or unavailable); retry later",
                      "server_error", "ledger_unavailable")  # fmt: skip

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        await run_in_threadpool(ledger.months)
        return {"status": "ready"}

    @app.post("/v1/ingest")
    async def ingest(
        request: Request, authorization: Annotated[str | None, Header()] = None
    ) -> Response:
        """Keep a batch of usage records or samples; answer only after it is committed."""
        caller(authorization).require(INGEST)
        body = await request.body()
        limit = config.billing.max_batch_records
        try:
            result = await run_in_threadpool(
                ledger.ingest, body, None, config.billing.max_clock_skew_seconds, limit
            )
        except BatchTooLargeError as exc:
            return _error(413, str(exc), "invalid_request_error", "batch_too_large")
        return ingested(result, "json")

    @app.post("/v1/ingest/{kind}")
    async def ingest_batch(
        kind: str,
        request: Request,
        authorization: Annotated[str | None, Header()] = None,
        content_type: Annotated[str | None, Header()] = None,
    ) -> Response:
        """Keep a batch of ``kind`` records as shippers send it: an Arrow IPC stream, or NDJSON.

        Same answer as ``/v1/ingest``. NDJSON is checked record by record when it must be (a
        line that is not JSON is one rejected record); an Arrow stream whose schema is not the
        kind's is refused whole (400).
        """
        caller(authorization).require(INGEST)
        arrow = (content_type or "").split(";")[0].strip().lower() == ARROW_STREAM
        keep = ledger.ingest_arrow if arrow else ledger.ingest_lines
        limit = config.billing.max_batch_records
        # Announced before the body arrives: a transaction about to start small waits briefly
        # for batches still on the wire (group commit), which matters when many shippers send
        # small batches at once.
        with ledger.announce() as ticket:
            body = await request.body()
            try:
                result = await run_in_threadpool(
                    keep, kind, body, None, config.billing.max_clock_skew_seconds, limit, ticket
                )
            except BatchTooLargeError as exc:
                return _error(413, str(exc), "invalid_request_error", "batch_too_large")
        return ingested(result, "arrow" if arrow else "ndjson")

    @app.get("/v1/months")
    async def months(authorization: Annotated[str | None, Header()] = None) -> list[dict[str, Any]]:
        caller(authorization).require(ADMIN)
        return await run_in_threadpool(ledger.months)

    @app.post("/v1/months/{month}/close")
    async def close(
        month: str, authorization: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        """Freeze a month's statement (admin)."""
        caller(authorization).require(ADMIN)
        statement = await run_in_threadpool(chargeback.close, check_month(month))
        await run_in_threadpool(statements.recompute, month)
        return statement_json(statement, None)

    @app.get("/v1/chargeback/{month}.csv")
    async def chargeback_csv(
        month: str, authorization: Annotated[str | None, Header()] = None
    ) -> Response:
        """The chargeback CSV (admin)."""
        caller(authorization).require(ADMIN)
        statement = await run_in_threadpool(chargeback.statement, check_month(month))
        return _download(write_csv(chargeback_frame(statement, budgets)), f"chargeback-{month}.csv")

    @app.get("/v1/chargeback/{month}.focus.csv")
    async def chargeback_focus(month: str, version: Annotated[str, Query(pattern=r"^1\.[02]$")] = "1.0",
                               authorization: Annotated[str | None, Header()] = None) -> Response:  # fmt: skip
        """The FinOps FOCUS file (admin)."""
        caller(authorization).require(ADMIN)
        statement = await run_in_threadpool(chargeback.statement, check_month(month))
        text = write_csv(focus_frame(statement, config, version))
        return _download(text, f"focus-{version}-{month}.csv")

    @app.get("/v1/chargeback/{month}")
    async def chargeback_json(
        month: str, authorization: Annotated[str | None, Header()] = None
    ) -> Response:
        """A month's statement: every line for the admin, a team's own lines for a team."""
        who = caller(authorization)
        if who.team is None:
            who.require(ADMIN)
        statement = await run_in_threadpool(chargeback.statement, check_month(month))
        return _json(statement_json(statement, who.team))

    @app.get("/v1/spend")
    async def spend(authorization: Annotated[str | None, Header()] = None) -> list[dict[str, Any]]:
        """Month-to-date spend, budget and forecast: every team for the admin, its own for a team."""
        who = caller(authorization)
        if who.team is None:
            who.require(ADMIN)
        rows = await run_in_threadpool(chargeback.spend)
        return [vars_of(s) for s in rows if who.is_admin or s.team == who.team]

    @app.post("/v1/admin/export")
    async def export(
        partitioned: bool = False, authorization: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        """Write the whole ledger to Parquet under ``billing.export_dir`` (admin)."""
        caller(authorization).require(ADMIN)
        target = Path(config.billing.export_dir) / time.strftime(
            "ledger-%Y%m%dT%H%M%SZ", time.gmtime()
        )
        paths = await run_in_threadpool(ledger.export_parquet, target, partitioned)
        return {"directory": str(target), "tables": [p.name for p in paths]}

    @app.get("/metrics")
    async def metrics(authorization: Annotated[str | None, Header()] = None) -> Response:
        caller(authorization).require(ADMIN, METRICS)
        body = await run_in_threadpool(generate_latest, registry)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8",
                                 background=refresh_if_stale(statements, month_of(time.time())))  # fmt: skip

    app.include_router(query_router(ledger, ring, config, statements=statements))
    return app


def vars_of(obj: Any) -> dict[str, Any]:
    """A slotted dataclass as a dict."""
    return {name: getattr(obj, name) for name in obj.__slots__}


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _download(text: str, filename: str) -> Response:
    return Response(text, media_type="text/csv; charset=utf-8",
                    headers={"content-disposition": f'attachment; filename="{filename}"'})  # fmt: skip
