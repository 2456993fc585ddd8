"""Monthly budgets enforced at admission, from billing's month-to-date spend.

The spend is read in the background (``GET /v1/spend``, every ``refresh_seconds``, at most a
minute) into a frozen snapshot replaced whole; admission only looks a team up in it, so a budget
costs the request path no I/O. Past ``soft_share`` of its budget a team's responses carry
``x-infermeter-budget-warning``; past the whole budget ``on_exceeded`` decides: refuse every
request (429 ``budget_exceeded``), refuse only models outside ``priority_models``, or warn only.
A team without a budget (0) is never refused.

An admin may let a team past its budget until a given time (``POST /v1/admin/budget-overrides``,
at billing or at a sidecar). Billing is the one place an override is kept for the fleet: it
serves each team's last grant with the spend, so every sidecar takes it at its next refresh. A
sidecar asked for one passes the admin's request on to billing (the admin's own credential: billing
checks it again) and applies billing's grant at once. When billing refuses it (the body, the
credential), nothing is granted; only when billing does not answer it (not reachable, failing,
an earlier billing without the route) is the override this sidecar's alone, written to its own
spool (``<spool>/budget-overrides``, shipped as ``budget_overrides`` into the ledger; one that
cannot be written is not granted), and the answer says so. Redis carries no override: any pod
holding its password could have written one for any team, and every sidecar took it. Each
response an override lets through carries ``x-infermeter-budget-override``.
Per team the last grant decides, wherever it was made, also once it has ended: a grant of
``minutes`` 0 revokes (the team's override ends now), and neither it nor a short grant that ran
out lets an earlier, longer grant back.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from infermeter.asgi import Receive, Scope, Send, header, read_body, respond
from infermeter.auth import ADMIN, AuthError, KeyRing, bearer_key
from infermeter.config import BudgetSettings, Config
from infermeter.errors import error_body
from infermeter.http_guard import BODY_COMPLETE
from infermeter.months import month_bounds, month_of
from infermeter.overrides import (
    MAX_OVERRIDE_SECONDS,
    Override,
    latest,
    override_field,
    override_record,
    parse_override,
)
from infermeter.records import MAX_OVERRIDE_REASON
from infermeter.spool import Spool, SpoolError

if TYPE_CHECKING:
    import httpx

__all__ = [
    "MAX_OVERRIDE_SECONDS",
    "BillingRefused",
    "BudgetExceeded",
    "BudgetGate",
    "Override",
    "ProjectBudgetExceeded",
    "Verdict",
    "billed_overrides",
    "budget_gate",
    "judge",
    "parse_override",
    "parse_project_spend",
    "parse_spend",
    "project_budgets",
    "spend_month",
]

log = logging.getLogger("infermeter.sidecar")
# A month as billing names it.
_MONTH: Final = re.compile(r"\d{4}-\d{2}")
# How long an admin's grant waits for billing before it holds on this sidecar only.
_GRANT_TIMEOUT_SECONDS: Final = 5.0
# Billing's answers to a grant passed on that are its refusal of the request itself: the body
# (a team it does not know, a bound) or the credential. Any other (no such route in an earlier
# billing, a time-out, billing failing) leaves the override to this sidecar alone.
_REFUSALS: Final = frozenset({400, 401, 403, 413, 422})


class BillingRefused(Exception):
    """Billing refused an override passed on to it: its status and its answer's body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"billing refused the override: HTTP {status}")
        self.status = status
        self.body = body

    def answer(self) -> bytes:
        """The error to answer the admin with: billing's own when it is an OpenAI-style error
        (its message prefixed with where it comes from), else one saying billing refused."""
        try:
            error = orjson.loads(self.body)["error"]
            message, kind = error["message"], error["type"]
            code, param = error.get("code"), error.get("param")
        except (orjson.JSONDecodeError, TypeError, KeyError):
            message, kind, code, param = "", "invalid_request_error", None, None
        if not all(isinstance(v, str) for v in (message, kind)) or len(message) > 1000:
            message, kind = "", "invalid_request_error"
        return error_body(
            self.status,
            f"Billing refused the override (HTTP {self.status})"
            + (f": {message}" if message else "."),
            kind,
            code if isinstance(code, str) else "override_refused",
            param if isinstance(param, str) else None,
        )


class BudgetExceeded(Exception):
    """A team past its hard budget; answered 429 ``budget_exceeded``."""

    def __init__(self, team: str, spent_usd: float, budget_usd: float) -> None:
        super().__init__(
            f"Team {team} has spent ${spent_usd:.2f} of its ${budget_usd:.2f} monthly budget; "
            "requests are refused until the month ends or an admin grants an override."
        )
        self.team, self.spent_usd, self.budget_usd = team, spent_usd, budget_usd


class ProjectBudgetExceeded(BudgetExceeded):
    """A team's project past its own monthly budget; answered like a team past its budget."""

    def __init__(self, team: str, project: str, spent_usd: float, budget_usd: float) -> None:
        Exception.__init__(
            self,
            f"Project {project} of team {team} has spent ${spent_usd:.2f} of its "
            f"${budget_usd:.2f} monthly budget; its requests are refused until the month ends "
            "or an admin grants the team an override.",
        )
        self.team, self.spent_usd, self.budget_usd = team, spent_usd, budget_usd
        self.project = project


@dataclass(frozen=True)
class Verdict:
    """What a budget means for one request: headers to add, and whether an override let it in."""

    headers: tuple[tuple[str, str], ...] = ()
    overridden: bool = False
    state: str = "ok"


def judge(
    team: str,
    model: str,
    spent_usd: float,
    budget_usd: float,
    settings: BudgetSettings,
    override: Override | None,
    now: float,
) -> Verdict:
    """The budget's verdict on a request: BudgetExceeded, or the headers it carries."""
    if budget_usd <= 0:
        return Verdict()
    share = spent_usd / budget_usd
    used = (("x-infermeter-budget-used", f"{share:.3f}"),)
    if share < settings.soft_share:
        return Verdict()
    warning = (("x-infermeter-budget-warning", f"{share:.0%} of the monthly budget spent"),)
    if share < 1.0:
        return Verdict(used + warning, state="soft")
    refused = settings.on_exceeded == "refuse" or (
        settings.on_exceeded == "refuse_non_priority" and model not in settings.priority_models
    )
    if not refused:
        return Verdict(used + warning, state="hard")
    if override is not None and override.in_force(now):
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(override.until))
        return Verdict((*used, ("x-infermeter-budget-override", until)), True, "override")
    raise BudgetExceeded(team, spent_usd, budget_usd)


def parse_project_spend(body: Any) -> dict[str, dict[str, float]]:
    """Spend per team and project from a ``GET /v1/spend`` answer (``parse_spend`` checked it).

    Each row may carry ``projects`` (project -> USD); a billing of the previous version sends
    none, and then no project is refused.
    """
    out: dict[str, dict[str, float]] = {}
    for row in body:
        projects = row.get("projects")
        if not isinstance(projects, dict):
            continue
        out[row["team"]] = {
            str(p): float(v) for p, v in projects.items() if isinstance(v, int | float)
        }
    return out


def spend_month(body: Any) -> str | None:
    """The month of a ``GET /v1/spend`` answer (``parse_spend`` checked it): its rows' ``month``
    when every row names the same one, None otherwise (no rows, or a billing naming none)."""
    months = {row.get("month") for row in body}
    if len(months) != 1:
        return None
    month = months.pop()
    return month if isinstance(month, str) and _MONTH.fullmatch(month) else None


def parse_spend(body: Any) -> dict[str, float]:
    """Spend per team from a ``GET /v1/spend`` answer; ValueError when it is not one."""
    if not isinstance(body, list):
        raise ValueError("spend answer is not a list")
    out: dict[str, float] = {}
    for row in body:
        if not isinstance(row, dict) or not isinstance(row.get("team"), str):
            raise ValueError(f"spend row without a team: {row!r}")
        spent = row.get("spent_usd")
        if not isinstance(spent, int | float):
            raise ValueError(f"spend row without spent_usd: {row!r}")
        out[row["team"]] = float(spent)
    return out


class BudgetMetrics:
    """The metrics of budget enforcement."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.used = Gauge(
            "infermeter_team_budget_used_ratio",
            "Month-to-date spend over the monthly budget, as this sidecar last read it.",
            ("team",),
            registry=registry,
        )
        self.remaining = Gauge(
            "infermeter_team_budget_remaining_usd",
            "Monthly budget left, as this sidecar last read it.",
            ("team",),
            registry=registry,
        )
        self.decisions = Counter(
            "infermeter_budget_decisions",
            "Requests past a budget threshold, by what was done.",
            ("team", "state"),
            registry=registry,
        )
        self.age = Gauge(
            "infermeter_budget_spend_age_seconds",
            "Seconds since the spend was last read from billing.",
            registry=registry,
        )
        self.overrides = Counter(
            "infermeter_budget_overrides",
            "Budget overrides granted by an admin through this sidecar.",
            ("team",),
            registry=registry,
        )


@dataclass
class BudgetGate:
    """The budget state of one sidecar: a spend snapshot and each team's last override (in
    force or ended: an ended one, a revocation, stands in for every grant made before it)."""

    settings: BudgetSettings
    budgets: dict[str, float]
    registry: CollectorRegistry
    spend_token: str | None = None
    spent: dict[str, float] = field(default_factory=dict)
    overrides: dict[str, Override] = field(default_factory=dict)
    read_at: float | None = None
    # Where granted overrides are written for the ledger, and the instance they are issued by.
    ledger: Spool | None = None
    instance: str = ""
    # Per team, its projects' budgets (USD a month) and month-to-date spend.
    project_budgets: dict[str, dict[str, float]] = field(default_factory=dict)
    project_spent: dict[str, dict[str, float]] = field(default_factory=dict)
    # The overrides billing did not take, granted through this sidecar for itself alone, by
    # team: kept for a month (ended ones too: as a team's last grant, one stands in for every
    # earlier one), unless a later grant replaces them.
    granted: dict[str, Override] = field(default_factory=dict)
    # The month billing's spend is of (None: its answer named none), and the last spend read of
    # the month before, kept once billing's answer turned to the next: a request is judged by the
    # month this sidecar's clock puts it in, which is the month billing charges it to.
    month: str | None = None
    earlier: tuple[str, dict[str, float], dict[str, dict[str, float]]] | None = None
    # The overrides billing granted (asked at billing or through a sidecar), as the last spend
    # read carried them, with any this sidecar passed on since: every sidecar's, within one
    # refresh.
    billed: dict[str, Override] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = BudgetMetrics(self.registry)
        # The month requests were last judged in, and its bounds (Unix seconds).
        self._month_cache: tuple[float, float, str] = (0.0, 0.0, "")
        self.metrics.age.set_function(
            lambda: -1.0 if self.read_at is None else time.monotonic() - self.read_at
        )
        # Only a gate that reads a spend has a client (httpx loads with it, and each client
        # loads the CA bundle).
        self.client: httpx.AsyncClient | None = None
        if self.settings.spend_url:
            import httpx

            self.client = httpx.AsyncClient(timeout=10.0)

    def check(self, team: str, model: str, project: str | None = None) -> Verdict:
        """The verdict for a request of ``team`` (for ``project``) for ``model``;
        BudgetExceeded past the team's budget, ProjectBudgetExceeded past the project's."""
        now = time.time()
        snapshot = self._spend_of(self._month_at(now))
        if snapshot is None or (spent := snapshot[0].get(team)) is None:
            return Verdict()
        try:
            verdict = judge(
                team,
                model,
                spent,
                self.budgets.get(team, 0.0),
                self.settings,
                self.overrides.get(team),
                now,
            )
            if project is not None and verdict.state in ("ok", "soft"):
                self._check_project(team, model, project, snapshot[1])
        except BudgetExceeded as exc:
            state = "project_refused" if isinstance(exc, ProjectBudgetExceeded) else "refused"
            self.metrics.decisions.labels(team, state).inc()
            raise
        if verdict.state != "ok":
            self.metrics.decisions.labels(team, verdict.state).inc()
        return verdict

    def _month_at(self, now: float) -> str:
        """``month_of(now)``, its bounds kept so that a request costs two comparisons."""
        start, end, month = self._month_cache
        if not start <= now < end:
            month = month_of(now)
            start, end = month_bounds(month)
            self._month_cache = (start, end, month)
        return month

    def _spend_of(self, month: str) -> tuple[dict[str, float], dict[str, dict[str, float]]] | None:
        """The spend (by team, and by team and project) of ``month`` as last read from billing;
        None for a month billing's spend was not read of: one after it has nothing spent yet
        (billing's clock has not reached it, or its answer is not read yet)."""
        if self.month is None or self.month == month:
            return self.spent, self.project_spent
        if self.earlier is not None and self.earlier[0] == month:
            return self.earlier[1], self.earlier[2]
        return None

    def _check_project(
        self, team: str, model: str, project: str, project_spent: dict[str, dict[str, float]]
    ) -> None:
        """ProjectBudgetExceeded when ``project`` has a budget, its spend reached it, and the
        settings refuse ``model`` past a budget (an override of the team lets it in too)."""
        budget = self.project_budgets.get(team, {}).get(project, 0.0)
        spent = project_spent.get(team, {}).get(project)
        if budget <= 0 or spent is None:
            return
        # Its warning headers are not given: the team's are (one set per response).
        try:
            judge(team, model, spent, budget, self.settings, self.overrides.get(team), time.time())
        except BudgetExceeded:
            raise ProjectBudgetExceeded(team, project, spent, budget) from None

    async def grant(
        self, override: Override, raw: bytes, authorization: str, address: str | None = None
    ) -> tuple[Override, str | None]:
        """Grant ``override``, which the admin asked for with body ``raw`` and header
        ``authorization`` (from ``address``): passed on to billing, else this sidecar's alone.

        Returns the override granted and None when billing took it (as billing recorded it:
        every sidecar applies it at its next refresh, this one at once), else ``override`` and
        why it holds on this sidecar only: then it is written to the ledger's spool first
        (SpoolError: not granted). BillingRefused when billing answered that the request is not
        one it grants (the body, or the credential): nothing is granted then, here either.
        """
        taken, why = await self._grant_at_billing(override.team, raw, authorization, address)
        if taken is not None:
            override = taken
            self.billed = latest(self.billed, {taken.team: taken})
        else:
            if self.ledger is not None:
                await self.ledger.append(override_record(override, self.instance).to_json())
            self.granted = {**self.granted, override.team: override}
        log.warning(
            "budget override for team %s %s (%s): %s",
            override.team,
            "revoked"
            if override.until <= override.granted_at
            else "until " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(override.until)),
            "every sidecar, kept by billing" if why is None else f"this sidecar only: {why}",
            override.reason,
        )
        self.metrics.overrides.labels(override.team).inc()
        self.overrides = latest(self.overrides, {override.team: override})
        return override, why

    async def _grant_at_billing(
        self, team: str, raw: bytes, authorization: str, address: str | None
    ) -> tuple[Override | None, str | None]:
        """The admin's request passed on to billing's ``POST /v1/admin/budget-overrides``:
        billing's grant, or None and why billing did not take it. The admin's ``address`` goes
        with it (``x-forwarded-for``), for billing's audit trail."""
        if self.settings.spend_url is None or self.client is None:
            return None, "no billing to keep it (budgets.spend_url is not set)"
        import httpx  # loaded with the client

        url = self.settings.spend_url.rstrip("/") + "/v1/admin/budget-overrides"
        try:
            r = await self.client.post(
                url,
                content=raw,
                headers={
                    "authorization": authorization,
                    "content-type": "application/json",
                    **({"x-forwarded-for": address} if address else {}),
                },
                timeout=_GRANT_TIMEOUT_SECONDS,
            )
        except httpx.HTTPError as exc:
            return None, f"billing did not answer: {exc!r}"
        if r.status_code in _REFUSALS:
            raise BillingRefused(r.status_code, r.content)
        if r.status_code != 201:
            return None, f"billing answered {r.status_code}"
        taken = _billed_grant(r.content, team, frozenset(self.budgets), time.time())
        if taken is None:
            return None, "billing's answer is not an override of the team"
        return taken, None

    async def refresh(self) -> None:
        """Read billing's spend (and its overrides); keep the last ones on failure."""
        if self.settings.spend_url is None or self.client is None:
            return
        import httpx  # loaded with the client

        headers = {"authorization": f"Bearer {self.spend_token}"} if self.spend_token else {}
        try:
            r = await self.client.get(
                self.settings.spend_url.rstrip("/") + "/v1/spend", headers=headers
            )
            r.raise_for_status()
            body = r.json()
            spent = parse_spend(body)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("budget spend unreadable, keeping the last one: %s", exc)
            return
        month = spend_month(body)
        if month is not None and self.month is not None and month > self.month:
            self.earlier = (self.month, self.spent, self.project_spent)
        self.month = month
        self.spent, self.read_at = spent, time.monotonic()
        self.project_spent = parse_project_spend(body)
        self.billed = billed_overrides(body, frozenset(self.budgets), time.time())
        for team, value in spent.items():
            budget = self.budgets.get(team, 0.0)
            if budget > 0:
                self.metrics.used.labels(team).set(value / budget)
                self.metrics.remaining.labels(team).set(max(0.0, budget - value))
        self._read_overrides()

    def _read_overrides(self) -> None:
        """Per team the last override granted among billing's and this sidecar's own, ended
        or not: the last grant decides. Its own are let go a month after they were granted."""
        since = time.time() - MAX_OVERRIDE_SECONDS
        self.granted = {t: o for t, o in self.granted.items() if o.granted_at > since}
        self.overrides = latest(self.granted, self.billed)

    async def run(self) -> None:
        """Refresh until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.settings.refresh_seconds)

    async def close(self) -> None:
        """Close the HTTP client."""
        if self.client is not None:
            await self.client.aclose()


def billed_overrides(body: Any, teams: frozenset[str], now: float) -> dict[str, Override]:
    """The last override billing's admin granted each team, in force or ended, from a
    ``GET /v1/spend`` answer (``parse_spend`` checked it): each row's ``override``, ``{"until",
    "issued_at", "reason"}``. An ended one (a revocation) stands in for every grant made before
    it, at billing or at any sidecar.

    A billing of the previous version sends none, and then there are none (and one before
    revocations sends only overrides in force). An entry is taken only as billing's route could
    have granted it (a team of ``teams``, an end no earlier than its grant and at most a month
    away, a bounded reason); any other is left out, never raised, so that the spend beside it is
    still read.
    """
    found: dict[str, Override] = {}
    for row in body:
        data, team = row.get("override"), row["team"]
        if not (
            team in teams
            and isinstance(data, dict)
            and isinstance(data.get("until"), int | float)
            and isinstance(data.get("issued_at"), int | float)
            and isinstance(data.get("reason"), str)
            and len(data["reason"]) <= MAX_OVERRIDE_REASON
            and data["issued_at"] <= data["until"] <= now + MAX_OVERRIDE_SECONDS
        ):
            continue
        found[team] = Override(team, float(data["until"]), data["reason"], float(data["issued_at"]))
    return found


def _billed_grant(body: bytes, team: str, teams: frozenset[str], now: float) -> Override | None:
    """The override billing's route answered a grant with (``billing.routes.overrides``), taken
    as ``billed_overrides`` takes one from the spend; None for anything else."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("team") != team:
        return None
    row = {"team": team, "override": {**data, "issued_at": data.get("granted_at")}}
    return billed_overrides([row], teams, now).get(team)


def budget_gate(
    settings: BudgetSettings,
    budgets: dict[str, float],
    registry: CollectorRegistry,
    token: str | None,
    ledger: Spool | None = None,
    instance: str = "",
    project_budgets: dict[str, dict[str, float]] | None = None,
) -> BudgetGate:
    """The sidecar's budget gate; the overrides billing does not take are written to ``ledger``
    (a spool shipped as ``budget_overrides``) as ``instance`` issued them."""
    return BudgetGate(
        settings,
        budgets,
        registry,
        token,
        ledger=ledger,
        instance=instance,
        project_budgets=project_budgets or {},
    )


def project_budgets(config: Config) -> dict[str, dict[str, float]]:
    """Each team's project budgets (USD a month), for the teams that set any."""
    return {
        t.name: dict(t.project_budgets_usd_per_month)
        for t in config.teams
        if t.project_budgets_usd_per_month
    }


_JSON = (b"content-type", b"application/json")
# An override's body is three short fields (billing's route takes as much).
_MAX_OVERRIDE_BODY: Final = 64 * 1024
_BODY_TIMEOUT_SECONDS: Final = 30.0
# What hears of an override granted: the override, the client's address and whether billing
# took it (every sidecar's) or it holds on this sidecar only.
Audit = Callable[["Override", str | None, bool], Awaitable[None]]


async def _error(
    send: Send,
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
) -> None:
    await respond(send, status, error_body(status, message, kind, code, param), [_JSON])


async def serve_override(
    gate: BudgetGate,
    control: KeyRing,
    scope: Scope,
    receive: Receive,
    send: Send,
    audit: Audit | None = None,
) -> None:
    """``POST /v1/admin/budget-overrides``: the admin grants a team an override (201).

    The answer is the override as granted, with ``scope``: ``fleet`` when billing took it (every
    sidecar applies it at its next spend refresh), ``sidecar`` when it holds here only (``note``
    says why). Else an OpenAI-style error: 401 without the admin token, 400 for a body that is
    not an override (``param`` naming the field), 408 and 413 for a body too slow or too large,
    billing's own status and message when billing refused the override (nothing is granted
    then), 503 when it could not be recorded. ``audit``: told of each override granted, with the
    client's address and its scope (the audit trail).
    """
    authorization = header(scope, b"authorization")
    try:
        role = control.team_for(bearer_key(authorization))
    except AuthError:
        role = None
    if role != ADMIN:
        await _error(send, 401, "A budget override needs the admin token.", "invalid_api_key")
        return
    try:
        raw = await read_body(
            receive,
            _MAX_OVERRIDE_BODY,
            _BODY_TIMEOUT_SECONDS,
            scope.get("extensions", {}).get(BODY_COMPLETE, False),
        )
    except TimeoutError:
        await _error(send, 408, "The request body did not arrive in time.", "request_timeout")
        return
    if raw is None:
        await _error(
            send, 413, f"Request body exceeds {_MAX_OVERRIDE_BODY} bytes.", "request_too_large"
        )
        return
    try:
        override = parse_override(raw, frozenset(gate.budgets), time.time())
    except ValueError as exc:
        await _error(send, 400, str(exc), "invalid_override", override_field(str(exc)))
        return
    client = scope.get("client")
    address = client[0] if client else None
    try:
        granted, why = await gate.grant(override, raw, authorization or "", address)
    except BillingRefused as refused:
        log.warning(
            "budget override for team %s not granted: billing answered %d",
            override.team,
            refused.status,
        )
        await respond(send, refused.status, refused.answer(), [_JSON])
        return
    except SpoolError as exc:
        log.error("budget override for team %s not granted: not recorded: %s", override.team, exc)
        await _error(
            send,
            503,
            "The override could not be recorded; it was not granted.",
            "override_not_recorded",
            kind="server_error",
        )
        return
    if audit is not None:
        await audit(granted, address, why is None)
    shown: dict[str, Any] = {**granted.__dict__, "scope": "sidecar" if why else "fleet"}
    if why is not None:
        shown["note"] = (
            f"Billing did not take the override ({why}): it holds on this sidecar only. Grant "
            "it at billing for every sidecar."
        )
    await respond(send, 201, orjson.dumps(shown), [_JSON])
