"""``GET /v1/query/{name}``: the dashboards' read API over the ledger's rollups.

The billing service owns the DuckDB file, so the dashboards read through it, with the caller's
own credential: the admin key sees every team; a team key is held to its own team (asking for
another is 403) and may not read fleet-wide telemetry (GPUs, engines), which spans every team;
the metrics credential may read what monitoring watches (the reconciliation), and nothing else.
Answers are ``{"columns": [...], "rows": [[...], ...]}`` plus the range actually served.
Statements and spend are served from the statement cache, which a scrape of ``/metrics`` shares.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from billing import archive, queries
from billing.ledger import Ledger
from billing.rollups import Rollups
from billing.routes.dependencies import Asker, Month, Reader, ServicesDep, compute
from billing.routes.errors import error_response
from billing.routes.openapi import READ, errors
from billing.routes.overrides import with_overrides
from billing.routes.responses import json_response, lifetime_headers, spend_rows
from infermeter.auth import SCRAPERS, Caller, Forbidden
from infermeter.errors import BadRequest
from infermeter.statement import statement_json

__all__ = ["router", "scope"]

router = APIRouter()


def scope(caller: Caller, query: queries.Query, team: str | None) -> str | None:
    """The team filter ``caller`` gets for ``query`` when it asks for ``team``.

    A reader of every team (admin, finance, viewer) gets what it asks for (None: every team); the
    metrics role, a query open to scrapers, over every team. A team always gets its own team;
    Forbidden when it asks for another, for a fleet-wide query, or when the caller is another
    role (metrics, ingest, spend_reader).
    """
    if caller.reads_all:
        return team
    if query.scrapers and caller.name in SCRAPERS:
        return None
    own = caller.team
    if own is None:
        raise Forbidden("this credential may not read the ledger")
    if not query.per_team:
        raise Forbidden("fleet-wide telemetry is for the admin credential")
    if team is not None and team != own:
        caller.require_team(team)
    return own


@router.get("/v1/query/statement/{month}", responses=errors(400, *READ))
async def statement(who: Reader, month: Month, svc: ServicesDep) -> Response:
    """A month's statement (as ``/v1/chargeback/{month}``), reused within the cache's lifetime.

    ``as_of`` says when the ledger was read; it is never older than ``billing.statement_ttl_seconds``.
    """
    entry = await compute(svc, svc.statements.cached, month)
    body = statement_json(entry.statement, who.team) | {"as_of": entry.as_of}
    return json_response(body, lifetime_headers(entry, time.time()))


@router.get("/v1/query/spend", responses=errors(*READ))
async def spend(who: Reader, svc: ServicesDep) -> Response:
    """Month-to-date spend, budget and forecast (as ``/v1/spend``), from the cached statement,
    with each team's last budget override (``override``, as ``/v1/spend`` has it)."""
    entry = await compute(svc, svc.statements.current)
    body = await with_overrides(svc, spend_rows(entry, svc.config, who.scope))
    return json_response(body, lifetime_headers(entry, time.time()))


@router.get("/v1/query", responses=errors(*READ))
async def index(who: Reader, svc: ServicesDep) -> dict[str, Any]:
    """The queries there are, and who the caller is (the dashboard's sign-in check), with when
    its key expires (``expires_at``, Unix seconds; None: a key that does not, or an ID token),
    so the dashboard's session ends then."""
    visible = [t.name for t in svc.config.teams] if who.reads_all else [who.team]
    issued = svc.keys.issued.by_id.get(who.key_id) if who.key_id is not None else None
    caller = {
        "name": who.name,
        "team": who.team,
        "is_admin": who.is_admin,
        "reads_all": who.reads_all,
        "role": who.role,
        "who": who.who,
        "expires_at": issued.expires_at if issued is not None else None,
    }
    return {
        "caller": caller,
        "teams": visible,
        "queries": {
            name: q.doc for name, q in queries.QUERIES.items() if who.reads_all or q.per_team
        },
    }


@router.get("/v1/query/{name}", responses=errors(400, 404, *READ))
async def query(
    name: str,
    who: Asker,
    svc: ServicesDep,
    start: Annotated[float | None, Query(alias="from")] = None,
    end: Annotated[float | None, Query(alias="to")] = None,
    step: Annotated[int | None, Query()] = None,
    team: Annotated[str | None, Query()] = None,
    model: Annotated[str | None, Query()] = None,
) -> Response:
    """Run query ``name`` over ``from``..``to`` (Unix seconds; default: the last hour)."""
    spec = queries.QUERIES.get(name)
    if spec is None:
        known = ", ".join(queries.QUERIES)
        return error_response(
            404,
            f"no query {name!r}; known: {known}",
            "invalid_request_error",
            "unknown_query",
            "name",
        )
    now = time.time()
    end = now if end is None else end
    start = end - 3600 if start is None else start
    scoped = scope(who, spec, team)
    try:
        params = queries.params_from(start, end, step, scoped, model, svc.rollups.coverage())
    except ValueError as exc:  # params_from names the bad range or step
        raise BadRequest(str(exc), code="invalid_value") from None
    frame = await run_in_threadpool(_run, svc.ledger, svc.rollups, name, params, now)
    return json_response(
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


def _run(
    ledger: Ledger, rollups: Rollups, name: str, params: queries.QueryParams, now: float
) -> Any:
    rollups.refresh_if_due(now)
    # Raw rows that left for the archive too, from the files of the range's months only (a day
    # earlier: reconciliation reads two hours back, and a request lasts up to a day).
    with archive.reader(ledger, (params.start - 86_400, params.end)) as cursor:
        return queries.run(cursor, name, params)
