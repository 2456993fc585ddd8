"""SidecarMetrics.child: labelled children kept after the first lookup count where labels() would."""

from __future__ import annotations

from sidecar.metrics import SidecarMetrics


def test_counts_land_in_the_labelled_series_of_the_exposition() -> None:
    m = SidecarMetrics()
    labels = ("search", "chat-small")
    ok = m.child(m.requests, *labels, "ok")
    assert m.child(m.requests, *labels, "ok") is ok
    ok.inc()
    ok.inc()
    m.child(m.requests, *labels, "client_aborted").inc()
    m.child(m.prompt_tokens, *labels).inc(12)
    m.child(m.completion_tokens, *labels).inc(30)
    m.child(m.in_flight, *labels).inc()
    m.child(m.in_flight, *labels).inc()
    m.child(m.in_flight, *labels).dec()
    get = m.registry.get_sample_value
    named = {"team": "search", "model": "chat-small"}
    assert get("infermeter_requests_total", {**named, "status": "ok"}) == 2
    assert get("infermeter_requests_total", {**named, "status": "client_aborted"}) == 1
    assert get("infermeter_prompt_tokens_total", named) == 12
    assert get("infermeter_completion_tokens_total", named) == 30
    assert get("infermeter_requests_in_flight", named) == 1
    # The same children labels() hands out, not copies.
    assert ok is m.requests.labels(*labels, "ok")


def test_a_series_appears_only_once_something_is_counted_in_it() -> None:
    m = SidecarMetrics()
    labels = ("search", "chat-small")
    m.child(m.in_flight, *labels).inc()
    get = m.registry.get_sample_value
    named = {"team": "search", "model": "chat-small"}
    assert get("infermeter_requests_in_flight", named) == 1
    for name in (
        "infermeter_prompt_tokens_total",
        "infermeter_cached_prompt_tokens_total",
        "infermeter_usage_inexact_total",
    ):
        assert get(name, named) is None
    # Same labels on another metric: another child.
    m.child(m.cached_prompt_tokens, *labels).inc(4)
    assert get("infermeter_cached_prompt_tokens_total", named) == 4
    assert get("infermeter_requests_in_flight", named) == 1
