"""The capacity planner, as the dashboard imports it; it lives in ``infermeter.planner``.

The arithmetic is shared with billing's efficiency advisor, which sits below the dashboards, so
it is in the core; this module keeps the dashboard's imports as they were.
"""

from infermeter.planner import (
    ACTIVATION_SHARE,
    BYTES_PER_PARAM,
    FIXED_GB_PER_GPU,
    GPU_MEMORY_UTILIZATION,
    GPUS_GB,
    MAX_TP,
    PRESETS,
    Fit,
    ModelShape,
    Plan,
    Preset,
    kv_cache_gb,
    plan,
    weights_gb,
)

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
