"""The sidecar: a metering, team-aware streaming proxy in front of one vLLM replica.

Plain ASGI, because every token of every user passes through ``_relay_stream`` and a framework's
per-message machinery would cost more than the work itself. The path of one request:

    identify team -> read and check body -> route model -> team limits -> fair batch slot
    -> forward (aiohttp, streamed) -> meter and rewrite chunks -> usage record durable in the spool
    -> final ``data: [DONE]`` (or the whole body) -> settle limits, metrics, span

A record is on disk before the client sees the end of its response, so a response a client saw
complete is never lost, even if the sidecar is killed right after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
import orjson
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import generate_latest

from infermeter.asgi import Receive, Scope, Send, header, read_body, respond
from infermeter.auth import AuthError, bearer_key
from infermeter.config import Config
from infermeter.errors import error_body, sse_error_event
from infermeter.http_guard import ServerLimits
from infermeter.identity import Identity, identity_from_environment
from infermeter.ids import request_id
from infermeter.journal import JOURNAL_DIR, recover
from infermeter.records import RequestStatus, UsageRecord
from infermeter.replay import ReplayCache
from infermeter.spool import Spool, SpoolError
from infermeter.spooldir import BUDGET_OVERRIDES
from sidecar import tracing
from sidecar.assemble import Assembler, answer, assemblable, streamed_body
from sidecar.bounds import capped, label
from sidecar.budgets import BudgetExceeded, budget_gate, serve_override
from sidecar.drain import Drain
from sidecar.fairness import FairShare, QueueFull, Slot, WaitTimeout
from sidecar.journal import AdmissionJournal, JournalError
from sidecar.lifetime import EVENTS_MAX_BYTES, Lifetime, last_shipment
from sidecar.limits import Admission, LimitExceeded, estimate_prompt_tokens
from sidecar.metrics import SidecarMetrics
from sidecar.models_list import with_aliases
from sidecar.prefix import Prefix, prefix_of
from sidecar.request_ids import client_request_id, response_id
from sidecar.shared_fairness import FairShareSync
from sidecar.state import ModelNotFoundError, View, build_view
from sidecar.stream import StreamMeter, UsageCounts, parse_usage
from sidecar.team_limits import LimitsUnavailable, shared_redis, team_limiter, team_limits
from sidecar.upstream import UPSTREAM_ERRORS, StallWatch, Upstream, upstream_failure

if TYPE_CHECKING:
    from infermeter.shipper import Shipper

__all__ = ["Sidecar"]

log = logging.getLogger("infermeter.sidecar")


_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream; charset=utf-8")
_GENERATE = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}
# Headers never passed upstream: hop-by-hop ones, the caller's credentials, and what httpx sets.
_DROP = frozenset({b"authorization", b"host", b"content-length", b"connection", b"keep-alive",
                   b"transfer-encoding", b"te", b"upgrade", b"proxy-authorization", b"accept-encoding"})  # fmt: skip
_NEEDS_METRICS_TOKEN = error_body(401, "The metrics endpoint needs the metrics or admin token.",
                                  "invalid_request_error", "invalid_api_key")  # fmt: skip
# Refusals decided before admission; each still costs one of the team's requests per minute.
_CHARGED_REFUSALS = frozenset({400, 404, 408, 413})
_DROP_DOWN = frozenset(
    {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"date", b"server"}
)


class _Reject(Exception):
    """An answer decided before forwarding: status, OpenAI error and extra headers."""

    def __init__(self, status: int, message: str, err_type: str, code: str | None,
                 record_status: RequestStatus, headers: tuple[tuple[str, str], ...] = (),
                 param: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.err_type, self.code = status, message, err_type, code
        self.record_status, self.headers, self.param = record_status, headers, param


@dataclass
class _Call:
    """Everything known about one request while it is served."""

    request_id: str
    endpoint: str
    received_at: float
    started: float
    team: str = ""
    model: str = ""
    served_version: str = ""
    stream: bool = False
    admission: Admission | None = None
    slot: Slot | None = None
    span: trace.Span | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    # The caller's own x-request-id (when valid) and vLLM's id for the response.
    client_request_id: str | None = None
    response_id: str | None = None
    prefix: Prefix | None = None


class Sidecar:
    """One replica's sidecar: state, background tasks and the ASGI entry point."""

    def __init__(self, config: Config, replica_id: str, *, spool_dir: Path | None = None,
                 tracer_provider: TracerProvider | None = None, client: httpx.AsyncClient | None = None,
                 identity: Identity | None = None, engine_metrics_url: str | None = None) -> None:  # fmt: skip
        """``identity``: the instance fronted (default: the fixed replica); ``spool_dir``: its spool."""
        self.replica_id = replica_id
        gateway = config.sidecar.gateway
        # Outlives reloads: a new view must not forget which signed requests were served.
        self.replay = ReplayCache(gateway.max_skew_seconds, gateway.replay_cache_entries)
        self.view: View = build_view(config, replica_id, self.replay)
        settings = config.sidecar
        self.settings = settings
        self.upstream = self.view.replica.upstream_url.rstrip("/")
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
        self.spool = Spool(directory, max_bytes=settings.spool_max_bytes)
        # Overrides are few (an admin's hand): the lifetime events' bound is ample.
        self.override_spool = Spool(directory / BUDGET_OVERRIDES, max_bytes=EVENTS_MAX_BYTES)
        self.budgets = budget_gate(settings.budgets, {t.name: t.budget_usd_per_month for t in config.teams},
                                   self.metrics.registry, os.environ.get(settings.budgets.spend_token_env),
                                   shared_redis(self.limiter), settings.shared_limits.key_prefix,
                                   self.override_spool, self.identity.instance)  # fmt: skip
        self.lifetime = Lifetime(self.identity, directory, settings.heartbeat_seconds,
                                 self.view.replica.gpu_count, engine_metrics_url, self.metrics.registry)  # fmt: skip
        self.spool_broken = False
        self.journal = AdmissionJournal(
            self.spool.directory / JOURNAL_DIR, settings.journal_mark_millis / 1000
        )
        self.drain = Drain()
        self.tracer = tracing.tracer(tracer_provider)
        self.upstream_key = os.environ.get(settings.upstream_api_key_env) or None
        timeout = httpx.Timeout(
            settings.read_timeout_seconds, connect=settings.connect_timeout_seconds
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        self.client = client or httpx.AsyncClient(timeout=timeout, limits=limits)
        self.generation = Upstream(settings.connect_timeout_seconds, settings.read_timeout_seconds)
        self.ingest_url = settings.ingest_url
        self.ingest_token = os.environ.get(settings.ingest_token_env) or None
        self._tasks: list[asyncio.Task[None]] = []
        self._shippers: list[Shipper] = []

    @property
    def server_limits(self) -> ServerLimits:
        """What the HTTP server in front of this sidecar allows a client (``sidecar.*``)."""
        s = self.settings
        return ServerLimits(header_timeout_seconds=s.header_timeout_seconds,
                            max_connections=s.max_connections)  # fmt: skip

    # -- life cycle ------------------------------------------------------------------------------

    async def startup(self) -> None:
        """Take the spool directory, open the spools, record what a killed predecessor left
        running, start the shippers, announce the start."""
        await self.lifetime.claim()
        await self.limiter.start()
        if self.settings.budgets.spend_url:
            self._tasks.append(asyncio.get_running_loop().create_task(self.budgets.run()))
        if (redis := shared_redis(self.limiter)) is not None and self.fair is not None:
            sync = FairShareSync(redis, self.fair, self.settings.shared_limits.key_prefix,
                                 self.replica_id, self.identity.instance)  # fmt: skip
            self._tasks.append(asyncio.get_running_loop().create_task(sync.run()))
        self.spool.open()
        self.override_spool.open()
        await recover(self.journal.open(), self.spool)
        self.metrics.spool_backlog.set_function(lambda: self.spool.backlog)
        if self.ingest_url:
            from infermeter.shipper import Shipper, ShipperMetrics

            shipped = ShipperMetrics(self.metrics.registry)
            for spool, kind in ((self.spool, "usage"), (self.lifetime.spool, "instances"),
                                (self.override_spool, "budget_overrides")):  # fmt: skip
                shipper = Shipper(spool, self.ingest_url, self.ingest_token, kind, self.client,
                                  metrics=shipped)  # fmt: skip
                self._shippers.append(shipper)
                self._tasks.append(asyncio.get_running_loop().create_task(shipper.run()))
        await self.lifetime.start()

    async def shutdown(self) -> None:
        """Record requests left running, announce the stop, ship the spools, let them go."""
        await self._stop_tasks()
        for record in self.journal.interrupted_now():
            with contextlib.suppress(SpoolError):
                await self.spool.append(record.to_json())
                self.journal.finish(record.request_id)
        await self.lifetime.stop()
        await self.ship_remaining(self.settings.drain_ship_seconds)
        await self.journal.close()
        await self.spool.close()
        await self.override_spool.close()
        await self.lifetime.close()
        self.lifetime.release()
        await self.limiter.close()
        await self.budgets.close()
        await self.client.aclose()
        await self.generation.close()

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
        await self.spool.seal()
        await self.lifetime.spool.seal()
        await last_shipment(self._shippers, max_seconds)
        if self.spool.backlog:  # what is not shipped stays spooled for the next start
            log.error("%d record(s) left unshipped in the spool at exit", self.spool.backlog)

    def reload(self, config: Config) -> None:
        """Apply a new configuration without a restart (keys, limits, approved models)."""
        self.view = build_view(config, self.replica_id, self.replay)
        self.limiter.configure(team_limits(config))
        self.budgets.budgets = {t.name: t.budget_usd_per_month for t in config.teams}
        if self.fair is not None:
            self.fair.priorities = {t.name: t.priority for t in config.teams}

    # -- ASGI ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route a request: the OpenAI API, or one of the sidecar's own endpoints."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in _GENERATE and method == "POST":
            await self._generate(scope, receive, send, path)
        elif path == "/v1/models" and method == "GET":
            await self._models(scope, send)
        elif path == "/metrics" and method == "GET":
            await self._metrics(scope, send)
        elif path == "/engine/metrics" and method == "GET":
            await self._engine_metrics(scope, send)
        elif path == "/v1/admin/budget-overrides" and method == "POST":
            await serve_override(self.budgets, self.view.control, scope, receive, send)
        elif path == "/healthz":
            await respond(send, 200, b'{"status":"ok"}', [_JSON])
        elif path == "/readyz":
            await self._ready(send)
        else:
            await respond(send, 404, error_body(404, f"Unknown request URL: {method} {path}.",
                                                 "invalid_request_error", "unknown_url"), [_JSON])  # fmt: skip

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
            self.view.control.team_for(bearer_key(header(scope, b"authorization")))
        except AuthError:
            return False
        return True

    async def _metrics(self, scope: Scope, send: Send) -> None:
        if not self._control_allowed(scope):
            await respond(send, 401, _NEEDS_METRICS_TOKEN, [_JSON])
            return
        if self.fair is not None:
            for team in self.fair.in_flight:
                self.metrics.fair_waiting.labels(team).set(self.fair.waiting(team))
        body = generate_latest(self.metrics.registry)
        await respond(
            send, 200, body, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        )

    async def _engine_metrics(self, scope: Scope, send: Send) -> None:
        # vLLM listens on loopback only (it serves some routes without its API key), so its
        # own metrics page is reached here, behind the same token as the sidecar's.
        if not self._control_allowed(scope):
            await respond(send, 401, _NEEDS_METRICS_TOKEN, [_JSON])
            return
        try:
            r = await self.client.get(f"{self.upstream}/metrics", timeout=10.0)
        except httpx.HTTPError as exc:
            status, body = upstream_failure(exc)
            await respond(send, status, body, [_JSON])
            return
        kind = r.headers.get("content-type", "text/plain; version=0.0.4; charset=utf-8")
        await respond(send, r.status_code, r.content, [(b"content-type", kind.encode("latin-1"))])

    async def _ready(self, send: Send) -> None:
        problems = []
        try:
            r = await self.client.get(f"{self.upstream}/health", timeout=2.0)
            if r.status_code != 200:
                problems.append(f"upstream /health answered {r.status_code}")
        except httpx.HTTPError as exc:
            problems.append(f"upstream unreachable: {type(exc).__name__}")
        if self.spool_broken and self.settings.on_spool_failure == "refuse":
            problems.append("usage spool is not writable")
        if self.drain.draining:
            problems.append("shutting down: draining running requests")
        status = 503 if problems else 200
        await respond(
            send, status, orjson.dumps({"ready": not problems, "problems": problems}), [_JSON]
        )

    async def _models(self, scope: Scope, send: Send) -> None:
        try:
            self._identify(scope)
        except AuthError as exc:
            await respond(
                send, 401, error_body(401, str(exc), "invalid_request_error", exc.code), [_JSON]
            )
            return
        try:
            r = await self.client.get(
                f"{self.upstream}/v1/models", headers=self._upstream_headers(scope, None)
            )
        except httpx.HTTPError as exc:
            status, body = upstream_failure(exc)
            await respond(send, status, body, [_JSON])
            return
        body = with_aliases(r.content, self.view) if r.status_code == 200 else r.content
        await respond(send, r.status_code, body, [_JSON])

    # -- generation endpoints --------------------------------------------------------------------

    def _gateway_signed(self, scope: Scope) -> bool:
        gateway = self.view.gateway
        return gateway is not None and header(scope, gateway.team_header.encode()) is not None

    def _identify(self, scope: Scope, body: bytes = b"") -> str:
        """The calling team, by its key or, in gateway mode, by a signature over the request."""
        view = self.view
        if view.gateway is not None and self._gateway_signed(scope):
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            return view.gateway.team_for(headers, scope["method"], scope["path"], body)
        return view.keys.team_for(bearer_key(header(scope, b"authorization")))

    async def _generate(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        received_at = time.time()
        call = _Call(request_id(received_at), path, received_at, time.perf_counter())
        call.client_request_id = client_request_id(header(scope, b"x-request-id"))
        meter: StreamMeter | None = None
        usage: UsageCounts | None = None
        status = RequestStatus.OK
        http_status = 200
        finish: str | None = None
        try:
            body = await self._admit(call, scope, receive)
            self._enter(call)
            if call.stream:
                meter, status, http_status = await self._relay_stream(
                    call, scope, receive, send, body
                )
                usage, finish = meter.usage, meter.finish_reason
            else:
                usage, status, http_status, finish = await self._relay_whole(
                    call, scope, receive, send, body
                )
        except _Reject as refused:
            rej = refused
            if call.team and call.admission is None and rej.status in _CHARGED_REFUSALS:
                rej = await self._charge_refusal(call, rej)
            status, http_status = rej.record_status, rej.status
            headers = [_JSON, *((k.encode(), v.encode()) for k, v in rej.headers),
                       *_echo_headers(call)]  # fmt: skip
            body_err = error_body(rej.status, rej.message, rej.err_type, rej.code, rej.param)
            if call.team:
                with contextlib.suppress(SpoolError):
                    await self._record(call, status, http_status, None, None, None)
            await respond(send, rej.status, body_err, headers)
            self._account(call, status, None, None)
            return
        finally:
            self._release(call, usage)
        self._account(call, status, usage, meter, finish)

    def _enter(self, call: _Call) -> None:
        """The last step before forwarding: refuse while draining, else journal the admission."""
        if self.drain.draining:
            raise _Reject(503, "The sidecar is shutting down; send the request again.", "server_error",
                          "server_shutting_down", RequestStatus.REJECTED, (("retry-after", "1"),))  # fmt: skip
        try:
            self.journal.admit(self._usage_record(call, RequestStatus.INTERRUPTED, 502, None, None, None), call.started)  # fmt: skip
        except JournalError as exc:
            self.metrics.spool_errors.inc()
            if self.settings.on_spool_failure == "refuse":
                raise _Reject(503, "Usage metering is unavailable; the request was not served.",
                              "server_error", "metering_unavailable", RequestStatus.REJECTED) from None  # fmt: skip
            log.error(
                "%s; request %s would go unrecorded if the sidecar died", exc, call.request_id
            )

    async def _charge_refusal(self, call: _Call, rej: _Reject) -> _Reject:
        """A refusal takes one of the team's requests; past the limit it becomes a 429."""
        try:
            await self.limiter.take_request(call.team)
        except LimitExceeded as exc:
            return self._rate_limited(call, exc)
        except LimitsUnavailable:
            pass
        return rej

    def _rate_limited(self, call: _Call, exc: LimitExceeded) -> _Reject:
        self.metrics.rate_limited.labels(call.team, exc.reason).inc()
        headers = (("retry-after", str(max(1, round(exc.retry_after_seconds)))), *exc.headers)
        return _Reject(429, str(exc), "requests" if exc.reason == "requests" else "tokens",
                       "rate_limit_exceeded", RequestStatus.RATE_LIMITED, headers)  # fmt: skip

    async def _read(self, receive: Receive) -> bytes:
        """The request body, or the 408 or 413 refusal of a body too slow or too large."""
        limit = self.settings.max_body_bytes
        try:
            raw = await read_body(receive, limit, self.settings.body_timeout_seconds)
        except TimeoutError:
            raise _Reject(408, "The request body did not arrive in time.", "invalid_request_error",
                          "request_timeout", RequestStatus.BAD_REQUEST) from None  # fmt: skip
        if raw is None:
            raise _Reject(413, f"Request body exceeds {limit} bytes.", "invalid_request_error",
                          "request_too_large", RequestStatus.BAD_REQUEST)  # fmt: skip
        return raw

    async def _admit(self, call: _Call, scope: Scope, receive: Receive) -> dict[str, Any]:
        """Everything before forwarding; raises _Reject with the answer otherwise."""
        # A gateway's signature covers the body, so that body is read first; a key is checked
        # before a byte of the body is read.
        signed = self._gateway_signed(scope)
        raw = await self._read(receive) if signed else b""
        try:
            call.team = self._identify(scope, raw)
        except AuthError as exc:
            raise _Reject(
                401, str(exc), "invalid_request_error", exc.code, RequestStatus.UNAUTHORIZED
            ) from None
        if not signed:
            raw = await self._read(receive)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _Reject(400, f"We could not parse the JSON body of your request. ({exc})",
                          "invalid_request_error", "invalid_json", RequestStatus.BAD_REQUEST) from None  # fmt: skip
        if not isinstance(body, dict):
            raise _Reject(400, "The request body must be a JSON object.", "invalid_request_error",
                          "invalid_json", RequestStatus.BAD_REQUEST)  # fmt: skip
        if not isinstance(body.get("stream_options", {}), dict | None):
            # It is read below to rewrite the stream; vLLM refuses it anyway.
            raise _Reject(400, "'stream_options' must be an object or null.", "invalid_request_error",
                          "invalid_type", RequestStatus.BAD_REQUEST, param="stream_options")  # fmt: skip
        requested = body.get("model")
        try:
            route = self.view.route(requested if isinstance(requested, str) else None)
        except ModelNotFoundError as exc:
            call.model = capped(str(requested))
            raise _Reject(
                404, str(exc), "invalid_request_error", "model_not_found", RequestStatus.REJECTED
            ) from None
        call.model, call.served_version = route.model, route.served_version
        call.prefix = prefix_of(self.view.prefix, body)
        call.stream = bool(body.get("stream")) and call.endpoint != "/v1/embeddings"
        options = body.get("stream_options") or {}
        if self.spool_broken and self.settings.on_spool_failure == "refuse":
            raise _Reject(503, "Usage metering is unavailable; the request was not served.",
                          "server_error", "metering_unavailable", RequestStatus.REJECTED)  # fmt: skip
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        n_raw = body.get("n")
        n = n_raw if isinstance(n_raw, int) else 1
        out = (
            max_tokens
            if isinstance(max_tokens, int) and max_tokens > 0
            else self.settings.default_reserve_tokens
        )
        reserve = estimate_prompt_tokens(len(raw)) + out * max(1, n)
        try:
            verdict = self.budgets.check(call.team, call.model)
        except BudgetExceeded as exc:
            raise _Reject(
                429, str(exc), "insufficient_quota", "budget_exceeded", RequestStatus.RATE_LIMITED
            ) from None
        try:
            call.admission = await self.limiter.admit(call.team, reserve)
        except LimitExceeded as exc:
            raise self._rate_limited(call, exc) from None
        except LimitsUnavailable as exc:
            raise _Reject(503, str(exc), "server_error", "limits_unavailable", RequestStatus.REJECTED,
                          (("retry-after", str(max(1, math.ceil(exc.retry_after_seconds)))),)) from None  # fmt: skip
        call.admission.headers += verdict.headers
        # In flight from the moment it holds an admission, which is exactly when _release
        # decrements: nothing between the two can skip one of them.
        self.metrics.in_flight.labels(call.team, call.model).inc()
        body["model"] = route.served_version
        if call.stream:
            call.headers.append(
                (b"x-infermeter-client-usage", b"1" if options.get("include_usage") else b"0")
            )
            call.headers.append((b"x-infermeter-client-continuous",
                                 b"1" if options.get("include_usage") and options.get("continuous_usage_stats") else b"0"))  # fmt: skip
            body["stream_options"] = {
                **options,
                "include_usage": True,
                "continuous_usage_stats": True,
            }
        if self.fair is not None:
            call.slot = await self._fair_slot(call.team)
        if self.tracer is not None:
            call.span = self.tracer.start_span(
                f"{_GENERATE[call.endpoint]} {call.model}",
                context=tracing.extract(
                    {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
                ),
                kind=trace.SpanKind.SERVER,
                attributes={
                    tracing.OPERATION: _GENERATE[call.endpoint],
                    tracing.PROVIDER: "vllm",
                    tracing.REQUEST_MODEL: str(requested or call.model),
                    tracing.TEAM: call.team,
                    tracing.REPLICA: self.replica_id,
                    tracing.REQUEST_STREAM: call.stream,
                },
            )
        return body

    async def _fair_slot(self, team: str) -> Slot:
        assert self.fair is not None
        try:
            return await self.fair.acquire(team)
        except QueueFull:
            raise _Reject(429, "Too many of your requests are waiting for this replica.", "requests",
                          "rate_limit_exceeded", RequestStatus.RATE_LIMITED, (("retry-after", "1"),)) from None  # fmt: skip
        except WaitTimeout:
            wait = str(max(1, round(self.settings.fair_wait_timeout_seconds)))
            raise _Reject(503, "The replica is busy; no batch slot came free in time.", "server_error",
                          "replica_busy", RequestStatus.REJECTED, (("retry-after", wait),)) from None  # fmt: skip

    def _upstream_headers(self, scope: Scope, call: _Call | None) -> dict[str, str]:
        # The gateway's signed headers, and anything in the sidecar's own x-infermeter-*
        # namespace, stay here: vLLM learns nothing of who called or how they proved it.
        gateway = self.view.gateway
        signed = frozenset(h.lower().encode() for h in gateway.headers) if gateway else frozenset()
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k not in _DROP and k not in signed and not k.startswith(b"x-infermeter-")
        }
        if "x-request-id" in headers and client_request_id(header(scope, b"x-request-id")) is None:
            del headers["x-request-id"]
        if self.upstream_key:
            headers["authorization"] = f"Bearer {self.upstream_key}"
        if call is not None and call.span is not None:
            tracing.PROPAGATOR.inject(headers, context=trace.set_span_in_context(call.span))
        return headers

    async def _open_upstream(
        self, call: _Call, scope: Scope, body: dict[str, Any]
    ) -> aiohttp.ClientResponse:
        headers = self._upstream_headers(scope, call)
        headers["content-type"] = "application/json"
        try:
            return await self.generation.post(
                self.upstream + call.endpoint, orjson.dumps(body), headers
            )
        except UPSTREAM_ERRORS as exc:
            status, message = upstream_failure(exc)
            raise _Reject(status, orjson.loads(message)["error"]["message"], "upstream_error",
                          "upstream_unreachable" if status == 502 else "upstream_timeout", RequestStatus.UPSTREAM_ERROR) from None  # fmt: skip

    async def _relay_whole(
        self, call: _Call, scope: Scope, receive: Receive, send: Send, body: dict[str, Any]
    ) -> tuple[UsageCounts | None, RequestStatus, int, str | None]:
        if self.settings.non_streamed_via_stream and assemblable(call.endpoint, body):
            return await self._relay_assembled(call, scope, receive, send, body)

        async def exchange() -> tuple[aiohttp.ClientResponse, bytes]:
            response = await self._open_upstream(call, scope, body)
            try:
                content = await response.read()
            except BaseException:
                response.close()
                raise
            response.release()
            return response, content

        # vLLM sends nothing, not even headers, until a non-streamed completion is done, so the
        # whole exchange is raced against the client leaving.
        loop = asyncio.get_running_loop()
        work = loop.create_task(exchange())
        watcher = loop.create_task(_wait_disconnect(receive))
        await asyncio.wait((work, watcher, self.drain.cut), return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not work.done() and not watcher.done():
            return await self._cut_whole(call, work, send)
        if not work.done():
            # Cancelling closes the upstream connection, which makes vLLM abort the request.
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, *UPSTREAM_ERRORS, _Reject):
                await work
            with contextlib.suppress(SpoolError):
                await self._record(call, RequestStatus.CLIENT_ABORTED, 499, None, None, None)
            return None, RequestStatus.CLIENT_ABORTED, 499, None
        try:
            response, content = work.result()
        except UPSTREAM_ERRORS as exc:
            code, message = upstream_failure(exc)
            raise _Reject(
                code,
                orjson.loads(message)["error"]["message"],
                "upstream_error",
                "upstream_error",
                RequestStatus.UPSTREAM_ERROR,
            ) from None
        usage = finish = None
        call.response_id = response_id(content)
        at = content.find(b'"usage":{')
        if at >= 0:
            usage = parse_usage(content[at:])
        if response.status == 200:
            status = RequestStatus.OK
            i = content.find(b'"finish_reason":"')
            if i >= 0:
                i += len(b'"finish_reason":"')
                finish = content[i : content.find(b'"', i)].decode()
        else:
            status = (
                RequestStatus.BAD_REQUEST if response.status < 500 else RequestStatus.UPSTREAM_ERROR
            )
        try:
            await self._record(call, status, response.status, usage, None, finish)
        except SpoolError:
            raise _Reject(503, "Usage metering is unavailable; the response was withheld.", "server_error",
                          "metering_unavailable", RequestStatus.REJECTED) from None  # fmt: skip
        await respond(send, response.status, content, _whole_headers(call, response.raw_headers))
        return usage, status, response.status, finish

    async def _cut_whole(self, call: _Call, work: asyncio.Task[Any], send: Send,
                         assembler: Assembler | None = None) -> tuple[
            UsageCounts | None, RequestStatus, int, str | None]:  # fmt: skip
        """End a non-streamed request still running past the drain: 503 and its record.

        With ``assembler`` (the request was read as a stream), the record has the tokens vLLM
        had spent when it was cut.
        """
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, *UPSTREAM_ERRORS, _Reject):
            await work
        usage = None
        if assembler is not None:
            call.response_id = assembler.response_id
            usage = assembler.usage_so_far()
        with contextlib.suppress(SpoolError):
            await self._record(call, RequestStatus.INTERRUPTED, 503, usage, None, None)
        await respond(send, 503, error_body(503, "The sidecar shut down before the response was complete.",
                                            "server_error", "server_shutting_down"),
                      [_JSON, (b"retry-after", b"1"), (b"x-infermeter-request-id", call.request_id.encode())])  # fmt: skip
        return usage, RequestStatus.INTERRUPTED, 503, None

    async def _relay_assembled(
        self, call: _Call, scope: Scope, receive: Receive, send: Send, body: dict[str, Any]
    ) -> tuple[UsageCounts | None, RequestStatus, int, str | None]:
        """A non-streamed request served from vLLM's stream (``sidecar.assemble``)."""
        n = body.get("n")
        assembler = Assembler(call.endpoint, n if isinstance(n, int) and n > 0 else 1)

        async def exchange() -> tuple[aiohttp.ClientResponse, bytes | None]:
            response = await self._open_upstream(call, scope, streamed_body(body))
            try:
                # A refusal before any SSE is the same JSON error as for the whole request.
                streamed = response.status == 200 and response.content_type == "text/event-stream"
                whole = None if streamed else await response.read()
                if streamed:
                    await self._collect(response, assembler)
            except BaseException:
                response.close()
                raise
            response.release()
            return response, whole

        loop = asyncio.get_running_loop()
        work = loop.create_task(exchange())
        watcher = loop.create_task(_wait_disconnect(receive))
        await asyncio.wait((work, watcher, self.drain.cut), return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not work.done() and not watcher.done():
            return await self._cut_whole(call, work, send, assembler)
        if not work.done():
            # Cancelling closes the upstream connection, which makes vLLM abort the request;
            # the tokens it spent until then are in the last chunk read.
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, *UPSTREAM_ERRORS, _Reject):
                await work
            call.response_id = assembler.response_id
            usage = assembler.usage_so_far()
            with contextlib.suppress(SpoolError):
                await self._record(call, RequestStatus.CLIENT_ABORTED, 499, usage, None, None)
            return usage, RequestStatus.CLIENT_ABORTED, 499, None
        call.response_id = assembler.response_id
        try:
            response, whole = work.result()
        except UPSTREAM_ERRORS as exc:
            code, message = upstream_failure(exc)
            usage = assembler.usage_so_far()
            with contextlib.suppress(SpoolError):
                await self._record(call, RequestStatus.UPSTREAM_ERROR, code, usage, None, None)
            await respond(send, code, message, [_JSON, *_echo_headers(call)])
            return usage, RequestStatus.UPSTREAM_ERROR, code, None
        out = answer(response.status, whole, assembler)
        if whole is not None:
            call.response_id = response_id(whole)
        finish = assembler.finish_reason
        try:
            await self._record(call, out.status, out.http_status, out.usage, None, finish)
        except SpoolError:
            raise _Reject(503, "Usage metering is unavailable; the response was withheld.", "server_error",
                          "metering_unavailable", RequestStatus.REJECTED) from None  # fmt: skip
        # The stream's own content type gives way to the one vLLM gives a whole answer.
        raw = response.raw_headers
        if whole is None:
            raw = ((b"content-type", b"application/json"), *((k, v) for k, v in raw if k.lower() != b"content-type"))  # fmt: skip
        await respond(send, out.http_status, out.body, _whole_headers(call, raw))
        return out.usage, out.status, out.http_status, finish

    async def _collect(self, response: aiohttp.ClientResponse, assembler: Assembler) -> None:
        """Read a stream to its end into ``assembler``; the read timeout is per read, as streamed."""
        watch = StallWatch(response, self.generation.read_timeout_seconds)
        clock = time.perf_counter
        read = response.content.readany
        try:
            while not assembler.done:
                watch.waiting_since = clock()
                block = await read()
                watch.waiting_since = None
                if not block:
                    break
                assembler.feed(block)
            if assembler.done:
                # Read past [DONE] to the chunked terminator, so the connection can be reused.
                while await read():
                    pass
        finally:
            watch.cancel()

    async def _relay_stream(
        self, call: _Call, scope: Scope, receive: Receive, send: Send, body: dict[str, Any]
    ) -> tuple[StreamMeter, RequestStatus, int]:
        response = await self._open_upstream(call, scope, body)
        if response.status != 200:
            # vLLM refuses bad streamed requests with a JSON error before any SSE: pass it on.
            try:
                content = await response.read()
            finally:
                response.release()
            status = (
                RequestStatus.BAD_REQUEST if response.status < 500 else RequestStatus.UPSTREAM_ERROR
            )
            meter = StreamMeter(False, False, call.started)
            at = content.find(b'"usage":{')
            meter.usage = parse_usage(content[at:]) if at >= 0 else None
            await self._record(call, status, response.status, meter.usage, None, None)
            await respond(send, response.status, content,
                          [_JSON, *_echo_headers(call), *_ratelimit_headers(call)])  # fmt: skip
            return meter, status, response.status
        flags = dict(call.headers)
        meter = StreamMeter(flags.get(b"x-infermeter-client-usage") == b"1",
                            flags.get(b"x-infermeter-client-continuous") == b"1", call.started)  # fmt: skip
        self.journal.track(call.request_id, meter)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [_SSE, (b"x-infermeter-request-id", call.request_id.encode()),
                                *_echo_headers(call), *_ratelimit_headers(call)]})  # fmt: skip
        watch = StallWatch(response, self.generation.read_timeout_seconds)
        relay = asyncio.get_running_loop().create_task(self._pump(response, meter, send, watch))
        watcher = asyncio.get_running_loop().create_task(_wait_disconnect(receive))
        status = RequestStatus.OK
        read_to_end = False
        try:
            await asyncio.wait(
                (relay, watcher, self.drain.cut), return_when=asyncio.FIRST_COMPLETED
            )
            if not relay.done():
                relay.cancel()
                status = (
                    RequestStatus.CLIENT_ABORTED if watcher.done() else RequestStatus.INTERRUPTED
                )
                with contextlib.suppress(asyncio.CancelledError):
                    await relay
            elif (exc := relay.exception()) is None:
                read_to_end = True
            elif not meter.done:
                # (A failure after [DONE], while reading the terminator, loses nothing.)
                status = RequestStatus.UPSTREAM_ERROR
                log.warning("upstream failed mid-stream on %s: %s", self.replica_id, exc)
        finally:
            watcher.cancel()
            watch.cancel()
            if read_to_end:
                response.release()
            else:
                # Closing the connection is what makes vLLM abort the request.
                response.close()
        tail = meter.close()
        call.response_id = meter.response_id
        if status is RequestStatus.OK and not meter.done:
            status = RequestStatus.UPSTREAM_ERROR
        try:
            await self._record(call, status, 200, meter.usage, meter, meter.finish_reason)
        except SpoolError:
            # The client must not see a complete response whose usage is not durable.
            event = sse_error_event("Usage metering is unavailable; the response is incomplete.",
                                    "server_error", "metering_unavailable")  # fmt: skip
            await send({"type": "http.response.body", "body": tail + event, "more_body": False})
            return meter, RequestStatus.UPSTREAM_ERROR, 200
        if status is RequestStatus.OK:
            await send(
                {
                    "type": "http.response.body",
                    "body": tail + b"data: [DONE]\n\n",
                    "more_body": False,
                }
            )
        elif status is RequestStatus.UPSTREAM_ERROR:
            event = sse_error_event("The upstream model server stopped responding mid-stream.")
            await send({"type": "http.response.body", "body": tail + event, "more_body": False})
        elif status is RequestStatus.INTERRUPTED:
            event = sse_error_event("The sidecar shut down before the stream was complete.",
                                    "server_error", "server_shutting_down")  # fmt: skip
            await send({"type": "http.response.body", "body": tail + event, "more_body": False})
        return meter, status, 200

    @staticmethod
    async def _pump(response: aiohttp.ClientResponse, meter: StreamMeter, send: Send,
                    watch: StallWatch) -> None:  # fmt: skip
        """The per-chunk loop: read what has arrived, meter it, send what the client should see.

        It reads past ``data: [DONE]`` to the end of the response (the chunked terminator), so
        the connection goes back to the pool instead of being closed.
        """
        clock = time.perf_counter
        read = response.content.readany
        while True:
            watch.waiting_since = clock()
            block = await read()
            watch.waiting_since = None
            if not block:
                return
            if meter.done:
                # Bytes after [DONE] are not vLLM's stream: stop, and the connection is closed.
                return
            out = meter.feed(block, clock())
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})

    async def _record(self, call: _Call, status: RequestStatus, http_status: int, usage: UsageCounts | None,
                      meter: StreamMeter | None, finish: str | None) -> None:  # fmt: skip
        """Make the usage record durable; on failure follow ``on_spool_failure``."""
        record = self._usage_record(call, status, http_status, usage, meter, finish)
        try:
            await self.spool.append(record.to_json())
            self.spool_broken = False
        except SpoolError:
            self.spool_broken = True
            self.metrics.spool_errors.inc()
            if self.settings.on_spool_failure == "refuse":
                raise
            log.error(
                "serving UNMETERED: usage of request %s (team %s) is lost",
                call.request_id,
                call.team,
            )
        self.journal.finish(call.request_id)

    def _usage_record(self, call: _Call, status: RequestStatus, http_status: int, usage: UsageCounts | None,
                      meter: StreamMeter | None, finish: str | None) -> UsageRecord:  # fmt: skip
        """The request's record if it ended now like this (also its admission in the journal)."""
        exact = usage is not None or status in (RequestStatus.REJECTED, RequestStatus.RATE_LIMITED,
                                                RequestStatus.UNAUTHORIZED, RequestStatus.BAD_REQUEST)  # fmt: skip
        first = meter.first_token_at if meter else None
        record = UsageRecord(
            request_id=call.request_id, team=call.team, model=capped(call.model), served_version=call.served_version,
            replica=self.replica_id, instance=self.instance, received_at=call.received_at,
            first_token_at=None if first is None else call.received_at + (first - call.started),
            finished_at=call.received_at + (time.perf_counter() - call.started),
            prompt_tokens=usage.prompt if usage else 0, cached_prompt_tokens=usage.cached if usage else 0,
            completion_tokens=usage.completion if usage else 0, status=status.value, http_status=http_status,
            stream=call.stream, endpoint=call.endpoint, finish_reason=None if finish is None else capped(finish), usage_exact=exact,
            response_id=None if call.response_id is None else capped(call.response_id), client_request_id=call.client_request_id,
            prefix_digest=call.prefix.digest if call.prefix else None, prefix_share=call.prefix.share if call.prefix else None,
        )  # fmt: skip
        return record

    def _release(self, call: _Call, usage: UsageCounts | None) -> None:
        if call.admission is not None:
            used = (usage.prompt + usage.completion) if usage else 0
            self.limiter.settle(call.admission, used)
            self.metrics.in_flight.labels(call.team, call.model).dec()
        if call.slot is not None:
            call.slot.release()

    def _account(self, call: _Call, status: RequestStatus, usage: UsageCounts | None,
                 meter: StreamMeter | None, finish: str | None = None) -> None:  # fmt: skip
        """Metrics and span for a finished request (off the client's critical path)."""
        m = self.metrics
        team = call.team or "unknown"
        # Labels only ever take configured names, so no request can mint a series.
        labels = (team, label(call.model, self.view.model_names))
        m.requests.labels(*labels, status.value).inc()
        duration = time.perf_counter() - call.started
        if status is not RequestStatus.UNAUTHORIZED:
            m.duration.observe(labels, duration)
        if usage is not None:
            m.prompt_tokens.labels(*labels).inc(usage.prompt)
            m.completion_tokens.labels(*labels).inc(usage.completion)
            if usage.cached:
                m.cached_prompt_tokens.labels(*labels).inc(usage.cached)
        elif call.admission is not None and status in (
            RequestStatus.CLIENT_ABORTED,
            RequestStatus.UPSTREAM_ERROR,
            RequestStatus.INTERRUPTED,
        ):
            m.inexact.labels(*labels).inc()
        if meter is not None and meter.first_token_at is not None:
            m.ttft.observe(labels, meter.first_token_at - call.started)
            for gap, count in meter.itl:
                m.itl.observe(labels, gap, count)
            if (
                usage is not None
                and usage.completion > 1
                and meter.last_token_at
                and meter.last_token_at > meter.first_token_at
            ):
                m.tps.observe(
                    labels, (usage.completion - 1) / (meter.last_token_at - meter.first_token_at)
                )
        if call.span is not None:
            span = call.span
            span.set_attribute(tracing.RESPONSE_MODEL, call.served_version)
            if usage is not None:
                span.set_attribute(tracing.INPUT_TOKENS, usage.prompt)
                span.set_attribute(tracing.OUTPUT_TOKENS, usage.completion)
            if finish:
                span.set_attribute(tracing.FINISH_REASONS, [finish])
            if meter is not None and meter.first_token_at is not None:
                span.set_attribute(tracing.TIME_TO_FIRST_CHUNK, meter.first_token_at - call.started)
            if status is not RequestStatus.OK:
                span.set_status(trace.Status(trace.StatusCode.ERROR, status.value))
            span.end()


def _echo_headers(call: _Call) -> list[tuple[bytes, bytes]]:
    """The caller's own x-request-id, echoed when it sent a valid one."""
    if call.client_request_id is None:
        return []
    return [(b"x-request-id", call.client_request_id.encode())]


def _whole_headers(call: _Call, raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A whole (non-streamed) answer's headers: vLLM's own, then the sidecar's."""
    echo = _echo_headers(call)
    # vLLM may echo x-request-id itself; the caller's is sent once.
    drop = _DROP_DOWN | {b"x-request-id"} if echo else _DROP_DOWN
    headers = [(k.lower(), v) for k, v in raw if k.lower() not in drop]
    return [*headers, (b"x-infermeter-request-id", call.request_id.encode()), *echo,
            *_ratelimit_headers(call)]  # fmt: skip


def _ratelimit_headers(call: _Call) -> list[tuple[bytes, bytes]]:
    if call.admission is None:
        return []
    return [(k.encode(), v.encode()) for k, v in call.admission.headers]


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
