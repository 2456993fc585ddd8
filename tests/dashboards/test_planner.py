"""The capacity planner's arithmetic, checked against sizings known from practice."""

from __future__ import annotations

import pytest

from infermeter.planner import (
    PRESETS,
    ModelShape,
    kv_cache_gb,
    plan,
    weights_gb,
)

PRICES = {"H100": 3.90, "H200": 5.0, "L40S": 1.60}


def shape(
    params: float = 70,
    precision: str = "fp16",
    context: int = 8192,
    concurrency: int = 16,
    preset: str = "Llama-3.1-70B",
) -> ModelShape:
    p = PRESETS[preset]
    return ModelShape(params, precision, context, concurrency, p.layers, p.kv_heads, p.head_dim)


@pytest.mark.parametrize(
    ("precision", "expected_gb"),
    [("fp16", 140.0), ("bf16", 140.0), ("fp8", 70.0), ("int8", 70.0), ("int4", 35.0)],
)
def test_weights_of_a_70b_model_by_precision(precision, expected_gb):
    """70B parameters take 140 GB at 16 bits, 70 GB at 8 bits and 35 GB at 4 bits."""
    assert weights_gb(70, precision) == pytest.approx(expected_gb)


def test_kv_cache_of_llama_70b():
    """Llama-3.1-70B holds 2 x 80 x 8 x 128 x 2 = 327,680 bytes of KV cache per token."""
    s = shape(context=1000, concurrency=1)
    assert kv_cache_gb(s) == pytest.approx(327_680 * 1000 / 1e9)


def test_kv_cache_grows_with_context_and_concurrency():
    """Doubling the context or the concurrent sequences doubles the KV cache."""
    base = kv_cache_gb(shape(context=4096, concurrency=8))
    assert kv_cache_gb(shape(context=8192, concurrency=8)) == pytest.approx(2 * base)
    assert kv_cache_gb(shape(context=4096, concurrency=16)) == pytest.approx(2 * base)


def test_70b_fp8_fits_one_h200():
    """A 70B model at 8 bits with a small load fits on a single H200 but needs two H100s."""
    result = plan(shape(precision="fp8", context=8192, concurrency=4), PRICES)
    fits = {f.gpu: f for f in result.fits}
    assert fits["H200"].tensor_parallel == 1
    assert fits["H100"].tensor_parallel == 2
    assert fits["H100"].usd_per_hour == pytest.approx(2 * 3.90)


def test_70b_fp16_never_fits_one_gpu():
    """At 16 bits the weights alone (140 GB) exceed any single GPU's usable memory."""
    result = plan(shape(precision="fp16", concurrency=1), PRICES)
    assert all(f.tensor_parallel != 1 for f in result.fits)
    assert {f.gpu: f.tensor_parallel for f in result.fits}["H100"] == 4


def test_405b_fp8_fits_one_node_of_h100_but_not_fp16():
    """Llama 405B at 8 bits is served on 8 H100s; at 16 bits (810 GB) it does not fit one node."""
    fp8 = {f.gpu: f for f in plan(shape(405, "fp8", 4096, 4, "Llama-3.1-405B"), PRICES).fits}
    fp16 = {f.gpu: f for f in plan(shape(405, "fp16", 4096, 4, "Llama-3.1-405B"), PRICES).fits}
    assert fp8["H100"].tensor_parallel == 8
    assert not fp16["H100"].fits
    assert fp16["H100"].usd_per_hour is None


def test_8b_fits_small_gpus():
    """Llama 8B at 16 bits (16 GB of weights) fits one L40S and one 24 GB card, not a T4."""
    fits = {f.gpu: f for f in plan(shape(8, "fp16", 4096, 4, "Llama-3.1-8B"), PRICES).fits}
    assert fits["L40S"].tensor_parallel == 1
    assert fits["L4"].tensor_parallel == 1
    assert fits["T4"].tensor_parallel == 2


def test_tensor_parallel_must_divide_kv_heads():
    """With 2 KV heads the planner never picks 4 or 8 GPUs, even when memory would need it."""
    s = ModelShape(70, "fp16", 2048, 1, 80, 2, 128)
    assert {f.gpu: f.tensor_parallel for f in plan(s, PRICES).fits}["H100"] is None


def test_unpriced_gpu_has_no_price():
    """A GPU missing from the price book fits but has no hourly price."""
    fits = {f.gpu: f for f in plan(shape(8, "fp16", 4096, 4, "Llama-3.1-8B"), PRICES).fits}
    assert fits["A10G"].fits
    assert fits["A10G"].usd_per_hour is None


def test_overhead_is_a_tenth_of_weights_and_cache():
    """The proportional runtime overhead is 10% of weights plus KV cache."""
    result = plan(shape(precision="int4"), PRICES)
    assert result.overhead_gb == pytest.approx(0.1 * (result.weights_gb + result.kv_cache_gb))
    assert result.total_gb == pytest.approx(1.1 * (35 + result.kv_cache_gb))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp4"}, "precision 'fp4' is not one of"),
        ({"params": 0}, "params_billions must be positive"),
        ({"context": 0}, "context_tokens must be at least 1"),
        ({"params": float("inf")}, "params_billions must be positive and at most 100,000"),
        ({"params": float("nan")}, "params_billions must be positive and at most 100,000"),
        ({"context": 10**12}, "context_tokens must be at least 1 and at most 100,000,000"),
    ],
)
def test_bad_input_is_refused_with_its_name(kwargs, message):
    """A bad precision or size raises ValueError naming the field and the value."""
    with pytest.raises(ValueError, match=message):
        shape(**kwargs)
