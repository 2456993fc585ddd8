"""GPUs are joined to replicas by configuration, then by the vllm-<replica> pod label."""

from __future__ import annotations

import pytest

from collectors.attribution import attribute, replica_for_pod
from infermeter.config import Replica
from tests.collectors.fakes import reading


def _replica(rid: str, node: str = "node-a", gpus: list[int | str] | None = None) -> Replica:
    gpus = gpus or []
    return Replica(id=rid, model="m", upstream_url="http://127.0.0.1:1", node=node,
                   gpu_model="H100", gpu_count=max(1, len(gpus)), gpus=gpus)  # fmt: skip


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
