"""An instance's identity: from the pod's environment, or the fixed replica when there is none."""

from __future__ import annotations

import pytest

from infermeter.config import DEFAULT_CONFIG, load_config
from infermeter.identity import IdentityError, identity_from_environment

CONFIG = load_config(DEFAULT_CONFIG, environ={})
SMALL = CONFIG.replica("small-1")


def test_without_environment_the_instance_is_the_configured_replica():
    """A fixed fleet keeps working unchanged: one instance per replica, with its node and GPUs."""
    me = identity_from_environment(SMALL, {})
    assert (me.instance, me.replica, me.node, me.gpus) == ("small-1", "small-1", "node-b", ("1",))
    assert not me.dynamic
    assert me.spool_key == "small-1"


def test_a_pod_is_an_instance_of_its_group_named_by_the_downward_api():
    """Pod name, UID, namespace, node and the device plugin's GPUs make the identity."""
    env = {
        "POD_NAME": "vllm-small-7d9f8-abcde",
        "POD_UID": "0b6c1f2e-1111-2222-3333-444455556666",
        "POD_NAMESPACE": "inference",
        "NODE_NAME": "gpu-node-7",
        "NVIDIA_VISIBLE_DEVICES": "GPU-aaaa-bbbb,GPU-cccc-dddd",
    }
    me = identity_from_environment(SMALL, env)
    assert me.instance == "vllm-small-7d9f8-abcde"
    assert (me.replica, me.model, me.gpu_model) == ("small-1", "chat-small", "L40S")
    assert (me.node, me.namespace) == ("gpu-node-7", "inference")
    assert me.gpus == ("GPU-aaaa-bbbb", "GPU-cccc-dddd")
    assert me.dynamic
    assert me.spool_key == env["POD_UID"]


@pytest.mark.parametrize("devices", ["all", "void", "none", ""])
def test_a_device_list_that_names_no_device_falls_back_to_the_config(devices):
    """``all`` or ``void`` from the device plugin say nothing about which GPUs: the config's are used."""
    assert identity_from_environment(SMALL, {"NVIDIA_VISIBLE_DEVICES": devices}).gpus == ("1",)


def test_outside_kubernetes_infermeter_instance_names_the_instance():
    """An operator names the instance, e.g. by host and port."""
    env = {"INFERMETER_INSTANCE": "gpu-host-3:8000"}
    assert identity_from_environment(SMALL, env).instance == "gpu-host-3:8000"


def test_in_a_pod_an_instance_name_other_than_the_pod_name_is_refused():
    """The pod's GPUs and credential are its name's: another instance id would split its bill in two."""
    env = {"INFERMETER_INSTANCE": "gpu-host-3:8000", "POD_NAME": "vllm-small-7d9f8-abcde"}
    with pytest.raises(IdentityError, match=r"INFERMETER_INSTANCE.*POD_NAME.*differ"):
        identity_from_environment(SMALL, env)
    same = {"INFERMETER_INSTANCE": "vllm-small-7d9f8-abcde", "POD_NAME": "vllm-small-7d9f8-abcde"}
    assert identity_from_environment(SMALL, same).instance == "vllm-small-7d9f8-abcde"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("POD_NAME", "../../etc"),
        ("POD_UID", "x" * 300),
        ("NODE_NAME", "a b"),
        ("NVIDIA_VISIBLE_DEVICES", "GPU-1,$(rm -rf)"),
    ],
)
def test_a_value_that_is_not_an_id_is_refused_naming_the_variable(name, value):
    """An id becomes a directory name and a label: a path or a space in it is an error, not a risk."""
    with pytest.raises(IdentityError, match=name):
        identity_from_environment(SMALL, {name: value})
