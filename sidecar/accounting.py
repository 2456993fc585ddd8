"""Accounting: what a finished request leaves behind, its usage record, metrics and span.

A record is made whatever the path that served the request (a stream, a whole answer, a
refusal). On the request's path only what makes a crash recoverable is done: before the client
sees the end of its response, how the request ended goes into its admission-journal slot
(``Slot.end``: memory stores into a shared mapping, which a process killed at any instruction
after them leaves in the kernel's page cache). Its record then waits for the tick: every
``tick_seconds`` (the journal's) one task writes the records of all the requests that ended in
it to the spool with one ``write(2)`` and one fsync (``Spool.append_many``), and only then are
they finished in the journal. A sidecar killed in between leaves the endings in the slots, and
the next start makes each request's record from its slot (``infermeter.journal_files``),
skipping those already in the spool. A request without a slot (not journaled) has its record
written at once, as before (``Spool.write``). At shutdown what waits is written (``close``).

Metrics and the span are not made on the request's path either: its end keeps what they need
(``observe``: the request, how it ended, the time), and the tick puts every request that ended
in it into the counters and histograms and ends their spans, one after the other (``settle``).
Done per request, that was some twenty calls into code and data the request touched nowhere
else, run cold at low load (the client and the replica had the core between two requests); in
a batch they run warm. The inter-token gaps the meter collected go in whole, never per chunk.
What reads the metrics settles first (``/metrics``, the OTLP export, shutdown), so a scrape
sees every request ended before it; a span keeps its request's end time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry import trace

from infermeter.records import RequestStatus, UsageRecord
from infermeter.spool import Spool, SpoolError
from sidecar import tracing
from sidecar.admission import GENERATE
from sidecar.bounds import capped, label
from sidecar.fairness import Slot
from sidecar.journal import AdmissionJournal
from sidecar.limits import Admission
from sidecar.metrics import SidecarMetrics
from sidecar.prefix import Prefix
from sidecar.stream import StreamMeter, UsageCounts

if TYPE_CHECKING:
    from sidecar.otel_metrics import GenAiMetrics

__all__ = [
    "Accounting",
    "Call",
    "admitted_fields",
    "ending_fields",
    "engine_choices",
    "usage_exact",
]

log = logging.getLogger("infermeter.sidecar")

# Statuses whose record is exact although vLLM reported no usage: nothing was generated.
_EXACT_WITHOUT_USAGE = frozenset(
    {
        RequestStatus.REJECTED,
        RequestStatus.RATE_LIMITED,
        RequestStatus.UNAUTHORIZED,
        RequestStatus.BAD_REQUEST,
    }
)
_INEXACT = frozenset(
    {RequestStatus.CLIENT_ABORTED, RequestStatus.UPSTREAM_ERROR, RequestStatus.INTERRUPTED}
)


@dataclass(slots=True)
class Call:
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
    # What the client asked of the stream (``include_usage``, ``continuous_usage_stats``).
    client_usage: bool = False
    client_continuous: bool = False
    # The caller's own x-request-id (when valid) and vLLM's id for the response.
    client_request_id: str | None = None
    response_id: str | None = None
    # The keyed digest of the prompt's head (sidecar.prefix), when the deployment has a key.
    prefix: Prefix | None = None
    # Choices per prompt of a stream of several (``Plan.choices``), else 0.
    choices: int = 0
    # The end user the body named and the project tag the request carried (``sidecar.tags``).
    user: str | None = None
    project: str | None = None

    def echo_headers(self) -> list[tuple[bytes, bytes]]:
        """The caller's own x-request-id, echoed when it sent a valid one."""
        if self.client_request_id is None:
            return []
        return [(b"x-request-id", self.client_request_id.encode())]

    def ratelimit_headers(self) -> list[tuple[bytes, bytes]]:
        """The team's rate-limit state, as the admission left it, for the one response that
        carries it: handed over, not kept, since a stream would hold them (about 1 kB with
        both limits) for its whole length."""
        admission = self.admission
        if admission is None or not admission.headers:
            return []
        headers, admission.headers = admission.headers, ()
        return [(k.encode(), v.encode()) for k, v in headers]


def admitted_fields(call: Call, replica: str, instance: str | None) -> dict[str, Any]:
    """The fields of the request's record that are known once it is admitted.

    With ``ending_fields``, every field of ``UsageRecord``: a record is made twice per request
    (the journal's admission line, then the record itself), in the JSON form directly rather
    than as the frozen dataclass and then its dict, which costs about a third as much
    (``bench.request_steps``). They are made again for the record rather than kept from the
    admission: a 12-key dict held for a stream's whole length is 464 bytes of every open
    stream, and making it again costs about a microsecond.
    """
    prefix = call.prefix
    return {
        "request_id": call.request_id,
        "team": call.team,
        "model": capped(call.model),
        "served_version": call.served_version,
        "replica": replica,
        "instance": instance,
        "received_at": call.received_at,
        "stream": call.stream,
        "endpoint": call.endpoint,
        "client_request_id": call.client_request_id,
        "prefix_digest": prefix.digest if prefix else None,
        "prefix_share": prefix.share if prefix else None,
        "choices": engine_choices(call),
        "user": call.user,
        "project": call.project,
    }


def engine_choices(call: Call) -> int:
    """How many times vLLM counts each prompt of ``call``: once per choice (its ``n``).

    ``Call.choices`` is ``n`` for a request of several choices and 0 for one; an embedding has
    none to multiply.
    """
    return 1 if call.endpoint == "/v1/embeddings" else max(1, call.choices)


def usage_exact(status: RequestStatus, usage: UsageCounts | None) -> bool:
    """The record's counts are vLLM's own, or there were none to count."""
    return usage is not None or status in _EXACT_WITHOUT_USAGE


def ending_fields(
    call: Call,
    status: RequestStatus,
    http_status: int,
    usage: UsageCounts | None,
    meter: StreamMeter | None,
    finish: str | None,
    now: float,
) -> dict[str, Any]:
    """The fields of the request's record that say how it ended, if it ended at ``now``."""
    first = meter.first_token_at if meter else None
    return {
        "first_token_at": None if first is None else call.received_at + (first - call.started),
        "finished_at": call.received_at + (now - call.started),
        "prompt_tokens": usage.prompt if usage else 0,
        "cached_prompt_tokens": usage.cached if usage else 0,
        "completion_tokens": usage.completion if usage else 0,
        "status": status.value,
        "http_status": http_status,
        "finish_reason": None if finish is None else capped(finish),
        "usage_exact": usage_exact(status, usage),
        "response_id": None if call.response_id is None else capped(call.response_id),
    }


class Accounting:
    """Records into the spool and the journal, metrics and spans, for one replica's requests."""

    def __init__(
        self,
        spool: Spool,
        journal: AdmissionJournal,
        metrics: SidecarMetrics,
        replica: str,
        instance: str | None,
        on_spool_failure: Literal["refuse", "serve_unmetered"],
        tick_seconds: float = 0.5,
    ) -> None:
        self.spool, self.journal, self.metrics = spool, journal, metrics
        self.replica, self.instance = replica, instance
        self.on_spool_failure = on_spool_failure
        self.tick_seconds = tick_seconds
        # The last append failed: with ``refuse``, new requests are refused until one succeeds.
        self.spool_broken = False
        # The GenAI metrics kept for OTLP export, when export is on (``sidecar.otel_metrics``).
        self.genai: GenAiMetrics | None = None
        # Requests ended since the last tick, their endings in their slots: what their records
        # are made of, and the ``perf_counter`` of their end.
        self._ended: list[_Ended] = []
        # Requests ended whose metrics and span wait for the tick (``settle``).
        self._observing: list[_Observed] = []
        self._flushing = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def refusing(self) -> bool:
        """True while the spool is failing and unmetered requests must not be served."""
        return self.spool_broken and self.on_spool_failure == "refuse"

    def admission(self, call: Call) -> dict[str, Any]:
        """The record of ``call`` as the journal keeps it while it runs: interrupted, now."""
        return admitted_fields(call, self.replica, self.instance) | ending_fields(
            call, RequestStatus.INTERRUPTED, 502, None, None, None, time.perf_counter()
        )

    def record_of(
        self,
        call: Call,
        status: RequestStatus,
        http_status: int,
        usage: UsageCounts | None,
        meter: StreamMeter | None,
        finish: str | None,
        now: float | None = None,
    ) -> dict[str, Any]:
        """The record (``UsageRecord.to_json``'s form) of ``call`` ending like this at ``now``
        (``perf_counter``; default: now)."""
        return admitted_fields(call, self.replica, self.instance) | ending_fields(
            call,
            status,
            http_status,
            usage,
            meter,
            finish,
            time.perf_counter() if now is None else now,
        )

    def record(
        self,
        call: Call,
        status: RequestStatus,
        http_status: int,
        usage: UsageCounts | None,
        meter: StreamMeter | None,
        finish: str | None,
    ) -> None:
        """The request ended: keep how in its journal slot, and its record for the next tick.

        When this returns a process killed at any instruction leaves the request's ending in
        its slot, from which the next start makes its record (the module docstring): the
        client may see the end of its response. Nothing here writes or waits.

        A request without a slot (a refusal before forwarding), or any while the spool is
        failing, has its record written at once instead, after the records waiting (one
        ``write(2)`` for all, fsync'ed with the spool's tick, ``Spool.write_many``): the spool
        keeps the records in the order their requests ended (but for a tick being written).

        SpoolError (after counting it) only when the sidecar refuses to serve unmetered.
        """
        now = time.perf_counter()
        request_id = call.request_id
        slot = self.journal.end(request_id)
        if slot is not None and not self.spool_broken:
            first = meter.first_token_at if meter else None
            exact = usage_exact(status, usage)
            slot.end(status.value, http_status, usage, exact, first, now, finish, call.response_id)
            self._ended.append((call, status, http_status, usage, meter, finish, now))
            return
        ended, self._ended = self._ended, []
        records = [self.record_of(*e) for e in ended]
        records.append(self.record_of(call, status, http_status, usage, meter, finish, now))
        ids = [e[0].request_id for e in ended]
        ids.append(request_id)
        try:
            self.spool.write_many(records, functools.partial(self._finish, ids))
            self.spool_broken = False
            return
        except SpoolError:
            self._ended[:0] = ended  # (the tick tries them again)
            self.spool_broken = True
            self.metrics.spool_errors.inc()
            if self.on_spool_failure == "refuse":
                raise
            log.error(
                "serving UNMETERED: usage of request %s (team %s) is lost", request_id, call.team
            )
        self.journal.finish(request_id)

    def _finish(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.journal.finish(request_id)

    @property
    def waiting(self) -> int:
        """Requests ended whose records wait for the tick."""
        return len(self._ended)

    def start(self) -> None:
        """Start the ticks that write the records of the requests ended."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop the ticks and write what waits (at shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()
        self.settle()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_seconds)
            # Shielded: a batch cancelled half-way would be written, yet not finished.
            await asyncio.shield(self.flush())
            self.settle()

    async def flush(self) -> None:
        """Write the records of the requests ended since the last flush: one ``write(2)`` and
        one fsync for all of them; then they are finished in the journal (their slots freed).

        When the spool fails they stay in their slots: with ``refuse`` they are tried again at
        the next tick (new requests are refused meanwhile); with ``serve_unmetered`` they are
        lost, as an unwritable record always was, and said so.

        The lines are made ``_SLICE`` records at a time, the event loop free between slices: a
        tick's thousands of records would otherwise hold it for milliseconds at once.
        """
        async with self._flushing:
            ended, self._ended = self._ended, []
            if not ended:
                return
            lines: list[bytes] = []
            for at in range(0, len(ended), _SLICE):
                if at:
                    await asyncio.sleep(0)  # (streams are relayed between slices)
                lines += [self.spool.line(self.record_of(*e)) for e in ended[at : at + _SLICE]]
            try:
                await self.spool.append_lines(lines)
            except SpoolError as exc:
                self.spool_broken = True
                self.metrics.spool_errors.inc()
                if self.on_spool_failure == "refuse":
                    self._ended[:0] = ended
                    log.error("%d record(s) wait in the admission journal: %s", len(ended), exc)
                    return
                log.error("serving UNMETERED: usage of %d request(s) is lost", len(ended))
            else:
                self.spool_broken = False
            self._finish([e[0].request_id for e in ended])

    def observe(
        self,
        call: Call,
        status: RequestStatus,
        usage: UsageCounts | None,
        meter: StreamMeter | None,
        finish: str | None,
        model_names: frozenset[str],
    ) -> None:
        """Keep a finished request for the next ``settle``: its metrics and span, with its end
        time (``perf_counter``, and the clock for the span)."""
        end_ns = time.time_ns() if call.span is not None else 0
        self._observing.append(
            (call, status, usage, meter, finish, model_names, time.perf_counter(), end_ns)
        )
        if len(self._observing) >= _OBSERVE_BATCH:
            self.settle()

    @property
    def unsettled(self) -> int:
        """Requests ended whose metrics and span wait for ``settle``."""
        return len(self._observing)

    def settle(self) -> None:
        """Put the requests kept by ``observe`` into the metrics and end their spans.

        One request's failure (a third-party span processor raising) is logged and does not
        keep the others out, nor stop the tick that calls this.
        """
        observing, self._observing = self._observing, []
        for observed in observing:
            try:
                self._observe(*observed)
            except Exception:
                log.exception("metrics of request %s not kept", observed[0].request_id)

    def _observe(
        self,
        call: Call,
        status: RequestStatus,
        usage: UsageCounts | None,
        meter: StreamMeter | None,
        finish: str | None,
        model_names: frozenset[str],
        ended: float,
        end_ns: int,
    ) -> None:
        m = self.metrics
        # Labels only ever take configured names, so no request can mint a series.
        labels = (call.team or "unknown", label(call.model, model_names))
        inexact = usage is None and call.admission is not None and status in _INEXACT
        _count(m, labels, status.value, usage, inexact)
        duration = ttft = tpot = None
        if status is not RequestStatus.UNAUTHORIZED:
            duration = ended - call.started
            m.duration.observe(labels, duration)
        if meter is not None and meter.first_token_at is not None:
            ttft, tpot = _observe_stream(m, labels, call, usage, meter)
        if self.genai is not None:
            response = label(call.served_version, model_names) if call.served_version else ""
            error = None if status is RequestStatus.OK else status.value
            self.genai.observe(
                (GENERATE.get(call.endpoint, call.endpoint), *labels, response),
                error,
                duration,
                ttft,
                tpot,
                usage,
            )
        if call.span is not None:
            _end_span(call.span, call, status, usage, meter, finish, end_ns)


# Records made per slice at the tick: at about 3.5 µs each (``bench.request_steps``), about a
# millisecond of the event loop at a time.
_SLICE = 256

# Requests kept for ``settle`` before it runs on the path of the one that reaches this many
# (between two ticks only under thousands of requests a second): a bound on what they hold.
_OBSERVE_BATCH = 4096

# A request ended, its metrics and span to be made at the tick: ``Accounting._observe``'s
# arguments (its end as ``perf_counter`` and, for its span, ``time_ns``).
_Observed = tuple[
    Call,
    RequestStatus,
    UsageCounts | None,
    StreamMeter | None,
    str | None,
    frozenset[str],
    float,
    int,
]

# A request ended, its record to be written at the tick: ``Accounting.record_of``'s arguments.
_Ended = tuple[Call, RequestStatus, int, UsageCounts | None, StreamMeter | None, str | None, float]


def count_recovered(
    metrics: SidecarMetrics,
    records: Iterable[UsageRecord],
    team_names: frozenset[str],
    model_names: frozenset[str],
    genai: GenAiMetrics | None = None,
) -> None:
    """Count the records a start made of requests its killed predecessor left running.

    They ended as interrupted, with the tokens of their journal slots (inexact): the SLA's
    error ratio and the token counters would otherwise never see them (nor the GenAI token
    usage, when it is kept).
    """
    records = list(records)
    if genai is not None:
        genai.recovered(records, team_names, model_names, GENERATE)
    for r in records:
        # The journal is the sidecar's own file, but labels still take configured names only.
        labels = (label(r.team, team_names), label(r.model, model_names))
        usage = UsageCounts(r.prompt_tokens, r.completion_tokens, r.cached_prompt_tokens)
        _count(metrics, labels, r.status, usage, not r.usage_exact)


def _count(
    m: SidecarMetrics,
    labels: tuple[str, str],
    status: str,
    usage: UsageCounts | None,
    inexact: bool,
) -> None:
    """One ended request in the counters: its ending, its tokens, whether they are inexact."""
    m.child(m.requests, *labels, status).inc()
    if usage is not None:
        m.child(m.prompt_tokens, *labels).inc(usage.prompt)
        m.child(m.completion_tokens, *labels).inc(usage.completion)
        if usage.cached:
            m.child(m.cached_prompt_tokens, *labels).inc(usage.cached)
    if inexact:
        m.child(m.inexact, *labels).inc()


def _observe_stream(
    m: SidecarMetrics,
    labels: tuple[str, str],
    call: Call,
    usage: UsageCounts | None,
    meter: StreamMeter,
) -> tuple[float, float | None]:
    """The stream's histograms; returns its TTFT and its time per output token after the first
    (None when fewer than two tokens were timed apart), for the GenAI metrics."""
    first = meter.first_token_at
    assert first is not None
    ttft = first - call.started
    m.ttft.observe(labels, ttft)
    m.itl.merge(labels, meter.itl)
    last = meter.last_token_at
    if usage is not None and usage.completion > 1 and last and last > first:
        m.tps.observe(labels, (usage.completion - 1) / (last - first))
        return ttft, (last - first) / (usage.completion - 1)
    return ttft, None


def _end_span(
    span: trace.Span,
    call: Call,
    status: RequestStatus,
    usage: UsageCounts | None,
    meter: StreamMeter | None,
    finish: str | None,
    end_ns: int,
) -> None:
    span.set_attribute(tracing.RESPONSE_MODEL, call.served_version)
    if call.response_id is not None:
        span.set_attribute(tracing.RESPONSE_ID, capped(call.response_id))
    if usage is not None:
        span.set_attribute(tracing.INPUT_TOKENS, usage.prompt)
        span.set_attribute(tracing.OUTPUT_TOKENS, usage.completion)
    if finish:
        span.set_attribute(tracing.FINISH_REASONS, [finish])
    if meter is not None and meter.first_token_at is not None:
        span.set_attribute(tracing.TIME_TO_FIRST_CHUNK, meter.first_token_at - call.started)
    if status is not RequestStatus.OK:
        # The status alone has no attribute a backend groups failures by: error.type names it.
        span.set_attribute(tracing.ERROR_TYPE, status.value)
        span.set_status(trace.Status(trace.StatusCode.ERROR, status.value))
    span.end(end_time=end_ns)
