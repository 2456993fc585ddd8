"""Which vLLM engines to scrape: pure functions from what a discovery source said to targets.

A target is one engine instance: its replica group, its own id (None for a fixed replica of the
configuration, which is its own single instance) and the URL of its metrics page. Three
sources name them, and each has a function here that turns its answer into a target set keyed
by instance id, with no I/O:

- ``static_targets``: ``replicas[]`` of the configuration (``engine_metrics_url``, else
  ``<upstream_url>/metrics``), as before instances existed;
- ``registry_targets``: billing's ``GET /v1/instances`` answer, each live instance at its
  ``engine_metrics_url``: billing takes from an instance no address but the one its writer
  credential names, and the collector sends the metrics token only to a sidecar's relay there
  (``http://<host>:<port>/engine/metrics``, nothing else in the URL);
- ``pod_target`` and ``apply_pod_event``: the Kubernetes pods of a list and of each watch event;
  an engine is read at ``http://<pod IP>:<sidecar port>/engine/metrics``, never through a Service
  (which would answer from a random pod each scrape).

An entry whose group is not in the configuration is left out: its samples could not be priced.

``placements`` turns a target set into what GPU attribution joins readings to
(``collectors.attribution.Placements``): each instance by its namespace and pod name, and by the
devices it announced.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from collectors.attribution import Placement, Placements, replica_for_pod
from infermeter.config import Replica

__all__ = [
    "DiscoveryError",
    "EngineTarget",
    "PodRules",
    "apply_pod_event",
    "changes",
    "listed_pods",
    "placements",
    "pod_target",
    "registry_targets",
    "static_targets",
]

Targets = Mapping[str, "EngineTarget"]

# A sidecar's relay of vLLM's metrics, and nothing else: no credentials, query or other path.
_RELAY: Final = re.compile(
    r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}/engine/metrics"
)


class DiscoveryError(ValueError):
    """A discovery source answered something that is not what its contract promises."""


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One engine to scrape.

    ``token`` says whether the metrics token is sent: a sidecar's ``/engine/metrics`` needs it;
    a plain vLLM ``/metrics`` must never see it. ``node``: where the engine runs, as the source
    said (its samples carry it; billing checks it against the collector's credential).
    """

    replica: str
    url: str
    instance: str | None = None
    token: bool = True
    node: str | None = None
    namespace: str | None = None
    gpus: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The target's name in state, logs and sample ids: the instance id, else the replica id."""
        return self.instance or self.replica


@dataclass(frozen=True, slots=True)
class PodRules:
    """How a pod becomes a target: its group's label, and where its sidecar relays vLLM's metrics."""

    replica_label: str = "infermeter.io/replica"
    sidecar_port: int = 9000
    engine_metrics_path: str = "/engine/metrics"


def static_targets(replicas: Sequence[Replica]) -> dict[str, EngineTarget]:
    """One target per configured replica; the token only where a relay URL was configured."""
    return {
        r.id: EngineTarget(
            r.id, r.engine_metrics, token=r.engine_metrics_url is not None, node=r.node
        )
        for r in replicas
    }


def registry_targets(answer: Any, replicas: Sequence[Replica]) -> dict[str, EngineTarget]:
    """Targets from a ``GET /v1/instances`` body; DiscoveryError when it breaks the contract.

    A fixed replica (instance id equal to its group id) keeps ``instance=None``, as its samples
    did before instances existed. An instance without an engine URL or in an unknown group is
    skipped; so is one whose URL is not a sidecar's relay (``_RELAY``), which the metrics token
    must not be sent to.
    """
    if not isinstance(answer, dict) or not isinstance(answer.get("instances"), list):
        raise DiscoveryError('the registry answered without an "instances" list')
    groups = {r.id for r in replicas}
    out = {}
    for item in answer["instances"]:
        if not isinstance(item, dict):
            raise DiscoveryError(f"an instance entry is not an object: {str(item)[:80]!r}")
        instance, replica, url = (
            item.get("instance"),
            item.get("replica"),
            item.get("engine_metrics_url"),
        )
        if not isinstance(instance, str) or not isinstance(replica, str):
            raise DiscoveryError(
                f"an instance entry has no instance or replica id: {str(item)[:120]!r}"
            )
        if item.get("state", "live") != "live" or not isinstance(url, str) or not url:
            continue
        if replica not in groups or not _RELAY.fullmatch(url):
            continue
        node, namespace, gpus = item.get("node"), item.get("namespace"), item.get("gpus")
        target = EngineTarget(
            replica,
            url,
            None if instance == replica else instance,
            node=node if isinstance(node, str) else None,
            namespace=namespace if isinstance(namespace, str) else None,
            gpus=tuple(g for g in gpus if isinstance(g, str)) if isinstance(gpus, list) else (),
        )
        out[target.key] = target
    return out


def pod_target(pod: Any, replicas: Sequence[Replica], rules: PodRules) -> EngineTarget | None:
    """The engine a pod object runs, or None while it cannot be scraped (no IP, not running, no group)."""
    if not isinstance(pod, dict):
        return None
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name, ip = meta.get("name"), status.get("podIP")
    if not isinstance(name, str) or not isinstance(ip, str) or not ip:
        return None
    if status.get("phase") != "Running":
        return None
    group = _group(name, meta.get("labels") or {}, replicas, rules)
    if group is None:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    node = (pod.get("spec") or {}).get("nodeName")
    namespace = meta.get("namespace")
    return EngineTarget(
        group,
        f"http://{host}:{rules.sidecar_port}{rules.engine_metrics_path}",
        name,
        node=node if isinstance(node, str) else None,
        namespace=namespace if isinstance(namespace, str) else None,
    )


def _group(
    name: str, labels: Mapping[str, Any], replicas: Sequence[Replica], rules: PodRules
) -> str | None:
    labelled = labels.get(rules.replica_label)
    if isinstance(labelled, str):
        return labelled if any(r.id == labelled for r in replicas) else None
    owner = replica_for_pod(name, replicas)
    return owner.id if owner else None


def listed_pods(
    answer: Any, replicas: Sequence[Replica], rules: PodRules
) -> tuple[dict[str, EngineTarget], str]:
    """The targets of a PodList and its resourceVersion (where the watch starts)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("items"), list):
        raise DiscoveryError("the pod list has no items")
    version = (answer.get("metadata") or {}).get("resourceVersion")
    if not isinstance(version, str):
        raise DiscoveryError("the pod list has no resourceVersion")
    targets = {}
    for pod in answer["items"]:
        target = pod_target(pod, replicas, rules)
        if target is not None:
            targets[target.key] = target
    return targets, version


def apply_pod_event(
    targets: Targets, event: str, pod: Any, replicas: Sequence[Replica], rules: PodRules
) -> dict[str, EngineTarget]:
    """The target set after one watch event (ADDED, MODIFIED or DELETED) about ``pod``.

    A pod that can no longer be scraped (deleted, finished, lost its IP) leaves the set; one that
    can joins it or replaces its entry.
    """
    name = ((pod.get("metadata") or {}) if isinstance(pod, dict) else {}).get("name")
    if not isinstance(name, str):
        raise DiscoveryError(f"a {event} event names no pod")
    out = dict(targets)
    target = None if event == "DELETED" else pod_target(pod, replicas, rules)
    if target is None:
        out.pop(name, None)
    else:
        out[target.key] = target
    return out


def changes(before: Targets, after: Targets) -> tuple[list[str], list[str]]:
    """The keys that appeared and those that vanished (a changed URL is neither), sorted."""
    return sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())


def placements(targets: Targets) -> Placements:
    """The instances of ``targets`` as GPU attribution joins them (fixed replicas are not placed)."""
    return Placements(
        Placement(t.replica, t.instance, t.node, t.namespace, t.gpus)
        for t in targets.values()
        if t.instance is not None
    )
