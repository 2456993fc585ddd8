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
    # vllm:cache_config_info: 4096 GPU blocks of 128 tokens.
    assert r.kv_cache_tokens == 4096 * 128


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


def test_kv_cache_capacity_of_data_parallel_engines_is_summed():
    """Two engines of 100 and 50 blocks of 16 tokens hold 2,400 tokens; an unresolved one adds nothing."""
    text = 'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n' + "".join(
        f'vllm:cache_config_info{{block_size="{size}",engine="{e}",num_gpu_blocks="{blocks}"}} 1.0\n'
        for e, blocks, size in ((0, "100", "16"), (1, "50", "16"), (2, "None", "16"))
    )
    assert engine_reading(text).kv_cache_tokens == 2400


def test_a_page_without_the_cache_info_leaves_the_capacity_unknown():
    """No vllm:cache_config_info: the capacity is None, not zero."""
    text = 'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    assert engine_reading(text).kv_cache_tokens is None


def test_the_simulated_engine_publishes_its_profile_capacity():
    """The simulator's page (vLLM 0.32's labels) reads back as its profile's KV-cache tokens."""
    from prometheus_client import generate_latest

    from infermeter.config import EngineProfile
    from simulator.vllm_metrics import VllmMetrics

    metrics = VllmMetrics("m", EngineProfile(kv_cache_tokens=120_000, block_size=16))
    metrics["num_requests_running"].set(3)
    reading = engine_reading(generate_latest(metrics.registry).decode())
    assert (reading.requests_running, reading.kv_cache_tokens) == (3.0, 120_000)


@pytest.mark.parametrize("blocks", ["\u00b2", "9" * 5000, "\uff11\uff12", ""])
def test_a_block_count_that_is_not_plain_digits_leaves_the_capacity_unknown(blocks):
    """A superscript or full-width digit, or a number of 5,000 digits, is no capacity, not a crash."""
    text = (
        "vllm:num_requests_running 1\n"
        f'vllm:cache_config_info{{num_gpu_blocks="{blocks}",block_size="16"}} 1\n'
    )
    assert engine_reading(text).kv_cache_tokens is None


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-1e9", "1e300"])
def test_an_impossible_count_refuses_the_page_naming_the_series(value):
    """A queue of NaN, infinity or a negative is no queue: the page is refused, not read as 0."""
    text = f"vllm:num_requests_running 1\nvllm:num_requests_waiting {value}\n"
    with pytest.raises(ExpositionError, match="vllm:num_requests_waiting is"):
        engine_reading(text)


@pytest.mark.parametrize(
    ("line", "series"),
    [
        ("vllm:num_requests_waiting 2000000", "vllm:num_requests_waiting"),
        ('vllm:kv_cache_usage_perc{engine="0"} 7.5', "vllm:kv_cache_usage_perc"),
        ('vllm:generation_tokens_total{engine="0"} 5e15', "vllm:generation_tokens_total"),
    ],
)
def test_a_count_past_billings_bounds_refuses_the_page(line, series):
    """Two million waiting requests, a KV cache 750 % used, a counter of 5e15 tokens: billing's
    ingest refuses such a sample (and its token counters with it), so the page is refused here,
    the engine down with the series named, not shipped to be rejected."""
    with pytest.raises(ExpositionError, match=f"{series} is"):
        engine_reading(f"vllm:num_requests_running 1\n{line}\n")


def test_a_series_given_twice_refuses_the_page():
    """Two lines of one series (a stale one beside the live one) were summed, 100 and 100 read
    as 200: which is true cannot be told, so the page is refused naming it; two engines'
    series (told apart by their labels) are still summed."""
    twice = 'vllm:num_requests_running{engine="0"} 100\n' * 2
    with pytest.raises(ExpositionError, match=r"vllm:num_requests_running.*is given twice"):
        engine_reading(twice)
    engines = (
        'vllm:num_requests_running{engine="0"} 100\nvllm:num_requests_running{engine="1"} 100\n'
    )
    assert engine_reading(engines).requests_running == 200
