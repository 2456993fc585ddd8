"""GPUs are joined to replicas by configuration, then by the pods discovery found (their namespace
and name, or the devices they announced), and without discovery by the vllm-<replica> pod name."""

from __future__ import annotations

import pytest

from collectors.attribution import Placement, Placements, attribute, owner_of, replica_for_pod
from collectors.targets import EngineTarget, placements
from infermeter.config import Replica
from tests.collectors.fakes import reading


def _replica(rid: str, node: str = "node-a", gpus: list[int | str] | None = None) -> Replica:
    gpus = gpus or []
    return Replica(
        id=rid,
        model="m",
        upstream_url="http://127.0.0.1:1",
        node=node,
        gpu_model="H100",
        gpu_count=max(1, len(gpus)),
        gpus=gpus,
    )


REPLICAS = [
    _replica("big", gpus=[0, 1]),
    _replica("by-uuid", gpus=["GPU-cafe"]),
    _replica("slice", gpus=["2/1"]),
    _replica("slice-uuid", gpus=["GPU-dddd/2"]),
    _replica("whole", gpus=[2]),
    _replica("other-node", node="node-b", gpus=[0]),
    _replica("small"),
    _replica("small-0"),
]


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"gpu": "1"}, "big"),
        ({"node": "node-b", "gpu": "0"}, "other-node"),
        ({"gpu": "7", "uuid": "GPU-cafe"}, "by-uuid"),
        ({"gpu": "2", "mig_instance": "1", "mig_profile": "1g.10gb"}, "slice"),
        ({"gpu": "2", "mig_instance": "3", "mig_profile": "1g.10gb"}, "whole"),
        ({"gpu": "5", "uuid": "GPU-dddd", "mig_instance": "2"}, "slice-uuid"),
        ({"gpu": "5", "pod": "vllm-small-0-0"}, "small-0"),
        ({"gpu": "5", "pod": "vllm-small-7d9f8-abcde"}, "small"),
        ({"gpu": "5", "node": "node-z", "pod": "vllm-small-0"}, "small-0"),
        ({"gpu": "1", "pod": "vllm-small-0-0"}, "big"),
        ({"gpu": "5", "pod": "vllm-smallish-0"}, None),
        ({"gpu": "5", "pod": "cuda-75454ffb9f-8ljq7"}, None),
        ({"gpu": "5"}, None),
    ],
    ids=[
        "index",
        "index-on-its-node",
        "uuid",
        "mig-slice",
        "whole-gpu-owns-other-slices",
        "mig-slice-by-uuid",
        "pod-statefulset",
        "pod-deployment",
        "pod-any-node",
        "config-beats-pod",
        "pod-prefix-needs-dash",
        "foreign-pod",
        "idle-capacity",
    ],
)
def test_attribute(kw, expected):
    """Configuration first (index, UUID, MIG slice), then the pod label, else idle."""
    owner = attribute(reading(**kw), REPLICAS)
    assert (owner.id if owner else None) == expected


def test_longest_replica_id_wins_for_a_pod():
    """vllm-small-0-0 is replica small-0, though replica small would fit too."""
    owner = replica_for_pod("vllm-small-0-0", REPLICAS)
    assert owner is not None
    assert owner.id == "small-0"


PLACED = Placements(
    [
        Placement("small", "chat-0", node="node-a", namespace="inference"),
        Placement("small-0", "frontdoor-7d9f8-x", node="node-a", namespace="team-b"),
        Placement("small", "twin", node="node-a", namespace="ns-1"),
        Placement("small-0", "twin", node="node-a", namespace="ns-2"),
        Placement("small-0", "vm-host-3", node="node-c", gpus=("GPU-beef", "4")),
    ]
)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"gpu": "5", "pod": "chat-0", "namespace": "inference"}, ("small", "chat-0")),
        (
            {"gpu": "5", "pod": "frontdoor-7d9f8-x", "namespace": "team-b", "container": "vllm"},
            ("small-0", "frontdoor-7d9f8-x"),
        ),
        ({"gpu": "5", "pod": "chat-0", "namespace": "elsewhere"}, (None, None)),
        ({"gpu": "5", "pod": "chat-0"}, ("small", "chat-0")),
        ({"gpu": "5", "pod": "twin"}, (None, None)),
        ({"gpu": "5", "pod": "twin", "namespace": "ns-2"}, ("small-0", "twin")),
        ({"gpu": "5", "pod": "vllm-small-0-0", "namespace": "inference"}, (None, None)),
        ({"node": "node-c", "gpu": "0", "uuid": "GPU-beef"}, ("small-0", "vm-host-3")),
        ({"node": "node-c", "gpu": "4", "uuid": "GPU-0404"}, ("small-0", "vm-host-3")),
        ({"node": "node-a", "gpu": "9", "uuid": "GPU-beef"}, (None, None)),
        ({"gpu": "1", "pod": "chat-0", "namespace": "inference"}, ("big", None)),
    ],
    ids=[
        "label-not-name",
        "any-name-with-container",
        "other-namespace",
        "no-namespace-unique",
        "no-namespace-ambiguous",
        "namespace-picks",
        "name-rule-off-with-discovery",
        "announced-uuid",
        "announced-index",
        "device-on-another-node",
        "config-first",
    ],
)
def test_discovered_pods_own_their_gpus_by_namespace_and_pod(kw, expected):
    """A pod discovery found owns the GPUs dcgm-exporter labels with its namespace and name."""
    owner = owner_of(reading(**kw), REPLICAS, PLACED)
    assert ((owner.replica.id if owner.replica else None), owner.instance) == expected


def test_targets_become_placements_with_their_namespace_and_devices(config):
    """Discovery's targets (pods, registry instances) are what attribution joins to."""
    found = placements(
        {
            "a": EngineTarget(
                "small-0",
                "http://10.0.0.1:9000/engine/metrics",
                "chat-0",
                node="node-b",
                namespace="inference",
            ),
            "b": EngineTarget(
                "small-1",
                "http://10.0.0.2:9000/engine/metrics",
                "gpu-host:9000",
                node="node-b",
                gpus=("GPU-1234",),
            ),
            "small-1": EngineTarget("small-1", "http://127.0.0.1:1/metrics"),
        }
    )
    assert len(found) == 2
    assert found.pod("inference", "chat-0") == Placement("small-0", "chat-0", "node-b", "inference")
    assert found.device(reading(node="node-b", gpu="3", uuid="GPU-1234")) is not None


def test_registry_discovery_places_a_pod_it_does_not_list_yet_by_its_name():
    """With the name rule (every discovery but Kubernetes'), a pod the registry does not list yet
    is placed by the ``vllm-<group>`` rule; a pod it lists keeps its placement."""
    early = owner_of(
        reading(gpu="5", pod="vllm-small-0-0", namespace="inference"),
        REPLICAS,
        PLACED,
        name_rule=True,
    )
    assert ((early.replica.id if early.replica else None), early.instance) == (
        "small-0",
        "vllm-small-0-0",
    )
    listed = owner_of(
        reading(gpu="5", pod="chat-0", namespace="inference"), REPLICAS, PLACED, name_rule=True
    )
    assert ((listed.replica.id if listed.replica else None), listed.instance) == ("small", "chat-0")
    stranger = owner_of(reading(gpu="5", pod="notebook-1"), REPLICAS, PLACED, name_rule=True)
    assert (stranger.replica, stranger.instance) == (None, None)
