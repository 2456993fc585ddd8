"""What the routes share: the service's objects on ``app.state``, the caller and its role.

A route names who may call it in its signature (``Manager``, ``Closer``, ``AllReader``,
``Spender``, ``KeyReader``, ``Auditor``, ``Scraper``, ``Ingester``, ``Reader``, ``Asker``), from
the one role model of ``infermeter.auth``; identifying the caller, checking its role and, for the
reading roles, taking one of its read tokens happen before the handler runs, and their failures
(401, 403, 429) are mapped once, in ``billing.routes.errors``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from anyio import CapacityLimiter, to_thread
from fastapi import Depends, Header, Path, Request
from prometheus_client import CollectorRegistry

from billing.chargeback import Chargeback
from billing.explorer_cache import Months
from billing.federation_store import MonthDigests
from billing.keys import KeyBook
from billing.ledger import Ledger
from billing.metrics import IngestCounters
from billing.ratelimit import ReadLimiter
from billing.rollups import Rollups
from billing.statement_cache import CachedChargeback
from billing.writers import WriterGate
from infermeter.auth import (
    AUDITORS,
    CLOSERS,
    INGESTERS,
    KEY_READERS,
    MANAGERS,
    READ_ALL,
    SCRAPERS,
    AuthError,
    Caller,
    Forbidden,
    Unauthenticated,
    identify,
)
from infermeter.config import Config
from infermeter.errors import BadRequest
from infermeter.months import MONTH_PATTERN, check_month
from infermeter.oidc import IdTokens, Unmapped, looks_like_jwt

T = TypeVar("T")

__all__ = [
    "AllReader",
    "Asker",
    "Auditor",
    "Closer",
    "Ingester",
    "KeyReader",
    "Manager",
    "Month",
    "Reader",
    "Scraper",
    "Services",
    "ServicesDep",
    "Spender",
    "Who",
    "compute",
]


@dataclass(frozen=True, slots=True)
class Services:
    """The objects every route may use, built once by ``create_app``."""

    config: Config
    ledger: Ledger
    # The configured keys and, beside them, the keys issued at run time (``keys``).
    keys: KeyBook
    # Closing uses ``chargeback``; every statement and spend answer goes through ``statements``
    # (the files, spend, /metrics and the query routes from its cache, at most one dashboard
    # refresh old; /v1/chargeback/{month} computed afresh), shared by concurrent asks.
    chargeback: Chargeback
    statements: CachedChargeback
    rollups: Rollups
    # The allocation explorer's months, made from ``statements``' entries.
    explorer: Months
    registry: CollectorRegistry
    ingest_counters: IngestCounters
    reads: ReadLimiter
    # Statement computations run on these threads only (``compute``), not on ingest's.
    computing: CapacityLimiter
    # Who may ingest: writer credentials and, if allowed, the shared ingest token.
    writers: WriterGate
    # People signed in with single sign-on (``dashboard.oidc``): None when it is off.
    id_tokens: IdTokens | None = None
    # The digests of the closed months a central lists (``billing.federation_store``).
    digests: MonthDigests = field(default_factory=MonthDigests)


async def compute(svc: Services, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a statement thread (``Services.computing``), not on ingest's."""
    return await to_thread.run_sync(fn, *args, limiter=svc.computing)


def services(request: Request) -> Services:
    """The app's ``Services`` (``app.state.services``)."""
    found: Services = request.app.state.services
    return found


ServicesDep = Annotated[Services, Depends(services)]


def caller(
    request: Request, svc: ServicesDep, authorization: Annotated[str | None, Header()] = None
) -> Caller:
    """The identified caller; Unauthenticated (401) when the credential is missing or unknown.

    With single sign-on configured, a bearer shaped like a JWT is a person's ID token
    (``infermeter.oidc``): it reads (GET and HEAD) and manages keys as the person's role allows
    (a person's own act, audited under their name: the dashboard's keys page), and changes
    nothing else, so such a token can never close a month, export the ledger or write records;
    a person whose groups give no role is 403. While the identity provider's keys cannot be read,
    an ID token is neither taken nor refused: ``KeysUnavailable`` goes on to its 503.
    """
    tokens = svc.id_tokens
    scheme, _, credential = (authorization or "").partition(" ")
    if tokens is None or scheme.lower() != "bearer" or not looks_like_jwt(credential.strip()):
        return identify(svc.keys.ring, authorization)
    try:
        who = tokens.caller(credential.strip())
    except Unmapped as exc:
        raise Forbidden(str(exc)) from None
    except AuthError as exc:
        raise Unauthenticated(str(exc)) from None
    path = request.url.path
    if request.method not in ("GET", "HEAD") and path != _KEYS and not path.startswith(_KEYS + "/"):
        raise Forbidden(
            "a signed-in person's ID token reads and manages keys; other changes take an API key"
        )
    return who


# The only changes a person signed in with single sign-on makes with their ID token.
_KEYS = "/v1/keys"


Who = Annotated[Caller, Depends(caller)]


def asker(who: Who, svc: ServicesDep) -> Caller:
    """The caller, once it has a read token left (RateLimitedError, 429, when it has none)."""
    svc.reads.admit(who.name, time.monotonic())
    return who


def manager(who: Who, svc: ServicesDep) -> Caller:
    """The admin; Forbidden (403) for anyone else."""
    who.require(MANAGERS)
    return asker(who, svc)


def closer(who: Who, svc: ServicesDep) -> Caller:
    """The admin or finance (closing and reopening months)."""
    who.require(CLOSERS)
    return asker(who, svc)


def all_reader(who: Who, svc: ServicesDep) -> Caller:
    """A reader of every team: the admin, finance or a viewer."""
    who.require(READ_ALL)
    return asker(who, svc)


def spender(who: Who, svc: ServicesDep) -> Caller:
    """Whoever may read month-to-date spend: readers, teams and the sidecars' spend_reader."""
    who.require_spend()
    return asker(who, svc)


def key_reader(who: Who) -> Caller:
    """The admin or the sidecars' spend_reader: the issued keys' digests."""
    who.require(KEY_READERS)
    return who


def auditor(who: Who, svc: ServicesDep) -> Caller:
    """The admin: the audit trail."""
    who.require(AUDITORS)
    return asker(who, svc)


def scraper(who: Who) -> Caller:
    """The admin or the metrics role."""
    who.require(SCRAPERS)
    return who


def ingester(who: Who) -> Caller:
    """The ingest role."""
    who.require(INGESTERS)
    return who


def reader(who: Who, svc: ServicesDep) -> Caller:
    """A reader of every team, or a team (its own data); the other roles may not read."""
    who.require_reader()
    return asker(who, svc)


Manager = Annotated[Caller, Depends(manager)]
Scraper = Annotated[Caller, Depends(scraper)]
Ingester = Annotated[Caller, Depends(ingester)]
Reader = Annotated[Caller, Depends(reader)]
Asker = Annotated[Caller, Depends(asker)]
Closer = Annotated[Caller, Depends(closer)]
AllReader = Annotated[Caller, Depends(all_reader)]
Spender = Annotated[Caller, Depends(spender)]
KeyReader = Annotated[Caller, Depends(key_reader)]
Auditor = Annotated[Caller, Depends(auditor)]


def month(month: Annotated[str, Path(json_schema_extra={"pattern": MONTH_PATTERN})]) -> str:
    """The ``{month}`` path parameter, checked; BadRequest (400) unless it is ``YYYY-MM``."""
    try:
        return check_month(month)
    except ValueError as exc:
        raise BadRequest(str(exc), code="invalid_value") from None


Month = Annotated[str, Depends(month)]
