"""Engine target sets from the configuration, the instance registry and pod objects: pure logic."""

from __future__ import annotations

from typing import Any

import pytest

from collectors.attribution import owner_of
from collectors.targets import (
    DiscoveryError,
    EngineTarget,
    PodRules,
    apply_pod_event,
    changes,
    listed_pods,
    pod_target,
    registry_targets,
    static_targets,
)
from tests.collectors.fakes import reading

RULES = PodRules()


def pod(
    name: str, ip: str | None = "10.0.0.7", phase: str = "Running", **labels: str
) -> dict[str, Any]:
    """A pod object as the API server returns it, with only the fields discovery reads."""
    status: dict[str, Any] = {"phase": phase}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": {"name": name, "labels": labels, "resourceVersion": "1"}, "status": status}


def test_static_targets_are_the_configured_replicas(config):
    """Each replica is its own instance (instance None), read at its engine_metrics URL, on its node."""
    targets = static_targets(config.replicas)
    assert sorted(targets) == ["large-0", "small-0", "small-1"]
    assert targets["small-0"] == EngineTarget(
        "small-0", "http://127.0.0.1:18002/metrics", None, token=False, node="node-b"
    )


def test_registry_answer_becomes_live_instances_of_known_groups(config):
    """Live instances with an engine URL are targets; a fixed replica keeps instance None."""
    answer = {
        "instances": [
            {
                "instance": "vllm-small-0-a",
                "replica": "small-0",
                "state": "live",
                "engine_metrics_url": "http://10.0.0.1:9000/engine/metrics",
            },
            {
                "instance": "large-0",
                "replica": "large-0",
                "state": "live",
                "engine_metrics_url": "http://10.0.0.2:9000/engine/metrics",
            },
            {
                "instance": "gone-1",
                "replica": "small-0",
                "state": "stopped",
                "engine_metrics_url": "http://10.0.0.3:9000/engine/metrics",
            },
            {
                "instance": "no-url",
                "replica": "small-0",
                "state": "live",
                "engine_metrics_url": None,
            },
            {
                "instance": "stranger",
                "replica": "not-configured",
                "state": "live",
                "engine_metrics_url": "http://10.0.0.4:9000/engine/metrics",
            },
        ]
    }
    assert registry_targets(answer, config.replicas) == {
        "vllm-small-0-a": EngineTarget(
            "small-0", "http://10.0.0.1:9000/engine/metrics", "vllm-small-0-a"
        ),
        "large-0": EngineTarget("large-0", "http://10.0.0.2:9000/engine/metrics", None),
    }


@pytest.mark.parametrize(
    "answer", [[], {"instance": []}, {"instances": ["x"]}, {"instances": [{"replica": "small-0"}]}]
)
def test_registry_answer_that_breaks_the_contract_is_refused(config, answer):
    """Anything but an ``instances`` list of objects with ids raises DiscoveryError."""
    with pytest.raises(DiscoveryError):
        registry_targets(answer, config.replicas)


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (pod("vllm-small-0-7d9f8-abcde"), ("small-0", "http://10.0.0.7:9000/engine/metrics")),
        (
            pod("chat-0", **{"infermeter.io/replica": "small-1"}),
            ("small-1", "http://10.0.0.7:9000/engine/metrics"),
        ),
        (pod("vllm-small-0-x", ip="fd00::7"), ("small-0", "http://[fd00::7]:9000/engine/metrics")),
        (pod("vllm-small-0-x", ip=None, phase="Pending"), None),
        (pod("vllm-small-0-x", phase="Succeeded"), None),
        (pod("vllm-other-x"), None),
        (pod("vllm-small-0-x", **{"infermeter.io/replica": "unknown"}), None),
    ],
    ids=["name-rule", "label", "ipv6", "no-ip-yet", "finished", "unknown-name", "unknown-label"],
)
def test_pod_target(config, obj, expected):
    """A running pod with an IP and a known group is read at its own IP and sidecar port."""
    target = pod_target(obj, config.replicas, RULES)
    if expected is None:
        assert target is None
    else:
        assert target is not None
        assert (target.replica, target.url, target.instance) == (*expected, obj["metadata"]["name"])


def test_watch_events_add_modify_and_delete(config):
    """ADDED joins, MODIFIED to an unscrapable pod leaves, DELETED leaves."""
    targets, version = listed_pods(
        {"metadata": {"resourceVersion": "100"}, "items": [pod("vllm-small-0-a")]},
        config.replicas,
        RULES,
    )
    assert (sorted(targets), version) == (["vllm-small-0-a"], "100")
    targets = apply_pod_event(
        targets, "ADDED", pod("vllm-small-1-b", ip="10.0.0.8"), config.replicas, RULES
    )
    assert targets["vllm-small-1-b"].url == "http://10.0.0.8:9000/engine/metrics"
    targets = apply_pod_event(
        targets, "MODIFIED", pod("vllm-small-0-a", phase="Failed"), config.replicas, RULES
    )
    assert sorted(targets) == ["vllm-small-1-b"]
    targets = apply_pod_event(targets, "DELETED", pod("vllm-small-1-b"), config.replicas, RULES)
    assert targets == {}


def test_changes_name_what_came_and_went():
    """Keys added and removed, sorted; a target whose URL changed is neither."""
    a = EngineTarget("g", "http://a/", "a")
    assert changes({"a": a, "b": a}, {"b": a, "c": a}) == (["c"], ["a"])


@pytest.mark.parametrize(
    ("kw", "replica", "instance"),
    [
        ({"gpu": "0", "pod": "vllm-large-0-5f7c9-x2x7q"}, "large-0", None),
        ({"gpu": "5", "pod": "vllm-small-0-5f7c9-x2x7q"}, "small-0", "vllm-small-0-5f7c9-x2x7q"),
        ({"gpu": "5", "pod": "cuda-75454ffb9f-8ljq7"}, None, None),
    ],
    ids=["configured-gpu-is-the-fixed-replica", "pod-label-names-the-instance", "foreign-pod"],
)
def test_gpu_owner_names_the_instance_from_the_pod_label(config, kw, replica, instance):
    """A GPU placed by its pod label runs that pod's instance; a configured GPU runs the replica itself."""
    owner = owner_of(reading(**kw), config.replicas)
    assert (owner.replica.id if owner.replica else None, owner.instance) == (replica, instance)
