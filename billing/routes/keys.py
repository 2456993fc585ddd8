"""Keys issued at run time: ``/v1/keys`` to issue, list, rotate and revoke them; the sidecars' copy.

The admin manages every key; a team's lead manages its own team's member keys; nobody else
manages any (finance reads every statement but issues no key). A secret is in the answer that
issues it and nowhere else: the ledger keeps its digest. ``GET /v1/keys/active`` is the set in
force for the sidecars (the admin or the spend_reader role), with its version as the ETag, so an
unchanged set costs a 304.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from billing.keys import KeyNotFoundError
from billing.routes.body import read_body
from billing.routes.dependencies import Asker, KeyReader, ServicesDep
from billing.routes.openapi import READ, errors
from billing.routes.responses import json_response
from infermeter.errors import BadRequest
from infermeter.key_set_seal import SIGNER_HEADER
from infermeter.keys import IssuedKey

__all__ = ["router"]

router = APIRouter()

_MAX_BODY = 16 * 1024
KeyId = Annotated[str, Path(pattern=r"^[a-z0-9]{12}$")]


class KeyRequest(BaseModel):
    """What a new key is for (every field optional but ``team`` for a team's key)."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field("member", description="member, lead, finance, viewer or spend_reader")
    team: str | None = None
    member: str | None = None
    project: str | None = None
    expires_at: float | None = None
    expires_in_seconds: float | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    budget_usd_per_month: float | None = None
    reason: str = ""


class Change(BaseModel):
    """Why a key is revoked or rotated, and how long a rotated key keeps working."""

    model_config = ConfigDict(extra="forbid")

    reason: str = ""
    grace_seconds: float = 0.0


_EXTRA_KEY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": KeyRequest.model_json_schema()}},
    }
}
_EXTRA_CHANGE = {
    "requestBody": {
        "required": False,
        "content": {"application/json": {"schema": Change.model_json_schema()}},
    }
}


async def _json(request: Request, required: bool) -> dict[str, Any]:
    """The body's JSON object (``{}`` when optional and empty); BadRequest for anything else."""
    raw = await read_body(request, _MAX_BODY, 30.0)
    if not raw.strip() and not required:
        return {}
    try:
        found = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("the body is not JSON", code="invalid_value") from None
    if not isinstance(found, dict):
        raise BadRequest("the body is not a JSON object", code="invalid_value")
    return found


def _shown(key: IssuedKey) -> dict[str, Any]:
    """A key as the API shows it: every field but the digest."""
    return {k: v for k, v in key.to_json().items() if k != "digest"}


def _address(request: Request) -> str | None:
    return request.client.host if request.client else None


@router.post(
    "/v1/keys", status_code=201, responses=errors(400, *READ, 503), openapi_extra=_EXTRA_KEY
)
async def create(who: Asker, request: Request, svc: ServicesDep) -> Response:
    """Issue a key: the answer's ``key`` is the secret, shown this once."""
    body = await _json(request, required=True)
    issued, secret = await run_in_threadpool(svc.keys.create, body, who, _address(request))
    return _created(_shown(issued) | {"key": secret})


@router.get("/v1/keys", responses=errors(*READ))
async def listing(who: Asker, svc: ServicesDep, revoked: bool = False) -> dict[str, Any]:
    """The keys the caller manages (the admin every one, a lead its team's); never a secret."""
    keys = await run_in_threadpool(svc.keys.listing, who, revoked)
    return {"keys": [_shown(k) for k in keys]}


@router.post(
    "/v1/keys/{key_id}/revoke", responses=errors(400, *READ, 404, 503), openapi_extra=_EXTRA_CHANGE
)
async def revoke(key_id: KeyId, who: Asker, request: Request, svc: ServicesDep) -> dict[str, Any]:
    """Revoke a key now: every sidecar refuses it within the propagation bound."""
    body = await _json(request, required=False)
    change = _change(body)
    try:
        gone = await run_in_threadpool(
            svc.keys.revoke, key_id, who, _address(request), change.reason
        )
    except KeyNotFoundError as exc:
        raise _not_found(exc) from None
    return _shown(gone)


@router.post(
    "/v1/keys/{key_id}/rotate",
    status_code=201,
    responses=errors(400, *READ, 404, 503),
    openapi_extra=_EXTRA_CHANGE,
)
async def rotate(key_id: KeyId, who: Asker, request: Request, svc: ServicesDep) -> Response:
    """A new key in place of ``key_id`` (its secret shown once); the old one is revoked, or
    works on for ``grace_seconds``."""
    change = _change(await _json(request, required=False))
    try:
        fresh, secret = await run_in_threadpool(
            svc.keys.rotate, key_id, who, _address(request), change.reason, change.grace_seconds
        )
    except KeyNotFoundError as exc:
        raise _not_found(exc) from None
    return _created(_shown(fresh) | {"key": secret})


_NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {"description": "The caller's version is current."}
}


@router.get("/v1/keys/active", responses=_NOT_MODIFIED | errors(401, 403))
async def active(
    _: KeyReader,
    svc: ServicesDep,
    if_none_match: Annotated[str | None, Header()] = None,
    since: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    """The keys in force, with their digests and limits, for the sidecars; ETag: the version.

    With the set also in Redis, ``x-infermeter-key-signer`` names the public key it is signed
    with: the sidecars learn it here, from billing, and take from Redis only what verifies.
    """
    issued = svc.keys.issued
    tag = f'"{issued.version}"'
    headers = {"etag": tag}
    publisher = svc.keys.publisher
    if publisher is not None:
        headers[SIGNER_HEADER] = publisher.signer_hex
    if if_none_match == tag or since == issued.version:
        return Response(status_code=304, headers=headers)
    return json_response(issued.to_json(), headers=headers)


def _created(body: dict[str, Any]) -> Response:
    # The secret is in this answer only: no cache may keep it.
    return Response(
        orjson.dumps(body),
        status_code=201,
        media_type="application/json",
        headers={"cache-control": "no-store"},
    )


def _change(body: dict[str, Any]) -> Change:
    """The body as a key change, strictly (``"10"`` is not a number of seconds); BadRequest
    naming the first field at fault, in one line."""
    try:
        return Change.model_validate(body, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"] if first["type"] != "extra_forbidden" else "unknown field"
        raise BadRequest(
            f"{param}: {message}" if param else f"not a key change: {message}",
            param=param,
            code="invalid_value",
        ) from None


def _not_found(exc: KeyNotFoundError) -> Exception:
    return HTTPException(404, str(exc))
