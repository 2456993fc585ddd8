"""``infermeter autoscale run``: read inputs, run the policy, publish, serve /metrics.

One ``Autoscaler.tick`` is the whole cycle: read one observation per model (from /metrics pages
or Prometheus), evaluate the pure policy, set the gauges, and hand the hooks every model whose
desired count differs from the last one delivered; each hook publishes in a task of its own beside
the ticks. A hook that fails is logged and tried again at the next tick; a failed read skips the tick and leaves the gauges at their last value,
so KEDA keeps the last decision instead of seeing the replicas drop to zero.

Each change of a model's desired count is logged in one line and, with ``autoscale.ingest_url``
set, written to the autoscaler's own spool (``autoscale.spool_dir``) as a ``ScalingDecision``
before the hooks hear of it, and shipped to billing like every other record, so the ledger
keeps when and why the fleet was asked to change.

Given its configuration file, the autoscaler reloads it on SIGHUP and when it changes
(``alerts.autoscale.reload``): new SLA targets and scaling policy decide from the next tick, a
file that changes what only a restart takes is refused naming it. Each reload and refusal is an
audit event, spooled under ``<autoscale.spool_dir>/audit`` and shipped to billing with the
decisions' writer credential when ``autoscale.ingest_url`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
from prometheus_client import CollectorRegistry, make_asgi_app

from alerts.autoscale.decisions import (
    LAST_SHIPMENT_SECONDS,
    DecisionShipping,
    changed_from,
    decision_record,
)
from alerts.autoscale.hooks import (
    Hook,
    HookError,
    KubernetesScaleHook,
    ScalingGauges,
    WebhookHook,
    in_cluster_api,
)
from alerts.autoscale.inputs import (
    PageError,
    PrometheusSource,
    Sample,
    Scrape,
    observations,
    observations_from_vectors,
    read_page,
    scrape_of,
)
from alerts.autoscale.local import LocalScaleHook
from alerts.autoscale.memory import HistoryFile
from alerts.autoscale.policy import (
    Decision,
    ModelLimits,
    ModelState,
    Observation,
    PolicyParams,
    evaluate,
)
from alerts.autoscale.reload import policy_of, restart_needed
from infermeter.asgi import Receive, Scope, Send, idle_lifespan, respond
from infermeter.audit_spool import AUDIT_DIR, AuditLog
from infermeter.config import Config, env_value, process_environment
from infermeter.exposure import public_key_problems
from infermeter.kubernetes import KubernetesApiError, ca_verify
from infermeter.reload import Reloader
from infermeter.serving import ensure_free, host_port, server
from infermeter.shipper import last_shipment
from infermeter.spool import Spool, SpoolError
from infermeter.writers import Role, credential_from

__all__ = [
    "Autoscaler",
    "PageReader",
    "PrometheusReader",
    "audit_log",
    "build_hooks",
    "decision_shipping",
    "history_file",
    "log_to_stderr",
    "serve_autoscaler",
]

log = logging.getLogger("infermeter.autoscale")

Clock = Callable[[], float]


class Reader(Protocol):
    """Where observations come from."""

    async def read(self) -> dict[str, Observation] | None:
        """One observation per model, or None when the inputs could not be read."""


@dataclass
class PageReader:
    """Scrapes the collector's and the sidecars' /metrics; keeps the last scrape for rates.

    A page that cannot be fetched or read (an HTML error page answered with 200) is that page
    missing for the tick; without the collector's there is no tick. Each page's trouble is logged
    when it starts and when it ends, not at every tick, and the pages unread at the last tick
    are counted in ``infermeter_autoscale_unread_pages`` (with ``gauges``).
    """

    collector_url: str
    sidecar_urls: Sequence[str]
    models: Sequence[str]
    client: httpx.AsyncClient
    token: str | None = None
    clock: Clock = time.time
    previous: Scrape | None = None
    # Pages of sidecars that come and go (the local hook's instances), read beside the fixed ones.
    instance_sidecars: Callable[[], Sequence[str]] | None = None
    gauges: ScalingGauges | None = None
    # What is wrong with each page that could not be read, while it cannot.
    _trouble: dict[str, str] = field(default_factory=dict)

    def page_urls(self) -> list[str]:
        """The sidecar pages to read: the fixed ones, then the instances' that live now.

        Counters are kept by page URL, not position, so an instance that is gone is simply not
        read, and forgotten: its place need not be kept for the others' counters.
        """
        if self.instance_sidecars is None:
            return list(self.sidecar_urls)
        fixed = set(self.sidecar_urls)
        live = dict.fromkeys(url for url in self.instance_sidecars() if url not in fixed)
        return [*self.sidecar_urls, *live]

    async def read(self) -> dict[str, Observation] | None:
        """Observations from one round of scrapes; None if the collector's page cannot be read."""
        collector = await self._page(self.collector_url)
        if collector is None:
            self._count_unread([self.collector_url])
            return None
        urls = self.page_urls()
        sidecars = await asyncio.gather(*(self._page(url) for url in urls))
        self._count_unread([self.collector_url, *urls])
        self._forget_trouble({self.collector_url, *urls})
        scrape = scrape_of(self.clock(), collector, sidecars, urls)
        result = observations(self.previous, scrape, self.models)
        self.previous = scrape
        return result

    async def _page(self, url: str) -> list[Sample] | None:
        """The samples of ``url``'s page; None when it is unreachable or unreadable."""
        try:
            samples = read_page(await self._get(url))
        except (httpx.HTTPError, PageError) as exc:
            self._note(url, str(exc) or type(exc).__name__)
            return None
        self._note(url, None)
        return samples

    async def _get(self, url: str) -> str:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            response = await self.client.get(url, headers=headers)
        except httpx.RemoteProtocolError:
            # A kept-alive connection the server closed as we reused it: one fresh try.
            response = await self.client.get(url, headers=headers)
        response.raise_for_status()
        return response.text

    def _forget_trouble(self, pages: set[str]) -> None:
        """Drop the trouble of pages no longer read (an instance gone): they will not recover."""
        for url in [url for url in self._trouble if url not in pages]:
            del self._trouble[url]

    def _count_unread(self, tried: Sequence[str]) -> None:
        if self.gauges is not None:
            self.gauges.unread_pages.set(sum(url in self._trouble for url in tried))

    def _note(self, url: str, trouble: str | None) -> None:
        """Log a page's trouble when it starts and when it ends: a flapping page is one line a
        change, and a page down for a day is not 5,760 lines."""
        if trouble is None:
            if self._trouble.pop(url, None) is not None:
                log.info("autoscale: %s is read again", url)
        elif url not in self._trouble:
            self._trouble[url] = trouble
            log.warning("autoscale: cannot read %s (missing until it is): %s", url, trouble)


@dataclass
class PrometheusReader:
    """Reads every input with PromQL instant queries."""

    source: PrometheusSource
    models: Sequence[str]
    clock: Clock = time.time

    async def read(self) -> dict[str, Observation] | None:
        """Observations from Prometheus; None if it could not answer."""
        try:
            vectors = await self.source.vectors()
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            log.warning("autoscale: Prometheus query failed: %s", exc)
            return None
        return observations_from_vectors(self.clock(), vectors, self.models)


@dataclass
class Autoscaler:
    """The policy's state between ticks, and where decisions go."""

    params: PolicyParams
    limits: dict[str, ModelLimits]
    reader: Reader
    gauges: ScalingGauges
    hooks: Sequence[Hook] = ()
    states: dict[str, ModelState] = field(default_factory=dict)
    delivered: dict[tuple[str, str], int] = field(default_factory=dict)
    memory: HistoryFile | None = None
    # Where each change is kept for billing (opened by the caller); None: the log line only.
    spool: Spool | None = None
    # Each hook's deliveries in flight: one task per hook, beside the ticks.
    _sending: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.memory is not None and not self.states:
            self.states = self.memory.load()

    def reconfigure(self, params: PolicyParams, limits: dict[str, ModelLimits]) -> None:
        """Decide with ``params`` and ``limits`` from the next tick; states and history stay."""
        self.params, self.limits = params, limits

    async def tick(self) -> dict[str, Decision]:
        """One evaluation: read, decide, set gauges, deliver changes. Never raises for I/O."""
        obs = await self.reader.read()
        if obs is None:
            return {}
        before = self.states
        decisions, self.states = evaluate(self.params, self.limits, before, obs)
        self.gauges.last_tick.set(time.time())
        for decision in decisions.values():
            previous = changed_from(decision, before.get(decision.model))
            if previous is not None:
                _log_change(decision, previous)
                await self._record(decision, previous)
        self.gauges.update(decisions)
        if self.memory is not None:
            await self.memory.maybe_save(self.states)
        self._hand_over(decisions)
        return decisions

    def _hand_over(self, decisions: dict[str, Decision]) -> None:
        """Start delivering this tick's changes to each hook that is not still busy.

        Deliveries run beside the ticks, so a receiver slow to answer (each hook waits up to its
        ``max_wait_seconds``) delays neither the next reading nor the other hooks. A hook still
        busy hears nothing new now; the first tick after it is done hands it the decisions then
        current, so it only ever hears the latest count per model.
        """
        for hook in self.hooks:
            busy = self._sending.get(hook.name)
            if busy is not None and not busy.done():
                continue
            if busy is not None and not busy.cancelled() and busy.exception() is not None:
                # What a hook raises beyond HookError would otherwise die with its task, unseen.
                self.gauges.hook_errors.labels(hook=hook.name).inc()
                log.error("autoscale: %s hook failed", hook.name, exc_info=busy.exception())
            changed = [
                d
                for d in decisions.values()
                if self.delivered.get((hook.name, d.model)) != d.desired
            ]
            if changed:
                task = asyncio.create_task(self._deliver(hook, changed), name=f"hook-{hook.name}")
                self._sending[hook.name] = task

    async def settle(self) -> None:
        """Wait for the deliveries in flight (each ends within its hook's deadline)."""
        await asyncio.gather(*self._sending.values())

    async def stop_delivering(self) -> None:
        """Cancel the deliveries in flight (on the way out); the next start delivers again."""
        for task in self._sending.values():
            task.cancel()
        await asyncio.gather(*self._sending.values(), return_exceptions=True)

    async def _record(self, decision: Decision, previous: int) -> None:
        """Spool the change for billing; a spool that fails loses the record, never the tick."""
        if self.spool is None:
            return
        try:
            await self.spool.append(decision_record(decision, previous).to_json())
        except SpoolError as exc:
            log.error(
                "autoscale: %s: the change to %d is not kept for billing: %s",
                decision.model,
                decision.desired,
                exc,
            )

    async def _deliver(self, hook: Hook, decisions: Sequence[Decision]) -> None:
        """Publish ``decisions`` to ``hook`` one after the other (a hook takes one at a time)."""
        for decision in decisions:
            key = (hook.name, decision.model)
            try:
                await hook.publish(decision)
            except HookError as exc:
                self.gauges.hook_errors.labels(hook=hook.name).inc()
                log.error("autoscale: %s hook failed for %s: %s", hook.name, decision.model, exc)
                continue
            self.gauges.hook_errors.labels(hook=hook.name).set(0)
            self.delivered[key] = decision.desired
            # The change itself was logged when it was decided (``_log_change``).
            log.debug(
                "autoscale: %s hook: %s -> %d delivered",
                hook.name,
                decision.model,
                decision.desired,
            )

    async def run(self, interval_seconds: float) -> None:
        """Tick every ``interval_seconds`` until cancelled; a tick that fails does not end it.

        This loop is the autoscaler: if it ended, /metrics would go on serving the last desired
        count as if it were still decided. So whatever a tick raises is logged with its
        traceback and counted in ``infermeter_autoscale_tick_failures_total``, and the next tick
        tries again (``infermeter_autoscale_last_tick_timestamp_seconds`` says how old the
        decision served is).
        """
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except Exception:  # the loop's supervisor: any failure is one tick's, not the loop's
                self.gauges.tick_failures.inc()
                log.exception("autoscale: the tick failed; the next one tries again")
            await asyncio.sleep(max(0.0, interval_seconds - (time.monotonic() - started)))

    def save_history(self) -> None:
        """Write the demand history now (on the way out: the periodic save may be seconds old)."""
        if self.memory is not None:
            self.memory.save(self.states)


def _log_change(decision: Decision, previous: int) -> None:
    """One INFO line when a model's desired count changes: from, to, and why."""
    log.info(
        "autoscale: %s: %d -> %d replicas: %s",
        decision.model,
        previous,
        decision.desired,
        "; ".join(decision.reasons),
    )


def log_to_stderr() -> None:
    """The autoscaler's own lines on stderr from INFO (its decisions), everyone else's from WARNING."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)


def build_hooks(
    config: Config,
    client: httpx.AsyncClient,
    environ: MutableMapping[str, str] | None = None,
    config_path: Path | None = None,
    registry: CollectorRegistry | None = None,
) -> list[Hook]:
    """The hooks the ``autoscale`` section turns on; a missing secret is a start-up error.

    The local hook starts its instances with the same configuration file, so it needs its path.
    """
    env = process_environment() if environ is None else environ
    a = config.autoscale
    hooks: list[Hook] = []
    if a.local.enabled:
        if config_path is None:
            raise HookError("autoscale.local needs the configuration file's path")
        hooks.append(LocalScaleHook(config, config_path, client, registry, env))
    if a.webhook_url:
        secret = env.get(a.webhook_secret_env)
        if not secret:
            raise HookError(f"autoscale.webhook_url is set but ${a.webhook_secret_env} is empty")
        hooks.append(
            WebhookHook(
                a.webhook_url, secret.encode(), client, timeout_seconds=a.webhook_timeout_seconds
            )
        )
    k = a.kubernetes
    if k.enabled:
        if k.api_url:
            try:
                verify = ca_verify(k.ca_file, "autoscale.kubernetes.ca_file")
            except KubernetesApiError as exc:
                raise HookError(str(exc)) from None
            kube = httpx.AsyncClient(verify=verify, timeout=10.0)
            hooks.append(
                KubernetesScaleHook(
                    k.api_url,
                    k.namespace,
                    k.deployments,
                    kube,
                    token=env.get(k.token_env),
                    dry_run=k.dry_run,
                )
            )
        else:
            url, token_file, context = in_cluster_api(env)
            kube = httpx.AsyncClient(verify=context, timeout=10.0)
            hooks.append(
                KubernetesScaleHook(
                    url, k.namespace, k.deployments, kube, token_file=token_file, dry_run=k.dry_run
                )
            )
    return hooks


def build_reader(
    config: Config,
    client: httpx.AsyncClient,
    prometheus_url: str | None,
    hooks: Sequence[Hook] = (),
    gauges: ScalingGauges | None = None,
) -> Reader:
    """Prometheus when a URL is given (flag, then config), else the /metrics pages.

    The pages include the sidecars of the local hook's instances while they live; with
    ``gauges``, the pages unread at each tick are counted there.
    """
    models = [m.name for m in config.models]
    a = config.autoscale
    url = prometheus_url or a.prometheus_url
    if url:
        queries = {str(key): promql for key, promql in a.prometheus_queries.items()}
        source = PrometheusSource(url, client, overrides=queries)
        return PrometheusReader(source, models)
    collector = a.collector_url or f"http://{config.collector.listen}/metrics"
    sidecars = list(a.sidecar_urls) or [
        f"http://{r.sidecar_listen}/metrics" for r in config.replicas if r.sidecar_listen
    ]
    reader = PageReader(
        collector, sidecars, models, client, env_value(a.metrics_token_env), gauges=gauges
    )
    local = next((h for h in hooks if isinstance(h, LocalScaleHook)), None)
    if local is not None:
        reader.instance_sidecars = lambda: [
            f"{i.sidecar_url}/metrics" for i in local.instances() if i.sidecar_url
        ]
    return reader


def create_app(gauges: ScalingGauges) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``/metrics`` (the replica gauges) and ``/healthz``."""
    metrics = make_asgi_app(gauges.registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await idle_lifespan(receive, send)
            return
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await metrics(scope, receive, send)
            return
        status, body = (200, b"ok\n") if scope.get("path") == "/healthz" else (404, b"not found\n")
        await respond(send, status, body, [(b"content-type", b"text/plain; charset=utf-8")])

    return app


def history_file(config: Config, params: PolicyParams) -> HistoryFile | None:
    """Where the demand history is kept (``autoscale.history_file``); None keeps it in memory."""
    a = config.autoscale
    if not a.history_file:
        return None
    models = [m.name for m in config.models]
    return HistoryFile(Path(a.history_file), params, models, a.history_save_seconds)


def decision_shipping(
    config: Config, client: httpx.AsyncClient, registry: CollectorRegistry | None = None
) -> DecisionShipping | None:
    """The decisions' spool and shipper when ``autoscale.ingest_url`` is set; else None.

    WriterError when ``autoscale.credential_env`` holds another writer's credential.
    """
    a = config.autoscale
    if not a.ingest_url:
        return None
    token = env_value(a.ingest_token_env)
    credential = credential_from(process_environment(), a.credential_env, Role.AUTOSCALER)
    return DecisionShipping(Path(a.spool_dir), a.ingest_url, token, client, registry, credential)


def audit_log(config: Config) -> AuditLog | None:
    """The reloads' audit spool (``<autoscale.spool_dir>/audit``) when ``autoscale.ingest_url``
    is set, sealed with the autoscaler's writer credential; else None (the log line only).

    Beside the decisions it ships with, in the autoscaler's own directory: one autoscaler per
    directory already, and no second setting to keep apart from the first.
    """
    a = config.autoscale
    if not a.ingest_url:
        return None
    credential = credential_from(process_environment(), a.credential_env, Role.AUTOSCALER)
    source = credential.writer.principal if credential is not None else "autoscaler"
    return AuditLog(Path(a.spool_dir) / AUDIT_DIR, source, credential)


async def serve_autoscaler(
    config: Config,
    listen: str | None,
    prometheus_url: str | None,
    config_path: Path | None = None,
    day_seconds: float = 86400.0,
) -> None:
    """Evaluate every ``autoscale.interval_seconds`` and serve /metrics until told to exit.

    ``day_seconds``: the length of the day the predictive term's slots divide (shorter for a
    simulated fleet whose day is compressed). With ``config_path``, the file is reloaded on
    SIGHUP and when it changes.
    """
    a = config.autoscale
    host, port = host_port(listen or a.listen)
    ensure_free(host, port, "autoscale listen address")
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=3.0)) as client:
        gauges = ScalingGauges()
        hooks = build_hooks(config, client, config_path=config_path, registry=gauges.registry)
        params, limits = policy_of(config, day_seconds)
        shipping = decision_shipping(config, client, gauges.registry)
        audit = audit_log(config)
        scaler = Autoscaler(
            params,
            limits,
            build_reader(config, client, prometheus_url, hooks, gauges),
            gauges,
            hooks,
            memory=history_file(config, params),
            spool=shipping.spool if shipping is not None else None,
        )
        if shipping is not None:
            await shipping.start()
        background: list[asyncio.Task[None]] = []
        audit_shipper = None
        if audit is not None and a.ingest_url:
            audit.open()
            token = env_value(a.ingest_token_env)
            audit_shipper = audit.shipper(a.ingest_url, token, client)
            background.append(asyncio.create_task(audit_shipper.run(), name="ship-audit"))
        if config_path is not None:
            reloader = _reloader(
                config,
                config_path,
                scaler,
                audit,
                listen=listen,
                prometheus_url=prometheus_url,
                day_seconds=day_seconds,
            )
            background.append(reloader.install(asyncio.get_running_loop()))
        task = asyncio.create_task(scaler.run(a.interval_seconds), name="autoscale")
        log.info(
            "autoscale: every %g s, hooks: %s, decisions to %s, /metrics on http://%s:%d/metrics",
            a.interval_seconds,
            [h.name for h in hooks] or "none",
            a.ingest_url or "the log only",
            host,
            port,
        )
        try:
            await server(create_app(gauges), host, port).serve()
        finally:
            for running in (task, *background):
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
            await scaler.stop_delivering()
            scaler.save_history()
            if shipping is not None:
                await shipping.stop()
            if audit is not None:
                await audit.close()
            if audit_shipper is not None:
                await last_shipment([audit_shipper], LAST_SHIPMENT_SECONDS)
            for hook in hooks:
                if isinstance(hook, KubernetesScaleHook):
                    await hook.client.aclose()
                elif isinstance(hook, LocalScaleHook):
                    await hook.close()


def _reloader(
    config: Config,
    path: Path,
    scaler: Autoscaler,
    audit: AuditLog | None,
    *,
    listen: str | None,
    prometheus_url: str | None,
    day_seconds: float,
) -> Reloader:
    """The reloader of ``path``: a new policy for ``scaler``, checked against the one in force."""
    in_force = [config]

    def check(fresh: Config) -> list[str]:
        # As at start (and in every service that reloads): no public demo key hash with an
        # address beyond loopback, whichever server of the file would listen there.
        return public_key_problems(fresh, listen) + restart_needed(
            in_force[0], fresh, listen=listen, prometheus_url=prometheus_url
        )

    def apply(fresh: Config) -> None:
        scaler.reconfigure(*policy_of(fresh, day_seconds))
        for hook in scaler.hooks:
            if isinstance(hook, LocalScaleHook):
                hook.config = fresh  # its min_replicas; what it places on is checked unchanged
        in_force[0] = fresh

    async def note(action: str, trigger: str, why: str) -> None:
        if audit is None:
            return
        # Who reloads is the operator behind the signal or the file change.
        await audit.note(
            action,
            f"operator ({trigger})",
            "operator",
            target=f"file:{path}",
            why=why,
            outcome="ok" if action == "config.reloaded" else "refused",
        )

    return Reloader(path, "autoscaler", apply, note, check)
