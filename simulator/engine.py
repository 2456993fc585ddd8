"""The simulated replicas' engine: vLLM's continuous-batching loop, from the core's engine model.

The model itself (``infermeter.engine_model``) is shared with the efficiency advisor's replay,
which must not import the simulator; the simulator drives it on asyncio's clock
(``simulator.replica``) and its tests on a virtual one.
"""

from __future__ import annotations

from infermeter.engine_model import (
    MAX_NUM_BATCHED_TOKENS,
    PREFIX_CACHE_BLOCKS,
    Counters,
    Scheduler,
    Sequence,
    Step,
)

__all__ = [
    "MAX_NUM_BATCHED_TOKENS",
    "PREFIX_CACHE_BLOCKS",
    "Counters",
    "Scheduler",
    "Sequence",
    "Step",
]
