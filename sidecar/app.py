"""The sidecar: a metering, team-aware streaming proxy in front of one vLLM replica.

Plain ASGI for the request itself; every token of every user then passes through the relay
(``sidecar.relay``) on asyncio protocols (``sidecar.direct``, ``sidecar.pool``). The path of
one request:

    identify team -> read and check body -> route model (``sidecar.admission``) -> budget
    -> team limits -> fair batch slot -> forward, streamed -> meter and rewrite chunks
    -> how it ended kept in its journal slot (``sidecar.accounting``)
    -> final ``data: [DONE]`` (or the whole body) -> settle limits, metrics, span
    ... and at the journal's next tick, the records of all the requests that ended in it go to
    the spool with one write and one fsync.

A request refused for any reason takes nothing from the team's limits: every refusal that can
come before the limits does (401, 400, 404, 408, 413, budget), and one after them (fair share,
draining, the journal) refunds its admission whole instead of settling it. Only a request that
was forwarded is settled, by what vLLM reported it used.

How a request ended is in its journal slot (the kernel's pages) before the client sees the end
of its response, so a response a client saw complete is never lost, even if the sidecar is
killed right after: until its record is written and fsync'ed at the tick, the admission journal
keeps the request, and a restart makes its record from the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from opentelemetry import trace
from prometheus_client import generate_latest

from infermeter.asgi import Receive, Scope, Send, read_body, respond
from infermeter.audit_spool import AUDIT_DIR, AUDIT_KIND, AuditLog
from infermeter.auth import ADMIN, AuthError, bearer_key
from infermeter.config import Config, env_value, process_environment
from infermeter.errors import error_body
from infermeter.http_guard import BODY_COMPLETE, RAW_WRITER, RawWriter, ServerLimits
from infermeter.identity import Identity, identity_from_environment, instance_credential
from infermeter.ids import request_id
from infermeter.journal_files import JOURNAL_DIR, recover
from infermeter.keys import IssuedKeys
from infermeter.records import RequestStatus
from infermeter.spool import Spool, SpoolError
from infermeter.spooldir import BUDGET_OVERRIDES
from infermeter.writers import Sealer
from sidecar import tracing
from sidecar.accounting import Accounting, Call, count_recovered
from sidecar.admission import (
    GENERATE,
    Headers,
    Plan,
    Refusal,
    first_header,
    gateway_signed,
    plan,
    tag_refusal,
    upstream_headers,
)
from sidecar.budgets import BudgetExceeded, Override, budget_gate, project_budgets, serve_override
from sidecar.direct import Pools
from sidecar.drain import Drain
from sidecar.fairness import FairShare, QueueFull, Slot, WaitTimeout
from sidecar.fetch import Fetched, fetch
from sidecar.journal import AdmissionJournal, JournalError
from sidecar.keysync import KeySync
from sidecar.lifetime import EVENTS_MAX_BYTES, Lifetime, resource_attributes
from sidecar.limits import LimitExceeded
from sidecar.metrics import SidecarMetrics
from sidecar.models_list import with_aliases
from sidecar.nonces import nonce_store, team_of
from sidecar.rates import RatePoller
from sidecar.relay import JSON, Relay
from sidecar.request_ids import client_request_id
from sidecar.state import View, build_view
from sidecar.stream import StreamMeter, UsageCounts
from sidecar.tags import TagRefusal, project_of
from sidecar.team_limits import LimitsUnavailable, team_limiter, team_limits
from sidecar.upstream import UPSTREAM_ERRORS, upstream_failure

if TYPE_CHECKING:
    from collections.abc import Sequence

    import httpx
    from opentelemetry.sdk.metrics.export import Metric
    from opentelemetry.sdk.trace import TracerProvider

    from infermeter.otlp import OtlpSettings
    from infermeter.otlp_export import MetricsExport
    from infermeter.shipper import Shipper

__all__ = ["Sidecar"]

log = logging.getLogger("infermeter.sidecar")

_NEEDS_METRICS_TOKEN = error_body(
    401,
    "The metrics endpoint needs the metrics or admin token.",
    "invalid_request_error",
    "invalid_api_key",
)


class Sidecar:
    """One replica's sidecar: state, background tasks and the ASGI entry point."""

    def __init__(
        self,
        config: Config,
        replica_id: str,
        *,
        spool_dir: Path | None = None,
        tracer_provider: TracerProvider | None = None,
        client: httpx.AsyncClient | None = None,
        identity: Identity | None = None,
        engine_metrics_url: str | None = None,
        otlp: OtlpSettings | None = None,
    ) -> None:
        """``identity``: the instance fronted (default: the fixed replica); ``spool_dir``: its spool;
        ``otlp``: how to export the GenAI metrics over OTLP (None: not exported, nothing kept)."""
        self.replica_id = replica_id
        self.view: View = build_view(config, replica_id)
        self.team_names = frozenset(t.name for t in config.teams)
        settings = config.sidecar
        self.settings = settings
        self.metrics = SidecarMetrics()
        self.limiter = team_limiter(config, replica_id, self.metrics.registry)
        capacity = self.view.replica.max_num_seqs
        self.fair = (
            FairShare(
                capacity,
                settings.fair_headroom,
                settings.fair_queue_max_per_team,
                settings.fair_wait_timeout_seconds,
                priorities={t.name: t.priority for t in config.teams},
            )
            if capacity
            else None
        )
        self.identity = identity or identity_from_environment(self.view.replica, {})
        assert self.identity.replica == replica_id, "an identity of another replica group"
        # Usage records name the instance only when it is not the fixed replica itself.
        self.instance = self.identity.instance if self.identity.dynamic else None
        directory = spool_dir or Path(settings.spool_dir) / self.identity.spool_key
        # The instance's writer credential: it seals every spool line and ships them; its address
        # is the only engine metrics URL billing takes from this instance.
        self.credential = instance_credential(
            self.identity, process_environment(), settings.credential_env
        )
        sealer = Sealer(self.credential) if self.credential is not None else None
        if self.credential is not None:
            engine_metrics_url = self.credential.writer.engine_metrics_url
        # Usage records are written and fsync'ed once per journal tick, all those of the requests
        # that ended in it: the journal keeps every request whose record is not durable yet
        # (``Accounting.record``).
        tick_seconds = settings.journal_mark_millis / 1000
        self.spool = Spool(
            directory,
            max_bytes=settings.spool_max_bytes,
            sealer=sealer,
            sync_seconds=tick_seconds,
            keep_acked_seconds=settings.spool_keep_acked_seconds,
        )
        # Outlives reloads: a new view must not forget which signed requests were served.
        self.nonces = nonce_store(config, directory, self.metrics.registry)
        # Overrides are few (an admin's hand): the lifetime events' bound is ample.
        self.override_spool = Spool(
            directory / BUDGET_OVERRIDES, max_bytes=EVENTS_MAX_BYTES, sealer=sealer
        )
        self.budgets = budget_gate(
            settings.budgets,
            {t.name: t.budget_usd_per_month for t in config.teams},
            self.metrics.registry,
            env_value(settings.budgets.spend_token_env),
            self.override_spool,
            self.identity.instance,
            project_budgets(config),
        )
        # The keys issued at run time, from Redis or billing (the last set read is on disk too).
        self.keysync = KeySync(
            self._take_keys,
            directory,
            lambda: self.client,
            config.billing.url,
            env_value(settings.budgets.spend_token_env),
            self.limiter.redis,
            settings.shared_limits.key_prefix,
            settings.key_sync_seconds,
            settings.shared_limits.key_signer,
        )
        self.keysync.load()
        # What this instance's admins and operators changed (overrides, reloads): spooled, shipped.
        source = (
            self.credential.writer.principal
            if self.credential
            else f"sidecar:{self.identity.instance}"
        )
        self.audit = AuditLog(directory / AUDIT_DIR, source, self.credential)
        self.lifetime = Lifetime(
            self.identity,
            directory,
            settings.heartbeat_seconds,
            self.view.replica.gpu_count,
            engine_metrics_url,
            self.metrics.registry,
            sealer=sealer,
        )
        self.journal = AdmissionJournal(self.spool.directory / JOURNAL_DIR, tick_seconds)
        self.accounting = Accounting(
            self.spool,
            self.journal,
            self.metrics,
            replica_id,
            self.instance,
            settings.on_spool_failure,
            tick_seconds,
        )
        self.drain = Drain()
        self.tracer = tracing.tracer(tracer_provider)
        self.upstream_key = env_value(settings.upstream_api_key_env) or None
        # For shipping only, made when the shippers start (``client``).
        self._client = client
        self.relay = Relay(
            self.view.replica.upstream_url.rstrip("/"),
            Pools(settings.connect_timeout_seconds, settings.read_timeout_seconds),
            self.accounting,
            self.journal,
            self.drain,
            settings.non_streamed_via_stream,
            settings.whole_hang_up == "finish",
        )
        if not settings.protocol_relay:
            log.warning(
                "sidecar.protocol_relay: false has no effect: one relay serves every request"
            )
        # Each answer's cost estimate, from billing's rates, read beside the spend.
        self.rates = RatePoller(
            settings.budgets,
            env_value(settings.budgets.spend_token_env),
            lambda: self.budgets.client,
            self.metrics.registry,
        )
        self.relay.rates = self.rates
        self.ingest_url = settings.ingest_url
        self.ingest_token = env_value(settings.ingest_token_env) or None
        self._tasks: list[asyncio.Task[None]] = []
        self._shippers: list[Shipper] = []
        self.otlp = self._metrics_export(otlp) if otlp is not None else None

    def _metrics_export(self, settings: OtlpSettings) -> MetricsExport:
        """The GenAI metrics, kept at each tick for the requests ended in it and exported over OTLP
        (the SDK loads here)."""
        from infermeter.otlp_export import make_metrics_export
        from sidecar.otel_metrics import GenAiMetrics

        genai = GenAiMetrics(self.view.replica.upstream_url, settings.opt_in)
        self.accounting.genai = genai
        accounting = self.accounting

        async def produce(start_ns: int, now_ns: int) -> Sequence[Metric]:
            # The requests ended since the last tick go into this export, as into a scrape.
            accounting.settle()
            return await genai.produce(start_ns, now_ns)

        return make_metrics_export(
            settings,
            f"infermeter-sidecar-{self.replica_id}",
            "infermeter.sidecar",
            resource_attributes(self.identity),
            [produce],
            self.metrics.registry,
            genai.schema_url,
        )

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client the shippers send with, made on first use (httpx loads with it)."""
        if self._client is None:
            import httpx

            settings = self.settings
            timeout = httpx.Timeout(
                settings.read_timeout_seconds, connect=settings.connect_timeout_seconds
            )
            self._client = httpx.AsyncClient(timeout=timeout)
        return self._client

    @property
    def upstream(self) -> str:
        """The replica's base URL (vLLM's API)."""
        return self.relay.upstream

    @upstream.setter
    def upstream(self, url: str) -> None:
        self.relay.upstream = url

    @property
    def spool_broken(self) -> bool:
        """True while the last spool append failed."""
        return self.accounting.spool_broken

    @property
    def server_limits(self) -> ServerLimits:
        """What the HTTP server in front of this sidecar allows a client (``sidecar.*``)."""
        s = self.settings
        return ServerLimits(
            header_timeout_seconds=s.header_timeout_seconds, max_connections=s.max_connections
        )

    # -- life cycle ------------------------------------------------------------------------------

    async def startup(self) -> None:
        """Take the spool directory, open the spools, record what a killed predecessor left
        running, start the shippers, announce the start."""
        await self.lifetime.claim()
        await self.limiter.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self.nonces.run()))
        if self.settings.budgets.spend_url:
            self._tasks.append(asyncio.get_running_loop().create_task(self.budgets.run()))
            self._tasks.append(asyncio.get_running_loop().create_task(self.rates.run()))
        if self.keysync.enabled:
            self._tasks.append(asyncio.get_running_loop().create_task(self.keysync.run()))
        if (redis := self.limiter.redis) is not None and self.fair is not None:
            from sidecar.shared_fairness import FairShareSync  # with redis-py, only when shared

            sync = FairShareSync(
                redis,
                self.fair,
                self.settings.shared_limits.key_prefix,
                self.replica_id,
                self.identity.instance,
                teams=lambda: self.team_names,
            )
            self._tasks.append(asyncio.get_running_loop().create_task(sync.run()))
        self.spool.open()
        self.override_spool.open()
        self.audit.open()
        recovered = await recover(self.journal.open(), self.spool)
        count_recovered(
            self.metrics, recovered, self.team_names, self.view.model_names, self.accounting.genai
        )
        self.accounting.start()
        if self.otlp is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self.otlp.run()))
        # (Records waiting for the tick are not acknowledged either.)
        self.metrics.spool_backlog.set_function(
            lambda: self.spool.backlog + self.accounting.waiting
        )
        if self.ingest_url:
            from infermeter.shipper import Shipper, ShipperMetrics

            shipped = ShipperMetrics(self.metrics.registry)
            for spool, kind in (
                (self.spool, "usage"),
                (self.lifetime.spool, "instances"),
                (self.override_spool, "budget_overrides"),
                (self.audit.spool, AUDIT_KIND),
            ):
                shipper = Shipper(
                    spool,
                    self.ingest_url,
                    self.ingest_token,
                    kind,
                    self.client,
                    metrics=shipped,
                    credential=self.credential,
                )
                self._shippers.append(shipper)
                self._tasks.append(asyncio.get_running_loop().create_task(shipper.run()))
        await self.lifetime.start()

    async def shutdown(self) -> None:
        """Record requests left running, announce the stop, ship the spools, let them go."""
        await self._stop_tasks()
        # The records of the requests that ended, and those written and not fsync'ed yet, leave
        # the journal first: they are not running.
        await self.accounting.close()
        with contextlib.suppress(SpoolError):
            await self.spool.sync()
        for record in self.journal.interrupted_now():
            with contextlib.suppress(SpoolError):
                await self.spool.append(record.to_json())
                self.journal.finish(record.request_id)
        await self.lifetime.stop()
        await self.ship_remaining(self.settings.drain_ship_seconds)
        await self.journal.close()
        await self.spool.close()
        await self.override_spool.close()
        await self.audit.close()
        await self.lifetime.close()
        self.lifetime.release()
        await self.limiter.close()
        await self.nonces.close()
        await self.budgets.close()
        if self._client is not None:
            await self._client.aclose()
        await self.relay.close()
        if self.otlp is not None:  # the last figures, every request above counted
            await self.otlp.close()

    async def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def ship_remaining(self, max_seconds: float) -> None:
        """Ship every record in the spools now, for at most ``max_seconds`` (on the way out)."""
        await self._stop_tasks()
        if not self._shippers or max_seconds <= 0:
            return
        from infermeter.shipper import last_shipment

        await self.spool.seal()
        await self.lifetime.spool.seal()
        await last_shipment(self._shippers, max_seconds)
        if self.spool.backlog:  # what is not shipped stays spooled for the next start
            log.error("%d record(s) left unshipped in the spool at exit", self.spool.backlog)

    def reload(self, config: Config) -> None:
        """Apply a new configuration without a restart (keys, limits, approved models)."""
        self.view = build_view(config, self.replica_id, self.keysync.current)
        self.team_names = frozenset(t.name for t in config.teams)
        self.limiter.configure(team_limits(config))
        self.budgets.budgets = {t.name: t.budget_usd_per_month for t in config.teams}
        self.budgets.project_budgets = project_budgets(config)
        if self.fair is not None:
            self.fair.priorities = {t.name: t.priority for t in config.teams}

    async def _audit_override(self, override: Override, address: str | None, fleet: bool) -> None:
        """The override granted, on the audit trail (after it is kept: by billing, or in the
        ledger's spool); ``fleet``: billing took it, for every sidecar."""
        await self.audit.note(
            "budget.override",
            ADMIN,
            "admin",
            target=f"team:{override.team}",
            detail={
                "until": override.until,
                "instance": self.identity.instance,
                "scope": "fleet" if fleet else "sidecar",
            },
            why=override.reason,
            address=address,
        )

    def _take_keys(self, issued: IssuedKeys) -> None:
        """Swap in a newer set of keys issued at run time (``sidecar.keysync``)."""
        self.view = self.view.with_issued(issued)

    # -- ASGI ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route a request: the OpenAI API, or one of the sidecar's own endpoints."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in GENERATE and method == "POST":
            await self._generate(scope, receive, send, path)
        elif path == "/v1/models" and method == "GET":
            await self._models(scope, send)
        elif path == "/metrics" and method == "GET":
            await self._metrics(scope, send)
        elif path == "/engine/metrics" and method == "GET":
            await self._engine_metrics(scope, send)
        elif path == "/v1/admin/budget-overrides" and method == "POST":
            await serve_override(
                self.budgets, self.view.control, scope, receive, send, self._audit_override
            )
        elif path == "/healthz":
            await respond(send, 200, b'{"status":"ok"}', [JSON])
        elif path == "/readyz":
            await self._ready(send)
        else:
            await respond(
                send,
                404,
                error_body(
                    404,
                    f"Unknown request URL: {method} {path}.",
                    "invalid_request_error",
                    "unknown_url",
                ),
                [JSON],
            )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except OSError as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- control endpoints -----------------------------------------------------------------------

    def _control_allowed(self, scope: Scope) -> bool:
        if self.view.control_open:
            return True
        try:
            key = bearer_key(first_header(scope["headers"], b"authorization"))
            self.view.control.team_for(key)
        except AuthError:
            return False
        return True

    async def _metrics(self, scope: Scope, send: Send) -> None:
        if not self._control_allowed(scope):
            await respond(send, 401, _NEEDS_METRICS_TOKEN, [JSON])
            return
        if self.fair is not None:
            for team in self.fair.in_flight:
                self.metrics.fair_waiting.labels(team).set(self.fair.waiting(team))
        # The requests ended since the last tick, so that the page has every one of them.
        self.accounting.settle()
        body = generate_latest(self.metrics.registry)
        await respond(
            send, 200, body, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        )

    async def _engine_metrics(self, scope: Scope, send: Send) -> None:
        # vLLM listens on loopback only (it serves some routes without its API key), so its
        # own metrics page is reached here, behind the same token as the sidecar's.
        if not self._control_allowed(scope):
            await respond(send, 401, _NEEDS_METRICS_TOKEN, [JSON])
            return
        try:
            r = await self._fetch("/metrics", {}, 10.0)
        except UPSTREAM_ERRORS as exc:
            status, body = upstream_failure(exc)
            await respond(send, status, body, [JSON])
            return
        kind = r.content_type or b"text/plain; version=0.0.4; charset=utf-8"
        await respond(send, r.status, r.body, [(b"content-type", kind)])

    async def _ready(self, send: Send) -> None:
        problems = []
        try:
            r = await self._fetch("/health", {}, 2.0)
            if r.status != 200:
                problems.append(f"upstream /health answered {r.status}")
        except UPSTREAM_ERRORS as exc:
            problems.append(f"upstream unreachable: {type(exc).__name__}")
        if self.accounting.refusing:
            problems.append("usage spool is not writable")
        if self.drain.draining:
            problems.append("shutting down: draining running requests")
        status = 503 if problems else 200
        await respond(
            send, status, orjson.dumps({"ready": not problems, "problems": problems}), [JSON]
        )

    async def _models(self, scope: Scope, send: Send) -> None:
        try:
            await team_of(self.view, self.nonces, scope["method"], scope["path"], scope["headers"])
        except AuthError as exc:
            await respond(
                send, 401, error_body(401, str(exc), "invalid_request_error", exc.code), [JSON]
            )
            return
        except Refusal as refused:
            body = error_body(refused.status, refused.message, refused.err_type, refused.code)
            await respond(
                send,
                refused.status,
                body,
                [JSON, *((k.encode(), v.encode()) for k, v in refused.headers)],
            )
            return
        try:
            r = await self._fetch(
                "/v1/models",
                self._upstream_headers(scope["headers"], None),
                self.settings.read_timeout_seconds,
            )
        except UPSTREAM_ERRORS as exc:
            status, body = upstream_failure(exc)
            await respond(send, status, body, [JSON])
            return
        body = with_aliases(r.body, self.view) if r.status == 200 else r.body
        await respond(send, r.status, body, [JSON])

    async def _fetch(self, path: str, headers: dict[str, str], timeout_seconds: float) -> Fetched:
        """A GET to the replica's own ``path`` (``sidecar.fetch``)."""
        return await fetch(self.relay.pools, self.upstream, path, headers, timeout_seconds)

    # -- generation endpoints --------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        received_at = time.time()
        call = Call(request_id(received_at), path, received_at, time.perf_counter())
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        call.client_request_id = client_request_id(first_header(headers, b"x-request-id"))
        meter: StreamMeter | None = None
        usage: UsageCounts | None = None
        status = RequestStatus.OK
        finish: str | None = None
        forwarded = False
        try:
            body = await self._admit(call, scope, receive)
            self._enter(call)
            forwarded = True
            upstream = self._upstream_headers(headers, call)
            raw = _raw_writer(scope)
            if call.stream:
                opened = await self.relay.open_stream(call, body, upstream)
                # A stream may run for minutes: its parsed body (the prompt) and headers, sent
                # now, are not kept for its length (memory per open stream).
                del body, upstream
                meter, status, _ = await self.relay.relay_stream(call, receive, send, opened, raw)
                usage, finish = meter.usage, meter.finish_reason
            else:
                usage, status, _, finish = await self.relay.whole(
                    call, receive, send, body, upstream, raw
                )
        except Refusal as refused:
            status = await self._refuse(call, refused, send)
            self.accounting.observe(call, status, None, None, None, self.view.model_names)
            return
        except asyncio.CancelledError:
            # The server's grace ran out on a request the drain did not end: its record is the
            # journal's, interrupted, at shutdown; its span and metrics say the same (one whose
            # ending was already kept has its own record, and no span or metric is made twice).
            if forwarded and self.journal.is_running(call.request_id):
                self.accounting.observe(
                    call, RequestStatus.INTERRUPTED, None, None, None, self.view.model_names
                )
            raise
        finally:
            self._release(call, usage, forwarded)
        self.accounting.observe(call, status, usage, meter, finish, self.view.model_names)

    async def _refuse(self, call: Call, rej: Refusal, send: Send) -> RequestStatus:
        """Answer a refusal; it takes nothing from the team's limits (``_release``)."""
        headers = [JSON, *((k.encode(), v.encode()) for k, v in rej.headers), *call.echo_headers()]
        body = error_body(rej.status, rej.message, rej.err_type, rej.code, rej.param)
        if call.team:
            with contextlib.suppress(SpoolError):
                self.accounting.record(call, rej.record_status, rej.status, None, None, None)
        await respond(send, rej.status, body, headers)
        return rej.record_status

    def _enter(self, call: Call) -> None:
        """The last step before forwarding: refuse while draining, else journal the admission."""
        if self.drain.draining:
            raise Refusal(
                503,
                "The sidecar is shutting down; send the request again.",
                "server_error",
                "server_shutting_down",
                RequestStatus.REJECTED,
                (("retry-after", "1"),),
            )
        try:
            self.journal.admit(self.accounting.admission(call), call.started)
        except JournalError as exc:
            self.metrics.spool_errors.inc()
            if self.settings.on_spool_failure == "refuse":
                raise Refusal(
                    503,
                    "Usage metering is unavailable; the request was not served.",
                    "server_error",
                    "metering_unavailable",
                    RequestStatus.REJECTED,
                ) from None
            log.error(
                "%s; request %s would go unrecorded if the sidecar died", exc, call.request_id
            )

    def _rate_limited(self, call: Call, exc: LimitExceeded) -> Refusal:
        self.metrics.rate_limited.labels(call.team, exc.reason).inc()
        headers = (("retry-after", str(max(1, round(exc.retry_after_seconds)))), *exc.headers)
        return Refusal(
            429,
            str(exc),
            "requests" if exc.reason == "requests" else "tokens",
            "rate_limit_exceeded",
            RequestStatus.RATE_LIMITED,
            headers,
        )

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        """The request body, or the 408 or 413 refusal of a body too slow or too large."""
        limit = self.settings.max_body_bytes
        complete = scope.get("extensions", {}).get(BODY_COMPLETE, False)
        try:
            raw = await read_body(receive, limit, self.settings.body_timeout_seconds, complete)
        except TimeoutError:
            raise Refusal(
                408,
                "The request body did not arrive in time.",
                "invalid_request_error",
                "request_timeout",
                RequestStatus.BAD_REQUEST,
            ) from None
        if raw is None:
            raise Refusal(
                413,
                f"Request body exceeds {limit} bytes.",
                "invalid_request_error",
                "request_too_large",
                RequestStatus.BAD_REQUEST,
            )
        return raw

    async def _admit(self, call: Call, scope: Scope, receive: Receive) -> dict[str, Any]:
        """Everything before forwarding; raises Refusal with the answer otherwise."""
        view = self.view
        headers = scope["headers"]
        # A gateway's signature covers the body, so that body is read first; a key is checked
        # before a byte of the body is read.
        signed = gateway_signed(view, headers)
        raw = await self._read(scope, receive) if signed else b""
        try:
            call.team = await team_of(
                view, self.nonces, scope["method"], scope["path"], headers, raw
            )
        except AuthError as exc:
            raise Refusal(
                401, str(exc), "invalid_request_error", exc.code, RequestStatus.UNAUTHORIZED
            ) from None
        if not signed:
            raw = await self._read(scope, receive)
        return await self.admit_planned(call, headers, raw)

    async def admit_planned(self, call: Call, headers: Headers, raw: bytes) -> dict[str, Any]:
        """For an identified team's body: the plan, then budgets, limits, fair share and span.

        Returns the body to forward; raises Refusal with the answer otherwise.
        """
        planned = plan(
            self.view,
            call.endpoint,
            raw,
            default_reserve_tokens=self.settings.default_reserve_tokens,
            metering_down=self.accounting.refusing,
        )
        if isinstance(planned, Refusal):
            if planned.model is not None:
                call.model = planned.model
            raise planned
        call.model, call.served_version, call.stream = (
            planned.model,
            planned.served_version,
            planned.stream,
        )
        call.client_usage, call.client_continuous = planned.client_usage, planned.client_continuous
        call.prefix, call.choices, call.user = planned.prefix, planned.choices, planned.user
        try:
            call.project = project_of(self.view.projects, call.team, headers)
        except TagRefusal as exc:
            raise tag_refusal(exc) from None
        try:
            verdict = self.budgets.check(call.team, call.model, call.project)
        except BudgetExceeded as exc:
            raise Refusal(
                429, str(exc), "insufficient_quota", "budget_exceeded", RequestStatus.RATE_LIMITED
            ) from None
        try:
            call.admission = await self.limiter.admit(call.team, planned.reserve_tokens)
        except LimitExceeded as exc:
            raise self._rate_limited(call, exc) from None
        except LimitsUnavailable as exc:
            raise Refusal(
                503,
                str(exc),
                "server_error",
                "limits_unavailable",
                RequestStatus.REJECTED,
                (("retry-after", str(max(1, math.ceil(exc.retry_after_seconds)))),),
            ) from None
        call.admission.headers += verdict.headers
        # In flight from the moment it holds an admission, which is exactly when _release
        # decrements: nothing between the two can skip one of them.
        self.metrics.child(self.metrics.in_flight, call.team, call.model).inc()
        if self.fair is not None:
            call.slot = await self._fair_slot(call.team, planned.sequences)
        if self.tracer is not None:
            call.span = self._start_span(call, headers, planned)
        return planned.body

    def _start_span(self, call: Call, headers: Headers, planned: Plan) -> trace.Span:
        assert self.tracer is not None
        operation = GENERATE[call.endpoint]
        body = planned.body
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        return self.tracer.start_span(
            f"{operation} {call.model}",
            context=tracing.extract({k.decode("latin-1"): v.decode("latin-1") for k, v in headers}),
            kind=trace.SpanKind.SERVER,
            # The span is made once the request is admitted, but it is the request's: it starts
            # when the request came in, so the wait for a batch slot (and the body, the checks)
            # are in it, as in the duration and time to first chunk it carries.
            start_time=int(call.received_at * 1_000_000_000),
            attributes={
                tracing.OPERATION: operation,
                tracing.PROVIDER: "vllm",
                tracing.REQUEST_MODEL: planned.requested,
                tracing.TEAM: call.team,
                tracing.REPLICA: self.replica_id,
                tracing.REQUEST_STREAM: call.stream,
                **tracing.server_attributes(self.view.replica.upstream_url),
                **({tracing.REQUEST_MAX_TOKENS: limit} if type(limit) is int else {}),
                **({tracing.END_USER: call.user} if call.user is not None else {}),
                **({tracing.PROJECT: call.project} if call.project is not None else {}),
            },
        )

    async def _fair_slot(self, team: str, sequences: int) -> Slot:
        assert self.fair is not None
        try:
            return await self.fair.acquire(team, sequences)
        except QueueFull:
            raise Refusal(
                429,
                "Too many of your requests are waiting for this replica.",
                "requests",
                "rate_limit_exceeded",
                RequestStatus.RATE_LIMITED,
                (("retry-after", "1"),),
            ) from None
        except WaitTimeout:
            wait = str(max(1, round(self.settings.fair_wait_timeout_seconds)))
            raise Refusal(
                503,
                "The replica is busy; no batch slot came free in time.",
                "server_error",
                "replica_busy",
                RequestStatus.REJECTED,
                (("retry-after", wait),),
            ) from None

    def _upstream_headers(self, headers: Headers, call: Call | None) -> dict[str, str]:
        out = upstream_headers(self.view, headers, self.upstream_key)
        if call is not None:
            out["content-type"] = "application/json"
            if call.span is not None:
                tracing.PROPAGATOR.inject(out, context=trace.set_span_in_context(call.span))
        return out

    def _release(self, call: Call, usage: UsageCounts | None, forwarded: bool) -> None:
        """Settle what a forwarded request used, or refund a refused one's admission whole."""
        if call.admission is not None:
            if forwarded:
                used = (usage.prompt + usage.completion) if usage else 0
                self.limiter.settle(call.admission, used)
            else:
                self.limiter.refund(call.admission)
            self.metrics.child(self.metrics.in_flight, call.team, call.model).dec()
        if call.slot is not None:
            call.slot.release()


def _raw_writer(scope: Scope) -> RawWriter | None:
    """The client connection's raw writer (``infermeter.http_guard``), when the server gave one."""
    raw: RawWriter | None = scope.get("extensions", {}).get(RAW_WRITER)
    return raw
