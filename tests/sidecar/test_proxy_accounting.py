"""Every request is metered exactly, survives failures, and is visible in metrics and traces."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from infermeter.serving import free_port
from infermeter.spool import read_segment
from sidecar.app import Sidecar
from sidecar.http_server import HttpServer
from tests.servers import running, serving
from tests.sidecar.conftest import METRICS_TOKEN, make_config, metric_value
from tests.simulator.shapes import sse_events

# The relay runs on uvloop in the sidecar process and on either loop in tests (conftest).
pytestmark = pytest.mark.both_loops

CHAT = {
    "model": "chat-small",
    "messages": [{"role": "user", "content": "count please"}],
    "max_tokens": 12,
}


async def _vllm_counters(url: str) -> tuple[float, float]:
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"{url}/metrics")).text
    return metric_value(text, "vllm:prompt_tokens_total"), metric_value(
        text, "vllm:generation_tokens_total"
    )


async def _hang_up(stack: Any, body: dict[str, Any], times: int, events: int) -> None:
    """Send the streamed ``body`` ``times`` times, hanging up after ``events`` SSE events each."""
    async with stack.client() as c:
        for _ in range(times):
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == events:
                        break


async def test_token_totals_equal_vllm_counters(stack):
    """Streamed, non-streamed, text and refused requests: records sum to vLLM's own counters."""
    before = await _vllm_counters(stack.upstream)
    async with stack.client() as c:
        bodies = [
            {**CHAT, "stream": True},
            {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
            {**CHAT, "max_tokens": 30},
            {**CHAT, "n": 2, "stream": True},
            {**CHAT, "max_tokens": 100_000},
        ]
        for body in bodies * 3:
            await c.post("/v1/chat/completions", json=body)
        await c.post(
            "/v1/completions", json={"model": "chat-small", "prompt": "a b c", "max_tokens": 7}
        )
    after = await _vllm_counters(stack.upstream)
    records = await stack.records()
    assert len(records) == 16
    completion = sum(r["completion_tokens"] for r in records)
    assert completion == after[1] - before[1]
    # vLLM counts an n=2 prompt twice (once per sequence); usage reports it once.
    n2_prompts = sum(r["prompt_tokens"] for r in records if r["completion_tokens"] == 24)
    assert sum(r["prompt_tokens"] for r in records) + n2_prompts == after[0] - before[0]
    assert {r["status"] for r in records} == {"ok", "bad_request"}


async def test_aborted_streams_are_recorded_with_tokens_seen(stack):
    """A client that hangs up: upstream aborted at once, record says client_aborted and what was sent."""
    before = await _vllm_counters(stack.upstream)
    aborts = 6
    await _hang_up(
        stack, {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}, aborts, 10
    )
    await asyncio.sleep(0.5)
    after = await _vllm_counters(stack.upstream)
    records = await stack.records()
    assert [r["status"] for r in records] == ["client_aborted"] * aborts
    recorded = sum(r["completion_tokens"] for r in records)
    generated = after[1] - before[1]
    assert recorded >= aborts * 9
    gap = generated - recorded
    print(
        f"\ntokens vLLM generated after the last chunk the sidecar saw: {gap} over {aborts} aborts"
    )
    assert 0 <= gap <= 3 * aborts
    assert after[1] < before[1] + aborts * 2000 / 4, (
        "upstream kept generating after the client left"
    )


async def test_upstream_unreachable_is_502_and_recorded(stack_factory):
    """No vLLM listening: 502 in OpenAI's error JSON, and a record of the failure."""
    stack = await stack_factory()
    stack.sidecar.upstream = f"http://127.0.0.1:{free_port()}"
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unreachable"
    assert (await stack.records())[-1]["status"] == "upstream_error"


async def test_upstream_timeout_is_504(stack_factory):
    """An upstream that never answers: 504 after the read timeout."""

    async def hang(scope, receive, send):
        await asyncio.sleep(30)

    stack = await stack_factory(upstream_app=hang, **{"sidecar.read_timeout_seconds": 0.3})
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"


def _breaks_mid_stream(fixture_text: Any, then: Any) -> Any:
    """An upstream that streams the first 4 events of a real vLLM capture, then runs ``then()``."""
    events = sse_events(fixture_text("vllm-0.32-chat-stream-continuous-usage.sse"))[:4]
    partial = "".join(f"data: {e}\n\n" for e in events).encode()

    async def app(scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"content-length", b"100000"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": partial, "more_body": True})
        await then()

    return app


async def _engine_dies() -> None:
    raise RuntimeError("engine died")


async def _engine_stalls() -> None:
    await asyncio.sleep(30)


@pytest.mark.parametrize(
    ("then", "settings"),
    [(_engine_dies, {}), (_engine_stalls, {"sidecar.read_timeout_seconds": 0.3})],
    ids=["dies", "stalls"],
)
async def test_upstream_breaking_mid_stream_gives_an_error_event_and_partial_usage(
    stack_factory, fixture_text, then, settings
):
    """vLLM dies, or stops sending (read timeout), after a few chunks: the client gets an SSE
    error event soon, and the usage so far is recorded."""
    stack = await stack_factory(upstream_app=_breaks_mid_stream(fixture_text, then), **settings)
    async with stack.client() as c:
        started = time.perf_counter()
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert time.perf_counter() - started < 5
    tail = sse_events(r.content)[-1]
    assert '"error"' in tail
    assert "[DONE]" not in r.text
    record = (await stack.records())[-1]
    assert record["status"] == "upstream_error"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (10, 3)


def _fill_disk(spool: Any) -> None:
    """Every new segment of ``spool`` lands on /dev/full, which fails writes with ENOSPC."""
    original = spool._start_segment

    def on_full_disk() -> None:
        original()
        assert spool._fh is not None
        spool._fh.close()
        spool._fh = open("/dev/full", "ab")  # noqa: SIM115

    spool._start_segment = on_full_disk


async def test_full_disk_refuses_requests_with_503(stack, tmp_path):
    """When the spool cannot be written, requests are refused rather than served unmetered.

    The request served before the tick found the spool full is not unmetered: its ending stays
    in its journal slot, and its record is written once the spool takes it.
    """
    await stack.sidecar.spool.close()
    for seg in stack.spool.glob("seg-*.jsonl"):
        seg.unlink()
    stack.sidecar.spool.directory = tmp_path / "full"
    stack.sidecar.spool.directory.mkdir()
    stack.sidecar.spool.open()
    _fill_disk(stack.sidecar.spool)
    async with stack.client() as c:
        served = await c.post("/v1/chat/completions", json=CHAT)
        await stack.sidecar.accounting.flush()  # the tick: the spool is full
        first = await c.post("/v1/chat/completions", json=CHAT)
        second = await c.post("/v1/chat/completions", json=CHAT)
        ready = await c.get("/readyz")
    assert served.status_code == 200
    assert stack.sidecar.accounting.waiting == 1
    assert first.status_code == 503
    assert first.json()["error"]["code"] == "metering_unavailable"
    assert second.status_code == 503
    assert ready.status_code == 503


async def test_metrics_have_the_fixed_names_and_pass_promtool(stack):
    """/metrics carries the documented families and `promtool check metrics` accepts it."""
    async with stack.client() as c:
        await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        await c.post("/v1/chat/completions", json=CHAT)
    async with httpx.AsyncClient() as c:
        text = (
            await c.get(
                f"{stack.url}/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}
            )
        ).text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    expected = {
        "infermeter_time_to_first_token_seconds": "histogram",
        "infermeter_inter_token_latency_seconds": "histogram",
        "infermeter_request_duration_seconds": "histogram",
        "infermeter_output_tokens_per_second": "histogram",
        "infermeter_prompt_tokens": "counter",
        "infermeter_completion_tokens": "counter",
        "infermeter_requests": "counter",
        "infermeter_rate_limited": "counter",
        "infermeter_requests_in_flight": "gauge",
        "infermeter_usage_spool_backlog": "gauge",
    }
    assert {k: families.get(k) for k in expected} == expected
    assert (
        metric_value(
            text, "infermeter_requests_total", team="search", model="chat-small", status="ok"
        )
        == 2
    )
    assert metric_value(text, "infermeter_completion_tokens_total", team="search") == 24
    assert metric_value(text, "infermeter_usage_spool_backlog") == 2
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is required: make test installs it"
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


async def test_span_per_request_with_genai_attributes(stack_factory, tmp_path):
    """One span per request, GenAI attributes and team set, traceparent continued upstream."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = await stack_factory()
    config = make_config(stack.upstream)
    traced = Sidecar(config, "small-0", spool_dir=tmp_path / "traced", tracer_provider=provider)
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with serving(traced) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        headers = {"authorization": "Bearer im-demo-research", "traceparent": parent}
        await c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers)
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "chat-small"
    assert attrs["gen_ai.response.model"] == "llama-3.1-8b-instruct"
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) > (0, 11)
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["infermeter.team"] == "research"
    # The recommended ones: the replica the request went to, the limit asked, vLLM's id.
    upstream = httpx.URL(stack.upstream)
    assert (attrs["server.address"], attrs["server.port"]) == (upstream.host, upstream.port)
    assert attrs["gen_ai.request.max_tokens"] == CHAT["max_tokens"]
    await traced.accounting.flush()
    [record] = [
        r for path in (tmp_path / "traced").glob("seg-*.jsonl") for r in read_segment(path)[0]
    ]
    assert attrs["gen_ai.response.id"] == record["response_id"]
    assert str(attrs["gen_ai.response.id"]).startswith("chatcmpl-")
    assert span.context is not None
    assert format(span.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"


async def test_a_failed_request_s_span_names_its_error_type(stack_factory, tmp_path):
    """A request vLLM refuses and one whose client hangs up end their spans in error, with
    error.type the record's status, as the GenAI conventions require; a good one has none."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = await stack_factory()
    config = make_config(stack.upstream)
    spool = tmp_path / "traced"
    traced = Sidecar(config, "small-0", spool_dir=spool, tracer_provider=provider)
    headers = {"authorization": "Bearer im-demo-research"}
    async with serving(traced) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        await c.post("/v1/chat/completions", json=CHAT, headers=headers)
        await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100_000}, headers=headers)
        body = {**CHAT, "stream": True, "max_tokens": 200}
        async with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        await asyncio.sleep(0.2)  # (the hang-up reaches the sidecar)
    ended = [
        (s.status.status_code.name, (s.attributes or {}).get("error.type"))
        for s in exporter.get_finished_spans()
    ]
    assert ended == [
        ("UNSET", None),
        ("ERROR", "bad_request"),
        ("ERROR", "client_aborted"),
    ]


async def test_a_span_starts_when_its_request_came_in_not_when_it_got_a_batch_slot(
    stack_factory, tmp_path
):
    """With one batch slot, requests sent together wait for it in turn: each span still covers
    its whole request, the wait included, so its time to first chunk falls inside it and its
    length is the record's."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = await stack_factory()
    config = make_config(stack.upstream, **{"replicas.1.max_num_seqs": 1})
    spool = tmp_path / "traced"
    traced = Sidecar(config, "small-0", spool_dir=spool, tracer_provider=provider)
    headers = {"authorization": "Bearer im-demo-research"}
    body = {**CHAT, "stream": True, "max_tokens": 30}
    async with serving(traced) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        await asyncio.gather(
            *(c.post("/v1/chat/completions", json=body, headers=headers) for _ in range(3))
        )
    await traced.accounting.flush()
    records = sorted(
        r["finished_at"] - r["received_at"]
        for path in spool.glob("seg-*.jsonl")
        for r in read_segment(path)[0]
    )
    spans = exporter.get_finished_spans()
    lengths = sorted((s.end_time or 0) - (s.start_time or 0) for s in spans)
    assert len(lengths) == len(records) == 3
    # (the last one waited for two others to end: a wait no span showed)
    assert records[-1] > 2 * records[0]
    for length, record in zip(lengths, records, strict=True):
        assert abs(length / 1e9 - record) < 0.03
    for span in spans:
        first = dict(span.attributes or {})["gen_ai.response.time_to_first_chunk"]
        assert isinstance(first, float)
        assert first * 1e9 < (span.end_time or 0) - (span.start_time or 0)


def test_otlp_export_follows_the_standard_variables():
    """Export is on only when OTEL_* variables ask for it."""
    from sidecar.tracing import export_configured

    assert not export_configured({})
    assert export_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert export_configured({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not export_configured(
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}
    )
    assert not export_configured({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})


def test_a_configured_export_makes_a_provider_naming_the_instance():
    """With export asked for, the provider (the SDK, loaded then) carries the instance."""
    from sidecar.tracing import make_tracer_provider, tracer

    assert make_tracer_provider("infermeter-sidecar-small-0", {}) is None
    provider = make_tracer_provider(
        "infermeter-sidecar-small-0",
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
        {"service.instance.id": "vllm-small-0-a"},
    )
    assert provider is not None
    try:
        attributes = provider.resource.attributes
        assert attributes["service.name"] == "infermeter-sidecar-small-0"
        assert attributes["service.instance.id"] == "vllm-small-0-a"
        assert tracer(provider) is not None
    finally:
        provider.shutdown()


async def test_serve_unmetered_mode_serves_when_the_spool_fails(stack_factory):
    """Configured to serve unmetered, a spool failure is logged and the request still served."""
    stack = await stack_factory(**{"sidecar.on_spool_failure": "serve_unmetered"})
    _fill_disk(stack.sidecar.spool)
    async with stack.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    await stack.sidecar.accounting.flush()  # the tick that writes its record
    assert stack.sidecar.metrics.spool_errors._value.get() >= 1
    assert stack.sidecar.accounting.waiting == 0


async def test_aborted_streams_of_two_choices_are_recorded_with_both_choices_tokens(stack):
    """n=2: each chunk's running usage counts its own choice; a hang-up records both choices."""
    before = await _vllm_counters(stack.upstream)
    aborts = 4
    body = {**CHAT, "n": 2, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    await _hang_up(stack, body, aborts, 20)
    await asyncio.sleep(0.5)
    after = await _vllm_counters(stack.upstream)
    records = await stack.records()
    assert [r["status"] for r in records] == ["client_aborted"] * aborts
    recorded = sum(r["completion_tokens"] for r in records)
    gap = after[1] - before[1] - recorded
    # Each client read 18 tokens (20 events less two role chunks); vLLM's own counter says how
    # many it generated. Counting one choice only would leave half of them out.
    assert recorded >= aborts * 17
    assert 0 <= gap <= 3 * 2 * aborts


async def test_non_streamed_client_disconnect_aborts_upstream(stack):
    """A client that gives up on a non-streamed request: vLLM stops generating, record says so."""
    async with stack.client(timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 3000, "ignore_eos": True}
            )
    await asyncio.sleep(0.5)
    _, generated = await _vllm_counters(stack.upstream)
    await asyncio.sleep(0.3)
    assert (await _vllm_counters(stack.upstream))[1] == generated < 3000
    assert (await stack.records())[-1]["status"] == "client_aborted"


async def _stall(scope: Any, receive: Any, send: Any) -> None:
    """An upstream that never answers."""
    await asyncio.sleep(3600)


async def test_a_request_the_server_cancels_past_its_grace_ends_its_span_and_is_counted(tmp_path):
    """The server told to stop without a drain (or a request the drain's cut did not end):
    what still runs after its grace is cancelled, and its span ends all the same, in error,
    with error.type interrupted, as its record (from the journal) does; /metrics counts it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    up = free_port()
    config = make_config(f"http://127.0.0.1:{up}", **{"sidecar.read_timeout_seconds": 600})
    spool = tmp_path / "spool"
    traced = Sidecar(config, "small-0", spool_dir=spool, tracer_provider=provider)
    server = HttpServer(traced, "127.0.0.1", free_port(), graceful_seconds=0.3)
    headers = {"authorization": "Bearer im-demo-research"}
    async with serving(_stall, up, lifespan="off"), httpx.AsyncClient(timeout=30) as c:
        async with running(server) as url:
            asking = asyncio.create_task(
                c.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
            )
            deadline = time.monotonic() + 10
            while traced.journal.running == 0:
                assert time.monotonic() < deadline, "never forwarded"
                await asyncio.sleep(0.02)
        with pytest.raises(httpx.HTTPError):
            await asking
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert attrs["error.type"] == "interrupted"
    assert span.status.status_code.name == "ERROR"
    requests = traced.metrics.registry.get_sample_value(
        "infermeter_requests_total",
        {"team": "research", "model": "chat-small", "status": "interrupted"},
    )
    assert requests == 1
    [record] = [r for path in spool.glob("seg-*.jsonl") for r in read_segment(path)[0]]
    assert record["status"] == "interrupted"
