"""vLLM /metrics pages become engine readings."""

from __future__ import annotations

import pytest

from collectors.exposition import ExpositionError
from collectors.vllm import engine_reading


def test_real_vllm_capture(fixture_text):
    """The vLLM 0.32 capture: queue, batch, KV cache and the token and cache counters."""
    r = engine_reading(fixture_text("vllm-0.32-metrics.prom"))
    assert (r.requests_running, r.requests_waiting, r.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert (r.prompt_tokens_total, r.generation_tokens_total) == (2097.0, 6965.0)
    assert (r.prefix_cache_queries_total, r.prefix_cache_hits_total) == (2097.0, 0.0)
    assert r.preemptions_total == 0.0


def test_engines_of_one_replica_are_summed_and_kv_cache_averaged():
    """Data-parallel engines: counts add up, KV-cache usage is the mean."""
    text = "".join(
        f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {e + 1}.0\n'
        f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} 2.0\n'
        f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {0.2 * (e + 1)}\n'
        f'vllm:prompt_tokens_total{{engine="{e}",model_name="m"}} 10.0\n'
        for e in range(2)
    )
    r = engine_reading(text)
    assert (r.requests_running, r.requests_waiting) == (3.0, 4.0)
    assert r.kv_cache_usage == pytest.approx(0.3)
    assert r.prompt_tokens_total == 20.0


def test_a_page_that_is_not_vllm_is_refused(fixture_text):
    """A dcgm-exporter page served where vLLM should be is an error, not zeros."""
    with pytest.raises(ExpositionError, match="num_requests_running"):
        engine_reading(fixture_text("dcgm-exporter-rtx4000ada-k8s.prom"))
