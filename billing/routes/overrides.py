"""``POST /v1/admin/budget-overrides``: the admin lets a team past its budget, at billing.

The same body and bounds as the sidecar's route (``infermeter.overrides.parse_override``). The
override is kept in the ledger (``budget_overrides``, ``issued_by`` ``billing:<who>``) with its
event on the audit trail, and every sidecar takes it with its next spend read (``GET /v1/spend``
carries it on the team's row), with or without Redis. ``minutes`` 0 revokes: the team's last
grant then has ended, and ends every grant made before it, at billing or at a sidecar.
The admin only: a team key, the spend_reader and any writer credential are refused.
"""

from __future__ import annotations

import ipaddress
import time
from typing import Any, Final

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from billing import overrides
from billing.routes.body import read_body
from billing.routes.dependencies import Manager, Services, ServicesDep
from billing.routes.openapi import READ, errors
from infermeter.audit import audit_event
from infermeter.errors import BadRequest
from infermeter.overrides import OVERRIDE_FIELDS, Override, override_field, parse_override
from infermeter.records import MAX_OVERRIDE_REASON, BudgetOverride

__all__ = ["router", "with_overrides"]

router = APIRouter()

# An override's body is three short fields; the sidecar's route takes at most 64 KiB too.
_MAX_BODY: Final = 64 * 1024
_EXTRA: Final = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": list(OVERRIDE_FIELDS),
                    "properties": {
                        "team": {"type": "string"},
                        "minutes": {"type": "number", "minimum": 0, "maximum": 44640},
                        "reason": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_OVERRIDE_REASON,
                        },
                    },
                }
            }
        },
    }
}


def _forwarded_for(value: str | None) -> dict[str, str]:
    """``{"forwarded_for": address}``: the client address a sidecar (or a proxy in front of
    billing) says the admin's request came from, when the header holds one valid IP address.

    It is what the caller says, kept beside ``address`` (the peer billing saw), never in its
    place: a sidecar passing a grant on holds the admin's credential, not proof of where the
    admin was. A header of anything else is left out, not kept as text."""
    first = (value or "").split(",")[0].strip()
    try:
        return {"forwarded_for": str(ipaddress.ip_address(first))}
    except ValueError:
        return {}


def _shown(override: Override, record: BudgetOverride) -> dict[str, Any]:
    """The answer: the override as the sidecar's route shows it, with its id and issuer."""
    return {
        "team": override.team,
        "until": override.until,
        "reason": override.reason,
        "granted_at": override.granted_at,
        "override_id": record.override_id,
        "issued_by": record.issued_by,
    }


@router.post(
    "/v1/admin/budget-overrides",
    status_code=201,
    responses=errors(400, *READ, 503),
    openapi_extra=_EXTRA,
)
async def grant(who: Manager, request: Request, svc: ServicesDep) -> Response:
    """Let a team past its budget for ``minutes`` (admin), or revoke its override (``minutes``
    0): every sidecar within one spend refresh, the last grant deciding wherever the earlier
    ones were made. On the audit trail as ``budget.override`` (a revocation's ``until`` is its
    own time)."""
    raw = await read_body(request, _MAX_BODY, 30.0)
    now = time.time()
    teams = frozenset(t.name for t in svc.config.teams)
    try:
        override = parse_override(raw, teams, now)
    except ValueError as exc:
        raise BadRequest(
            str(exc), param=override_field(str(exc)), code="invalid_override"
        ) from None
    issued_by = overrides.issuer(who.who)
    event = audit_event(
        "budget.override",
        who.who,
        who.role,
        "billing",
        target=f"team:{override.team}",
        detail={"until": override.until, "issued_by": issued_by}
        | _forwarded_for(request.headers.get("x-forwarded-for")),
        why=override.reason,
        address=request.client.host if request.client else None,
        at=now,
    )
    record = await run_in_threadpool(overrides.grant, svc.ledger, override, issued_by, event, now)
    return Response(orjson.dumps(_shown(override, record)), 201, media_type="application/json")


def _last_grants(svc: Services, now: float) -> dict[str, dict[str, Any]]:
    with svc.ledger.reader() as cur:
        return overrides.last_grants(cur, now)


async def with_overrides(svc: Services, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Spend ``rows``, each team's with its last ``override`` (``billing.overrides.last_grants``),
    if any: read from the ledger at each ask, so that a grant or a revocation is in the next
    answer. A key the rows had before is never changed, so a sidecar of the previous version
    reads the answer as it did (and takes no ended override: it checks the end)."""
    grants = await run_in_threadpool(_last_grants, svc, time.time())
    return [
        row | {"override": grants[row["team"]]} if row["team"] in grants else row for row in rows
    ]
