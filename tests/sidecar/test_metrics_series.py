"""SidecarMetrics.series: the per-request children, kept per (team, model), count where labels() would."""

from __future__ import annotations

from sidecar.metrics import SidecarMetrics


def test_counts_land_in_the_labelled_series_of_the_exposition() -> None:
    m = SidecarMetrics()
    s = m.series("search", "chat-small")
    assert m.series("search", "chat-small") is s
    s.request("ok").inc()
    s.request("ok").inc()
    s.request("client_aborted").inc()
    s.prompt.inc(12)
    s.completion.inc(30)
    s.in_flight.inc()
    s.in_flight.inc()
    s.in_flight.dec()
    get = m.registry.get_sample_value
    labels = {"team": "search", "model": "chat-small"}
    assert get("infermeter_requests_total", {**labels, "status": "ok"}) == 2
    assert get("infermeter_requests_total", {**labels, "status": "client_aborted"}) == 1
    assert get("infermeter_prompt_tokens_total", labels) == 12
    assert get("infermeter_completion_tokens_total", labels) == 30
    assert get("infermeter_requests_in_flight", labels) == 1
    # The same children labels() hands out, not copies.
    m.requests.labels("search", "chat-small", "ok").inc()
    assert s.request("ok") is m.requests.labels("search", "chat-small", "ok")
    assert get("infermeter_requests_total", {**labels, "status": "ok"}) == 3


def test_a_series_appears_only_once_something_is_counted_in_it() -> None:
    m = SidecarMetrics()
    s = m.series("search", "chat-small")
    s.in_flight.inc()
    get = m.registry.get_sample_value
    labels = {"team": "search", "model": "chat-small"}
    assert get("infermeter_requests_in_flight", labels) == 1
    for name in ("infermeter_prompt_tokens_total", "infermeter_cached_prompt_tokens_total",
                 "infermeter_usage_inexact_total"):  # fmt: skip
        assert get(name, labels) is None
    s.cached.inc(4)
    assert get("infermeter_cached_prompt_tokens_total", labels) == 4
    assert m.series("ads", "chat-small") is not s
