"""Capacity planner: will a model fit on a GPU, on how many, and at what hourly price.

Pure arithmetic, no I/O, so the dashboard page and ``infermeter plan`` give the same answer and
the numbers can be checked by hand. Sizes are decimal gigabytes (1 GB = 10^9 bytes), as GPU
vendors state memory and as parameter counts are quoted, so "70B at 16 bits" is 140 GB.

What one replica needs, spread evenly over its ``tp`` tensor-parallel GPUs:

- weights: ``params x bytes per parameter`` (fp16/bf16 2, fp8/int8 1, int4 0.5);
- KV cache: ``2 (K and V) x layers x kv_heads x head_dim x kv bytes x context x concurrency``,
  with the KV cache in 16 bits unless asked otherwise (vLLM's ``kv_cache_dtype=auto`` keeps
  the model's compute dtype even when the weights are quantised);
- runtime overhead: ``ACTIVATION_SHARE`` (10%) on top of weights and KV cache for activations,
  CUDA graphs and fragmentation, plus ``FIXED_GB_PER_GPU`` per GPU for the CUDA context and NCCL
  buffers.

A GPU offers ``memory x GPU_MEMORY_UTILIZATION`` (vLLM's default ``gpu_memory_utilization``
0.9). ``tp`` is the smallest power of two up to ``MAX_TP`` (one 8-GPU node) that divides the
KV heads and gives every GPU enough memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ACTIVATION_SHARE",
    "BYTES_PER_PARAM",
    "FIXED_GB_PER_GPU",
    "GPUS_GB",
    "GPU_MEMORY_UTILIZATION",
    "MAX_TP",
    "PRESETS",
    "Fit",
    "ModelShape",
    "Plan",
    "Preset",
    "kv_cache_gb",
    "plan",
    "weights_gb",
]

BYTES_PER_PARAM: Final[Mapping[str, float]] = {
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
# Memory as the vendors state it, in GB; keys follow the price book's GPU names.
GPUS_GB: Final[Mapping[str, float]] = {
    "H200": 141.0,
    "H100": 80.0,
    "A100-80GB": 80.0,
    "A100-40GB": 40.0,
    "L40S": 48.0,
    "A10G": 24.0,
    "L4": 24.0,
    "T4": 16.0,
}
GPU_MEMORY_UTILIZATION: Final = 0.9
ACTIVATION_SHARE: Final = 0.10
FIXED_GB_PER_GPU: Final = 1.0
MAX_TP: Final = 8
_GB: Final = 1e9


@dataclass(frozen=True, slots=True)
class Preset:
    """A known model's size and attention shape."""

    params_billions: float
    layers: int
    kv_heads: int
    head_dim: int


PRESETS: Final[Mapping[str, Preset]] = {
    "Llama-3.1-8B": Preset(8.0, 32, 8, 128),
    "Llama-3.1-70B": Preset(70.0, 80, 8, 128),
    "Llama-3.1-405B": Preset(405.0, 126, 8, 128),
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the planner is asked: the model, its precision and the load it must hold."""

    params_billions: float
    precision: str
    context_tokens: int
    concurrency: int
    layers: int
    kv_heads: int
    head_dim: int
    kv_precision: str = "fp16"

    def __post_init__(self) -> None:
        for name in ("precision", "kv_precision"):
            value = getattr(self, name)
            if value not in BYTES_PER_PARAM:
                known = ", ".join(BYTES_PER_PARAM)
                raise ValueError(f"{name} {value!r} is not one of {known}")
        if not 0 < self.params_billions <= _MAX_PARAMS_BILLIONS:
            raise ValueError(
                f"params_billions must be positive and at most {_MAX_PARAMS_BILLIONS:,}, "
                f"not {self.params_billions}"
            )
        for name, most in _MOST.items():
            if not 1 <= getattr(self, name) <= most:
                raise ValueError(
                    f"{name} must be at least 1 and at most {most:,}, not {getattr(self, name)}"
                )


# Bounds past any model or deployment: a figure beyond them is a typing slip (or 1e999).
_MAX_PARAMS_BILLIONS = 100_000
_MOST = {
    "context_tokens": 100_000_000,
    "concurrency": 1_000_000,
    "layers": 100_000,
    "kv_heads": 100_000,
    "head_dim": 100_000,
}


@dataclass(frozen=True, slots=True)
class Fit:
    """One GPU model's answer: how many GPUs (None: not on one node) and the hourly price."""

    gpu: str
    memory_gb: float
    tensor_parallel: int | None
    per_gpu_gb: float | None
    usd_per_hour: float | None

    @property
    def fits(self) -> bool:
        """True when the replica fits on at most ``MAX_TP`` of these GPUs."""
        return self.tensor_parallel is not None


@dataclass(frozen=True, slots=True)
class Plan:
    """Memory a replica needs, and the fit on every GPU model asked about."""

    weights_gb: float
    kv_cache_gb: float
    overhead_gb: float
    fits: tuple[Fit, ...]

    @property
    def total_gb(self) -> float:
        """Weights, KV cache and the proportional overhead (the fixed per-GPU part excluded)."""
        return self.weights_gb + self.kv_cache_gb + self.overhead_gb


def weights_gb(params_billions: float, precision: str) -> float:
    """GB of weights: parameters times bytes per parameter."""
    return params_billions * 1e9 * BYTES_PER_PARAM[precision] / _GB


def kv_cache_gb(shape: ModelShape) -> float:
    """GB of KV cache for ``concurrency`` sequences of ``context_tokens`` each."""
    per_token = (
        2 * shape.layers * shape.kv_heads * shape.head_dim * BYTES_PER_PARAM[shape.kv_precision]
    )
    return per_token * shape.context_tokens * shape.concurrency / _GB


def _tensor_parallel(need_gb: float, gpu_gb: float, kv_heads: int) -> tuple[int, float] | None:
    usable = gpu_gb * GPU_MEMORY_UTILIZATION
    tp = 1
    while tp <= MAX_TP:
        per_gpu = need_gb / tp + FIXED_GB_PER_GPU
        if kv_heads % tp == 0 and per_gpu <= usable:
            return tp, per_gpu
        tp *= 2
    return None


def plan(
    shape: ModelShape,
    usd_per_gpu_hour: Mapping[str, float],
    gpus: Mapping[str, float] = GPUS_GB,
) -> Plan:
    """Size one replica of ``shape`` on every GPU of ``gpus``, priced by ``usd_per_gpu_hour``."""
    weights = weights_gb(shape.params_billions, shape.precision)
    kv = kv_cache_gb(shape)
    overhead = (weights + kv) * ACTIVATION_SHARE
    fits = []
    for gpu, memory in gpus.items():
        found = _tensor_parallel(weights + kv + overhead, memory, shape.kv_heads)
        tp, per_gpu = found if found else (None, None)
        price = usd_per_gpu_hour.get(gpu)
        cost = tp * price if tp is not None and price is not None else None
        fits.append(Fit(gpu, memory, tp, per_gpu, cost))
    return Plan(weights, kv, overhead, tuple(fits))
