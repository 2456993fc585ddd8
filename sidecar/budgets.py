"""Monthly budgets enforced at admission, from billing's month-to-date spend.

The spend is read in the background (``GET /v1/spend``, every ``refresh_seconds``, at most a
minute) into a frozen snapshot replaced whole; admission only looks a team up in it, so a budget
costs the request path no I/O. Past ``soft_share`` of its budget a team's responses carry
``x-infermeter-budget-warning``; past the whole budget ``on_exceeded`` decides: refuse every
request (429 ``budget_exceeded``), refuse only models outside ``priority_models``, or warn only.
A team without a budget (0) is never refused.

An admin may let a team past its budget until a given time (``POST /v1/admin/budget-overrides``).
The override is first written to its own spool (``<spool>/budget-overrides``, shipped as
``budget_overrides`` into the ledger; one that cannot be written is not granted), then logged,
counted, stored in Redis when the fleet shares one (every sidecar reads it
at its next refresh) and marks each response it lets through with ``x-infermeter-budget-override``.
An admin may grant one at billing too (``POST /v1/admin/budget-overrides`` there): billing serves
those with the spend, so every sidecar takes them at its next refresh, with or without Redis.
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
from typing import TYPE_CHECKING, Any, Final, cast

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from infermeter.asgi import Receive, Scope, Send, header, read_body, respond
from infermeter.auth import ADMIN, AuthError, KeyRing, bearer_key
from infermeter.config import BudgetSettings, Config
from infermeter.errors import error_body
from infermeter.months import month_bounds, month_of
from infermeter.overrides import (
    MAX_OVERRIDE_SECONDS,
    Override,
    latest,
    override_record,
    parse_override,
)
from infermeter.records import MAX_OVERRIDE_REASON
from infermeter.spool import Spool, SpoolError

if TYPE_CHECKING:
    import httpx
    import redis.asyncio as aioredis

__all__ = [
    "MAX_OVERRIDE_SECONDS",
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
    "stored_overrides",
]

log = logging.getLogger("infermeter.sidecar")
# A month as billing names it.
_MONTH: Final = re.compile(r"\d{4}-\d{2}")


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
    if override is not None and override.until > now:
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
    redis: aioredis.Redis | None = None
    key: str = "infermeter:budget-overrides"
    spent: dict[str, float] = field(default_factory=dict)
    overrides: dict[str, Override] = field(default_factory=dict)
    read_at: float | None = None
    # Where granted overrides are written for the ledger, and the instance they are issued by.
    ledger: Spool | None = None
    instance: str = ""
    # Per team, its projects' budgets (USD a month) and month-to-date spend.
    project_budgets: dict[str, dict[str, float]] = field(default_factory=dict)
    project_spent: dict[str, dict[str, float]] = field(default_factory=dict)
    # The overrides granted through this sidecar, by team: written into Redis again at each
    # refresh that does not find them there (Redis restarted empty, the hash flushed or evicted,
    # Redis down when granted), until a later grant replaces them or a month has passed (ended
    # ones too: a revocation lost with Redis would let an earlier grant back).
    granted: dict[str, Override] = field(default_factory=dict)
    # The month billing's spend is of (None: its answer named none), and the last spend read of
    # the month before, kept once billing's answer turned to the next: a request is judged by the
    # month this sidecar's clock puts it in, which is the month billing charges it to.
    month: str | None = None
    earlier: tuple[str, dict[str, float], dict[str, dict[str, float]]] | None = None
    # The overrides billing's admin granted (``POST /v1/admin/budget-overrides`` on billing), as
    # the last spend read carried them: in no Redis, so neither Redis nor its loss is needed for
    # them to reach every sidecar, within one refresh.
    billed: dict[str, Override] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = BudgetMetrics(self.registry)
        # The month requests were last judged in, and its bounds (Unix seconds).
        self._month_cache: tuple[float, float, str] = (0.0, 0.0, "")
        # Entries of Redis's overrides were left out at the last read (said once until clean).
        self._dropping = False
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

    async def grant(self, override: Override) -> None:
        """Record an override: in the ledger's spool first (SpoolError: not granted), then
        logged, counted, and shared through Redis when there is one (when Redis does not answer,
        at the next refresh that reaches it)."""
        if self.ledger is not None:
            await self.ledger.append(override_record(override, self.instance).to_json())
        log.warning(
            "budget override for team %s %s: %s",
            override.team,
            "revoked"
            if override.until <= override.granted_at
            else "until " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(override.until)),
            override.reason,
        )
        self.metrics.overrides.labels(override.team).inc()
        self.overrides = latest(self.overrides, {override.team: override})
        self.granted = {**self.granted, override.team: override}
        if self.redis is not None:
            from redis.exceptions import RedisError  # loaded with the client

            try:
                await self._share(override)
            except (RedisError, OSError) as exc:
                log.warning(
                    "budget override for team %s not yet in Redis, written at the next refresh "
                    "that reaches it: %s",
                    override.team,
                    exc,
                )

    async def _share(self, override: Override) -> None:
        """Write ``override`` into Redis's hash of overrides."""
        assert self.redis is not None
        # redis-py types its commands for both its sync and asyncio clients.
        await cast(
            "Awaitable[int]",
            self.redis.hset(self.key, override.team, override.to_json().decode()),
        )

    async def refresh(self) -> None:
        """Read billing's spend (and the shared overrides); keep the last ones on failure."""
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
        await self._read_overrides()

    async def _read_overrides(self) -> None:
        """Per team the last override granted among billing's, Redis's and this sidecar's own
        (without Redis: billing's and its own), ended or not: the last grant decides."""
        if self.redis is None:
            since = time.time() - MAX_OVERRIDE_SECONDS
            self.granted = {t: o for t, o in self.granted.items() if o.granted_at > since}
            self.overrides = latest(self.granted, self.billed)
            return
        from redis.exceptions import RedisError  # loaded with the client

        try:
            stored = await cast("Awaitable[dict[bytes, bytes]]", self.redis.hgetall(self.key))
        except (RedisError, OSError) as exc:
            log.warning("budget overrides unreadable in Redis, keeping the last ones: %s", exc)
            self.overrides = latest(self.overrides, self.billed)
            return
        found, dropped = stored_overrides(stored, frozenset(self.budgets), time.time())
        if dropped and not self._dropping:
            log.warning(
                "budget overrides: %d entries in Redis are not overrides a sidecar could have "
                "granted (a team without a budget, a malformed value, an end past a month); "
                "left out",
                dropped,
            )
        self._dropping = bool(dropped)
        # Redis keeps nothing across a restart (no persistence) and may lose the hash: each
        # override granted here in the last month is written back when Redis holds none for its
        # team, or one granted before it, so no sidecar takes it back before its end, nor lets
        # an earlier grant back after a revocation. One granted after it, through any sidecar or
        # at billing, replaces it (the last grant decides, as it does when both are in Redis).
        since = time.time() - MAX_OVERRIDE_SECONDS
        kept: dict[str, Override] = {}
        for team, own in self.granted.items():
            held = _granted_at(stored.get(team.encode()))
            billed = self.billed.get(team)
            if (
                own.granted_at <= since
                or (held is not None and held > own.granted_at)
                or (billed is not None and billed.granted_at > own.granted_at)
            ):
                continue
            kept[team] = own
            if held == own.granted_at:
                continue
            try:
                await self._share(own)
            except (RedisError, OSError) as exc:
                log.warning("budget override for team %s not written back to Redis: %s", team, exc)
            found[team] = own
        self.granted = kept
        self.overrides = latest(found, self.billed)

    async def run(self) -> None:
        """Refresh until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.settings.refresh_seconds)

    async def close(self) -> None:
        """Close the HTTP client."""
        if self.client is not None:
            await self.client.aclose()


def stored_overrides(
    stored: dict[bytes, bytes], teams: frozenset[str], now: float
) -> tuple[dict[str, Override], int]:
    """Each team's override read from Redis, in force or ended (an ended one, a revocation,
    shadows every grant made before it), and how many entries were left out.

    Redis takes writes from every pod holding its password, so an entry counts only if a sidecar
    could have written it: a field naming a team of ``teams`` (one with a budget), a JSON object
    of that team with a number ``until`` no earlier than its ``granted_at`` and at most a month
    away, a reason of at
    most ``MAX_OVERRIDE_REASON`` characters, a number ``granted_at``. A malformed entry is left
    out, never raised: the refresh that reads them also reads billing's spend.
    """
    found: dict[str, Override] = {}
    dropped = 0
    for name, value in stored.items():
        try:
            team = name.decode()
            data = orjson.loads(value)
        except (UnicodeDecodeError, orjson.JSONDecodeError):
            dropped += 1
            continue
        if not (
            team in teams
            and isinstance(data, dict)
            and data.keys() == {"team", "until", "reason", "granted_at"}
            and data["team"] == team
            and isinstance(data["until"], int | float)
            and isinstance(data["granted_at"], int | float)
            and isinstance(data["reason"], str)
            and len(data["reason"]) <= MAX_OVERRIDE_REASON
            and data["granted_at"] <= data["until"] <= now + MAX_OVERRIDE_SECONDS
        ):
            dropped += 1
            continue
        found[team] = Override(team, float(data["until"]), data["reason"], data["granted_at"])
    return found, dropped


def billed_overrides(body: Any, teams: frozenset[str], now: float) -> dict[str, Override]:
    """The last override billing's admin granted each team, in force or ended, from a
    ``GET /v1/spend`` answer (``parse_spend`` checked it): each row's ``override``, ``{"until",
    "issued_at", "reason"}``. An ended one (a revocation) stands in for every grant made before
    it, here, at any sidecar or in Redis.

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


def _granted_at(value: bytes | None) -> float | None:
    """When the override stored as ``value`` was granted; None for none, or no override."""
    if value is None:
        return None
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    at = data.get("granted_at") if isinstance(data, dict) else None
    return float(at) if isinstance(at, int | float) else None


def budget_gate(
    settings: BudgetSettings,
    budgets: dict[str, float],
    registry: CollectorRegistry,
    token: str | None,
    redis: aioredis.Redis | None,
    key_prefix: str,
    ledger: Spool | None = None,
    instance: str = "",
    project_budgets: dict[str, dict[str, float]] | None = None,
) -> BudgetGate:
    """The sidecar's budget gate; overrides are shared through ``redis`` when there is one and
    written to ``ledger`` (a spool shipped as ``budget_overrides``) as ``instance`` issued them."""
    return BudgetGate(
        settings,
        budgets,
        registry,
        token,
        redis,
        f"{key_prefix}:budget-overrides",
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
# What hears of an override granted: the override and the client's address.
Audit = Callable[["Override", str | None], Awaitable[None]]


async def serve_override(
    gate: BudgetGate,
    control: KeyRing,
    scope: Scope,
    receive: Receive,
    send: Send,
    audit: Audit | None = None,
) -> None:
    """``POST /v1/admin/budget-overrides``: the admin grants a team an override (201), else 400/401.

    ``audit``: told of each override granted, with the client's address (the audit trail).
    """
    try:
        role = control.team_for(bearer_key(header(scope, b"authorization")))
    except AuthError:
        role = None
    if role != ADMIN:
        await respond(
            send,
            401,
            error_body(
                401,
                "A budget override needs the admin token.",
                "invalid_request_error",
                "invalid_api_key",
            ),
            [_JSON],
        )
        return
    raw = await read_body(receive, 64 * 1024, 30.0)
    try:
        override = parse_override(raw or b"", frozenset(gate.budgets), time.time())
    except ValueError as exc:
        await respond(
            send,
            400,
            error_body(400, str(exc), "invalid_request_error", "invalid_override"),
            [_JSON],
        )
        return
    try:
        await gate.grant(override)
    except SpoolError as exc:
        log.error("budget override for team %s not granted: not recorded: %s", override.team, exc)
        await respond(
            send,
            503,
            error_body(
                503,
                "The override could not be recorded; it was not granted.",
                "server_error",
                "override_not_recorded",
            ),
            [_JSON],
        )
        return
    if audit is not None:
        client = scope.get("client")
        await audit(override, client[0] if client else None)
    await respond(send, 201, override.to_json(), [_JSON])
