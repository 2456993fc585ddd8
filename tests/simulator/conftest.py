"""A simulated replica serving the same model name and context length as the captures."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from infermeter.config import EngineProfile, GpuProfile
from simulator.replica import ReplicaSim, ReplicaSpec
from tests.servers import serving

FAST = EngineProfile(
    max_num_seqs=32,
    kv_cache_tokens=65536,
    step_base_ms=2,
    step_per_seq_ms=0.05,
    prefill_tokens_per_second=200_000,
    mean_output_tokens=40,
)
GPU = GpuProfile(idle_watts=50, max_watts=300, memory_mib=24576, product_name="NVIDIA L4")


def tiny_spec(engine: EngineProfile = FAST, gpus: int = 1, max_model_len: int = 512) -> ReplicaSpec:
    """A replica shaped like the one the captures came from: model 'tiny', 512 tokens."""
    return ReplicaSpec("tiny-0", "tiny", max_model_len, engine, GPU, gpus, seed=11)


@pytest.fixture
async def replica() -> AsyncIterator[tuple[ReplicaSim, str]]:
    """A running simulated replica and its base URL."""
    sim = ReplicaSim(tiny_spec())
    async with serving(sim) as url:
        yield sim, url
