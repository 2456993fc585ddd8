"""What a running autoscaler takes from a reloaded configuration, and what it refuses.

``infermeter autoscale run`` reloads its file on SIGHUP and when the file changes
(``infermeter.reload.Reloader``). The policy is data the next tick reads: the ``scaling``
section (thresholds, cool-downs, ``min_replicas``, ``max_replicas``, the budget cap), the models'
SLAs (``sla.ttft_p95_seconds``), the prices the budget cap is counted in, and the predictive
term's ``autoscale.predictive`` and ``autoscale.target_gpu_utilization``. All of them apply from
the next tick, with the models' demand history and cool-downs kept.

The rest of the ``autoscale`` section was built into the running process at start: where it
listens, how often it ticks, what it reads (collector, sidecars, Prometheus, their token), the
hooks it calls, where its history and decisions go, the credential it writes with. A new file
that changes any of them is refused, naming each one (``restart_needed``), and the configuration
in force stays whole: half a reload would leave the file saying one thing and the process doing
another. So is a change of the models' list (the inputs read and the history kept are per model),
and of what the readers derive from other sections when no URL is given (the collector's listen
address, the replicas' sidecar addresses), and, with the local hook on, of the replicas and
nodes it places instances on.
"""

from __future__ import annotations

from typing import Any, Final

from alerts.autoscale.policy import ModelLimits, PolicyParams, model_limits, params_from_config
from infermeter.config import Config

__all__ = ["RELOADABLE_AUTOSCALE", "policy_of", "restart_needed"]

# The ``autoscale`` keys a running autoscaler takes (its other keys need a restart).
RELOADABLE_AUTOSCALE: Final = frozenset({"predictive", "target_gpu_utilization"})


def policy_of(config: Config, day_seconds: float) -> tuple[PolicyParams, dict[str, ModelLimits]]:
    """The policy's knobs and each model's limits (SLA, replica bounds) under ``config``."""
    params = params_from_config(config, day_seconds=day_seconds)
    return params, {m.name: model_limits(config, m.name) for m in config.models}


def restart_needed(
    running: Config, fresh: Config, *, listen: str | None = None, prometheus_url: str | None = None
) -> list[str]:
    """Each setting that ``fresh`` changes from ``running`` and only a restart would take.

    ``listen`` and ``prometheus_url``: the command line's ``--listen`` and ``--prometheus``,
    which win over the file, so the file's own values of those do not matter.
    """
    before, after = (
        _structure(running, listen, prometheus_url),
        _structure(fresh, listen, prometheus_url),
    )
    return [
        f"{key}: {before[key]!r} -> {after.get(key)!r} needs a restart of the autoscaler"
        for key in before
        if before[key] != after.get(key)
    ]


def _structure(config: Config, listen: str | None, prometheus_url: str | None) -> dict[str, Any]:
    """The settings built into a running autoscaler, by dotted name."""
    a = config.autoscale
    skip = set(RELOADABLE_AUTOSCALE)
    if listen:
        skip.add("listen")
    if prometheus_url:
        skip.add("prometheus_url")
    # The history's save period is read by the history file built at start, like its path.
    out: dict[str, Any] = {
        f"autoscale.{key}": value for key, value in a.model_dump().items() if key not in skip
    }
    out["models"] = [m.name for m in config.models]
    uses_pages = not (prometheus_url or a.prometheus_url)
    if uses_pages and not a.collector_url:
        out["collector.listen"] = config.collector.listen
    if uses_pages and not a.sidecar_urls:
        out["replicas[].sidecar_listen"] = [r.sidecar_listen for r in config.replicas]
    if a.local.enabled:
        out["replicas"] = [r.model_dump() for r in config.replicas]
        out["nodes"] = [n.model_dump() for n in config.nodes]
    return out
