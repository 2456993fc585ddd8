"""Which replica (and so which model) runs on a GPU: a pure join of readings to configuration.

Two rules, the first that matches wins:

1. **Configuration.** A replica owns the GPUs listed in its ``gpus`` on its ``node``. An entry
   is a GPU index (``0``), a board UUID (``"GPU-..."``), or a MIG slice written
   ``"<index or UUID>/<GPU_I_ID>"`` (``"0/1"``). A whole-GPU entry owns every MIG slice of that
   board unless another replica names the slice itself. A replica with no ``gpus`` list owns
   nothing by this rule.
2. **Kubernetes pod label.** A GPU whose reading carries ``pod="vllm-<replica id>"``, or a pod
   name that continues with ``-`` after it (``vllm-small-0-0`` from a StatefulSet,
   ``vllm-small-0-7d9f8-abcde`` from a Deployment), belongs to that replica, on any node. When
   several replica ids fit, the longest one wins (``vllm-small-0-0`` is ``small-0``, not
   ``small``). Any namespace is accepted.

A GPU that neither rule places is idle capacity: its samples carry ``replica=None``.

The instance on a GPU (``owner_of``): a GPU placed by the pod label runs the instance named by
that label (the pod name is the instance id, its replica group found as above); a GPU placed by
the configuration runs the fixed replica itself, whose samples keep ``instance=None`` (billing
reads ``coalesce(instance, replica)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from collectors.sources import GpuReading
from infermeter.config import Replica

__all__ = ["POD_PREFIX", "Owner", "attribute", "configured_owner", "owner_of", "replica_for_pod"]

POD_PREFIX = "vllm-"


@dataclass(frozen=True, slots=True)
class Owner:
    """Who runs on a GPU: a replica group and its instance (None: a fixed replica, or nobody)."""

    replica: Replica | None
    instance: str | None = None


def owner_of(reading: GpuReading, replicas: Sequence[Replica]) -> Owner:
    """The replica group and instance that run on ``reading``'s GPU or MIG slice."""
    by_config = configured_owner(reading, replicas)
    if by_config is not None:
        return Owner(by_config)
    by_pod = replica_for_pod(reading.pod, replicas)
    return Owner(by_pod, reading.pod if by_pod is not None else None)


def attribute(reading: GpuReading, replicas: Sequence[Replica]) -> Replica | None:
    """The replica that runs on ``reading``'s GPU or MIG slice, or None."""
    return configured_owner(reading, replicas) or replica_for_pod(reading.pod, replicas)


def configured_owner(reading: GpuReading, replicas: Sequence[Replica]) -> Replica | None:
    """The replica whose configured ``gpus`` on its ``node`` hold ``reading``'s GPU, or None."""
    whole = None
    for replica in replicas:
        if replica.node != reading.node:
            continue
        for entry in replica.gpus:
            board, _, gi = str(entry).partition("/")
            if board not in (reading.gpu, reading.uuid):
                continue
            if gi and gi == reading.mig_instance:
                return replica
            if not gi and whole is None:
                whole = replica
    return whole


def replica_for_pod(pod: str | None, replicas: Sequence[Replica]) -> Replica | None:
    """The replica a pod name belongs to under the ``vllm-<replica id>`` rule, or None."""
    if not pod or not pod.startswith(POD_PREFIX):
        return None
    rest = pod[len(POD_PREFIX) :]
    best = None
    for replica in replicas:
        if (rest == replica.id or rest.startswith(replica.id + "-")) and (
            best is None or len(replica.id) > len(best.id)
        ):
            best = replica
    return best
