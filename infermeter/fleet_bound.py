"""How many live instances a replica group may have: the bound on a count the fleet reports itself.

Instances announce themselves (their sidecars ship start and heartbeat events to billing), so a
count of live instances is only as honest as every writer. Where such a count steers something,
it is not trusted past what the configuration, or the autoscaler acting within it, allows: a
sidecar's fail-open limits split by it (``sidecar.live_instances``), billing's instance registry
lists no more (``billing.lifetimes``), so a collector is never handed more engines to read. 250
forged live instances must not divide every team's limit by 250.

The bound errs high: a loose bound only weakens that protection; a tight one would give a real
fleet more than its share of a limit and hide real engines from the collectors.
"""

from __future__ import annotations

from infermeter.config import Config, ScalingPolicy

__all__ = ["group_bound", "instance_bound"]


def group_bound(scaling: ScalingPolicy, asked: int = 0) -> int:
    """The most live instances one replica group may have.

    Its configured replica, and up to ``scaling.max_replicas`` more (the autoscaler's ceiling).
    Without a ceiling, ``min_replicas`` more, or ``asked`` more when the autoscaler has lately
    asked for more than that (``asked``: the most it asked for, when the caller knows it).
    """
    if scaling.max_replicas is not None:
        return 1 + max(scaling.max_replicas, scaling.min_replicas, 1)
    return 1 + max(scaling.min_replicas, asked, 1)


def instance_bound(config: Config, replica: str | None) -> int:
    """The most instances the configuration lets share a limit: of replica group ``replica``,
    or of the whole fleet (every configured group) when None."""
    groups = 1 if replica is not None else max(1, len(config.replicas))
    return group_bound(config.scaling) * groups
