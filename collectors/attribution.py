"""Which replica (and so which model) runs on a GPU: a pure join of readings to what is known.

The rules, the first that matches wins:

1. **Configuration.** A replica owns the GPUs listed in its ``gpus`` on its ``node``. An entry
   is a GPU index (``0``), a board UUID (``"GPU-..."``), or a MIG slice written
   ``"<index or UUID>/<GPU_I_ID>"`` (``"0/1"``). A whole-GPU entry owns every MIG slice of that
   board unless another replica names the slice itself. A replica with no ``gpus`` list owns
   nothing by this rule.
2. **The pod, by its labels** (``Placement``, from discovery). dcgm-exporter names the pod that
   holds each GPU (``namespace``, ``pod``, ``container``). A GPU whose reading names a pod that
   discovery found, in the same namespace, runs that pod: its instance is the pod name, its
   replica group what the pod's ``infermeter.io/replica`` label says (``collectors.targets``),
   whatever the pod is called. A reading with no namespace matches a pod of that name only when
   one namespace has it.
3. **The devices an instance announced.** An instance found through billing's registry names
   its GPUs (``NVIDIA_VISIBLE_DEVICES``: UUIDs or indices); a GPU on the same node listed there
   runs that instance, for a dcgm-exporter without pod mapping.
4. **The pod name** ``vllm-<replica id>[-...]`` (the longest id wins; any namespace), only where
   no discovery places pods (``placements`` is None): the fixed fleets of the demo and of
   configurations without discovery. With discovery, a pod it does not know is not guessed from
   its name.

A GPU that no rule places is idle capacity: its samples carry ``replica=None``.

The instance on a GPU (``owner_of``): a GPU placed by its pod runs that pod (the pod name is the
instance id); a GPU placed by the configuration runs the fixed replica itself, whose samples
keep ``instance=None`` (billing reads ``coalesce(instance, replica)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from collectors.sources import GpuReading
from infermeter.config import Replica

__all__ = [
    "POD_PREFIX",
    "Owner",
    "Placement",
    "Placements",
    "attribute",
    "configured_owner",
    "owner_of",
    "replica_for_pod",
]

POD_PREFIX = "vllm-"


@dataclass(frozen=True, slots=True)
class Owner:
    """Who runs on a GPU: a replica group and its instance (None: a fixed replica, or nobody)."""

    replica: Replica | None
    instance: str | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """An instance discovery found: its group, where it runs, and the GPUs it announced."""

    replica: str
    instance: str
    node: str | None = None
    namespace: str | None = None
    gpus: tuple[str, ...] = ()


class Placements:
    """The instances discovery knows, indexed for the join: by pod, and by node and device."""

    def __init__(self, placed: Iterable[Placement]) -> None:
        self.by_pod: dict[tuple[str | None, str], Placement] = {}
        self.by_name: dict[str, list[Placement]] = {}
        self.by_device: dict[tuple[str, str], Placement] = {}
        for p in placed:
            self.by_pod[(p.namespace, p.instance)] = p
            self.by_name.setdefault(p.instance, []).append(p)
            for gpu in p.gpus:
                if p.node is not None:
                    self.by_device[(p.node, gpu)] = p

    def __len__(self) -> int:
        return len(self.by_pod)

    def pod(self, namespace: str | None, name: str) -> Placement | None:
        """The instance called ``name`` in ``namespace`` (any one namespace, when None)."""
        if namespace is not None:
            return self.by_pod.get((namespace, name)) or self.by_pod.get((None, name))
        found = self.by_name.get(name, [])
        return found[0] if len(found) == 1 else None

    def device(self, reading: GpuReading) -> Placement | None:
        """The instance that announced this GPU (by UUID, else index) on the reading's node."""
        for gpu in (reading.uuid, reading.gpu):
            found = self.by_device.get((reading.node, gpu))
            if found is not None:
                return found
        return None


def owner_of(
    reading: GpuReading,
    replicas: Sequence[Replica],
    placements: Placements | None = None,
    name_rule: bool = False,
) -> Owner:
    """The replica group and instance that run on ``reading``'s GPU or MIG slice.

    ``placements``: the instances discovery found (None: no discovery, the pod-name rule).
    ``name_rule``: with discovery too, the pod-name rule for a pod it does not place. Registry
    discovery learns of an instance only once its start event reached billing and the next
    refresh ran, seconds after dcgm-exporter labels its GPU with the pod: without the rule, a
    starting instance's first seconds of GPU time went to idle capacity (2 % of a scaling
    group's GPU-hours). Kubernetes discovery reads the pods themselves, and never guesses.
    """
    by_config = configured_owner(reading, replicas)
    if by_config is not None:
        return Owner(by_config)
    if placements is None:
        return _by_name(reading, replicas)
    placed = placements.pod(reading.namespace, reading.pod) if reading.pod else None
    if placed is None:
        placed = placements.device(reading)
    group = _replica(placed.replica, replicas) if placed is not None else None
    if placed is None or group is None:
        return _by_name(reading, replicas) if name_rule else Owner(None)
    return Owner(group, placed.instance)


def _by_name(reading: GpuReading, replicas: Sequence[Replica]) -> Owner:
    by_pod = replica_for_pod(reading.pod, replicas)
    return Owner(by_pod, reading.pod if by_pod is not None else None)


def attribute(
    reading: GpuReading, replicas: Sequence[Replica], placements: Placements | None = None
) -> Replica | None:
    """The replica that runs on ``reading``'s GPU or MIG slice, or None."""
    return owner_of(reading, replicas, placements).replica


def _replica(group: str, replicas: Sequence[Replica]) -> Replica | None:
    return next((r for r in replicas if r.id == group), None)


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
