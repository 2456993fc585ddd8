"""A request's metrics and span are made at the tick, and whatever reads them settles first."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from infermeter.records import RequestStatus
from sidecar.accounting import Accounting, Call
from sidecar.app import Sidecar
from sidecar.metrics import SidecarMetrics
from sidecar.stream import UsageCounts
from tests.servers import serving
from tests.sidecar.conftest import METRICS_TOKEN, StackFactory, make_config, metric_value

CHAT = {"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# A tick that never comes during a test: only what reads the metrics settles them.
NO_TICK = {"sidecar.journal_mark_millis": 60_000}


async def test_a_scrape_has_every_request_ended_before_it(stack_factory: StackFactory) -> None:
    """Six requests end between two ticks: none is in the counters yet, and a scrape of
    /metrics right after them counts all six, their tokens and their streams' TTFT."""
    stack = await stack_factory(**NO_TICK)
    async with stack.client() as c:
        answers = await asyncio.gather(
            *(c.post("/v1/chat/completions", json={**CHAT, "stream": i % 2 == 0}) for i in range(6))
        )
    assert [a.status_code for a in answers] == [200] * 6
    accounting = stack.sidecar.accounting
    assert accounting.unsettled == 6
    registry = stack.sidecar.metrics.registry
    assert registry.get_sample_value(
        "infermeter_requests_total", {"team": "search", "model": "chat-small", "status": "ok"}
    ) in (None, 0.0)
    async with httpx.AsyncClient() as c:
        page = await c.get(
            f"{stack.url}/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}
        )
    text = page.text
    assert metric_value(text, "infermeter_requests_total", team="search", status="ok") == 6
    assert metric_value(text, "infermeter_completion_tokens_total", team="search") == 24
    assert metric_value(text, "infermeter_time_to_first_token_seconds_count", team="search") == 3
    assert accounting.unsettled == 0


async def test_a_span_ends_when_its_request_did_not_when_the_tick_came(
    stack_factory: StackFactory, tmp_path: Path
) -> None:
    """The span is exported by the settle, and its end is the request's end, before the
    client had its answer, not the settle's time a quarter of a second later."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = await stack_factory()
    traced = Sidecar(
        make_config(stack.upstream, **NO_TICK),
        "small-0",
        spool_dir=tmp_path / "traced",
        tracer_provider=provider,
    )
    async with serving(traced) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer im-demo-search"}
        )
        answered_ns = time.time_ns()
        assert r.status_code == 200
        assert exporter.get_finished_spans() == ()
        await asyncio.sleep(0.25)
        traced.accounting.settle()
        settled_ns = time.time_ns()
        spans: tuple[ReadableSpan, ...] = exporter.get_finished_spans()
    (span,) = spans
    assert span.end_time is not None
    assert span.start_time is not None
    assert span.start_time < span.end_time <= answered_ns < settled_ns - 200_000_000
    assert dict(span.attributes or {})["gen_ai.usage.output_tokens"] == 4


def _accounting(tmp_path: Path) -> Accounting:
    from infermeter.spool import Spool
    from sidecar.journal import AdmissionJournal

    spool = Spool(tmp_path / "spool")
    journal = AdmissionJournal(tmp_path / "spool" / "journal", 3600)
    return Accounting(spool, journal, SidecarMetrics(), "small-0", None, "refuse", 3600)


class _Refusing(SimpleSpanProcessor):
    """A span processor that raises for one request's span (a third party's failing)."""

    def on_end(self, span: ReadableSpan) -> None:
        if (span.attributes or {}).get("request") == "r1":
            raise RuntimeError("exporter exploded")
        super().on_end(span)


def test_one_failing_request_leaves_the_others_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three requests settled together, the second's span processor raising: the error is
    logged with its request, and the other two are in the counters and exported."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(_Refusing(exporter))
    tracer = provider.get_tracer("test")
    accounting = _accounting(tmp_path)
    models = frozenset({"chat-small"})
    for i in range(3):
        call = Call(f"r{i}", "/v1/chat/completions", 1.7e9, time.perf_counter(), team="search")
        call.model = "chat-small"
        call.span = tracer.start_span("chat", attributes={"request": f"r{i}"})
        accounting.observe(call, RequestStatus.OK, UsageCounts(5, 2), None, "stop", models)
    with caplog.at_level(logging.ERROR, logger="infermeter.sidecar"):
        accounting.settle()
    assert "metrics of request r1 not kept" in caplog.text
    assert accounting.unsettled == 0
    get = accounting.metrics.registry.get_sample_value
    named = {"team": "search", "model": "chat-small"}
    # r1 was counted before its span failed; what the failure cost is its span alone.
    assert get("infermeter_requests_total", {**named, "status": "ok"}) == 3
    assert [s.attributes["request"] for s in exporter.get_finished_spans()] == ["r0", "r2"]  # type: ignore[index]


def test_thousands_between_two_ticks_are_settled_on_the_way(tmp_path: Path) -> None:
    """What ``observe`` keeps is bounded: the request that reaches the batch's size settles it."""
    from sidecar import accounting as module

    accounting = _accounting(tmp_path)
    models = frozenset({"chat-small"})
    for i in range(module._OBSERVE_BATCH + 10):
        call = Call(f"r{i}", "/v1/chat/completions", 1.7e9, time.perf_counter(), team="search")
        call.model = "chat-small"
        accounting.observe(call, RequestStatus.OK, UsageCounts(5, 2), None, "stop", models)
        assert accounting.unsettled < module._OBSERVE_BATCH
    assert accounting.unsettled == 10
    get = accounting.metrics.registry.get_sample_value
    labels = {"team": "search", "model": "chat-small", "status": "ok"}
    assert get("infermeter_requests_total", labels) == module._OBSERVE_BATCH
