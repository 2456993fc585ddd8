"""``GET /v1/query/{name}``: the dashboards' read API over the ledger's rollups.

The billing service owns the DuckDB file, so the dashboards read through it, with the caller's
own credential: the admin key sees every team; a team key is held to its own team (asking for
another is 403) and may not read fleet-wide telemetry (GPUs, engines), which spans every team.
Answers are ``{"columns": [...], "rows": [[...], ...]}`` plus the range actually served.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, Query
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from billing import queries
from billing.access import Caller, Forbidden, identify
from billing.ledger import Ledger
from infermeter.config import Config
from sidecar.auth import KeyRing

__all__ = ["query_router", "scope"]


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


def query_router(ledger: Ledger, ring: KeyRing, config: Config) -> APIRouter:
    """The query routes over ``ledger``, authorising callers against ``ring``."""
    router = APIRouter()
    teams = [t.name for t in config.teams]

    @router.get("/v1/query")
    async def index(authorization: Annotated[str | None, Header()] = None) -> dict[str, Any]:
        """The queries there are, and who the caller is (the dashboard's sign-in check)."""
        who = identify(ring, authorization)
        if not (who.is_admin or who.team is not None):
            raise Forbidden("this credential may not read the ledger")
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
        end = time.time() if end is None else end
        start = end - 3600 if start is None else start
        params = queries.params_from(start, end, step, scope(who, spec, team), model)
        frame = await run_in_threadpool(_run, ledger, name, params)
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


def _json(body: Any) -> Response:
    # NaN (an empty mean) becomes null, which JSON clients can read.
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
    )


def _run(ledger: Ledger, name: str, params: queries.QueryParams) -> Any:
    with ledger.reader() as cursor:
        return queries.run(cursor, name, params)
