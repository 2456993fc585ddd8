"""Who a running engine is: the instance of a replica group that a sidecar fronts.

The configuration's ``replicas`` describe replica groups: what a set of identical engines serves
and on what kind of GPU. What runs is instances of a group, and in Kubernetes those come and go
with the autoscaler, so their identity cannot be in the configuration. It comes from the
environment the pod is started with (the downward API and the NVIDIA device plugin):

==========================  =================================================================
``INFERMETER_INSTANCE``     the instance id outside Kubernetes (e.g. host:port)
``POD_NAME``                the instance id in Kubernetes (unique among live pods of a namespace)
``POD_UID``                 the pod's UID: names the spool directory, unique for all time
``POD_NAMESPACE``           the pod's namespace
``NODE_NAME``               the node it runs on (default: the group's ``node``)
``NVIDIA_VISIBLE_DEVICES``  its GPUs: UUIDs or indices, comma-separated (default: ``gpus``)
==========================  =================================================================

With none of them set, the instance is the replica itself (id, node and GPUs from the
configuration), so a fleet of fixed replicas keeps working unchanged: one instance each.

In a pod the instance id is the pod name and nothing else: dcgm-exporter names the pod that
holds each GPU, the collector finds the pod by its name, and the pod's writer credential is
issued to that name. An ``INFERMETER_INSTANCE`` that differs from ``POD_NAME`` would bill the
requests to one instance and its GPUs to another, so it is refused.

What the instance may write to billing is proved by its writer credential
(``infermeter.writers``), handed to it in the variable ``sidecar.credential_env`` names;
``instance_credential`` reads it and checks that it names this instance of this group.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from infermeter.config import Replica
from infermeter.writers import Credential, Role, WriterError, credential_text

__all__ = ["Identity", "IdentityError", "identity_from_environment", "instance_credential"]

# What the device plugin may put in NVIDIA_VISIBLE_DEVICES besides a list of devices.
_NOT_A_LIST: Final = frozenset({"", "all", "none", "void"})
# An instance id is a DNS label or a host:port: the shape of a pod name, bounded in length.
_ID: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._:-]{0,251}[A-Za-z0-9])?$")
_GPU: Final = re.compile(r"^[A-Za-z0-9:._/-]{1,128}$")


class IdentityError(ValueError):
    """An identity variable holds a value that cannot be an id; names the variable."""


@dataclass(frozen=True, slots=True)
class Identity:
    """One instance: its own id, its replica group, where it runs and on which GPUs."""

    instance: str
    replica: str
    model: str
    node: str
    gpu_model: str
    gpus: tuple[str, ...]
    namespace: str | None = None
    pod_uid: str | None = None

    @property
    def dynamic(self) -> bool:
        """True for an instance the environment named; False for a fixed replica of the config."""
        return self.instance != self.replica or self.pod_uid is not None

    @property
    def spool_key(self) -> str:
        """The name of this instance's spool directory: its pod UID, else its id."""
        return self.pod_uid or self.instance


def identity_from_environment(replica: Replica, environ: Mapping[str, str]) -> Identity:
    """The identity of the instance of ``replica`` started with ``environ``.

    IdentityError naming the variable when one is set to something that is not an id.
    """
    named, pod = _value(environ, "INFERMETER_INSTANCE"), _value(environ, "POD_NAME")
    if named and pod and named != pod:
        raise IdentityError(
            f"environment variables INFERMETER_INSTANCE={named!r} and POD_NAME={pod!r} differ: "
            "in a pod the instance is the pod name (its GPUs and its credential are the pod's); "
            "unset INFERMETER_INSTANCE"
        )
    instance = named or pod
    gpus = _gpus(environ.get("NVIDIA_VISIBLE_DEVICES", ""))
    return Identity(
        instance=instance or replica.id,
        replica=replica.id,
        model=replica.model,
        node=_value(environ, "NODE_NAME") or replica.node,
        gpu_model=replica.gpu_model,
        gpus=gpus if gpus is not None else tuple(str(g) for g in replica.gpus),
        namespace=_value(environ, "POD_NAMESPACE"),
        pod_uid=_value(environ, "POD_UID"),
    )


def _value(environ: Mapping[str, str], name: str) -> str | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not _ID.match(raw):
        raise IdentityError(f"environment variable {name}={raw[:80]!r} is not a valid id")
    return raw


def _gpus(raw: str) -> tuple[str, ...] | None:
    """The devices listed, or None when the variable lists none (unset, ``all``, ``void``)."""
    raw = raw.strip()
    if raw.lower() in _NOT_A_LIST:
        return None
    devices = tuple(d.strip() for d in raw.split(",") if d.strip())
    for d in devices:
        if not _GPU.match(d):
            raise IdentityError(
                f"environment variable NVIDIA_VISIBLE_DEVICES: {d[:80]!r} is not a GPU"
            )
    return devices or None


def instance_credential(
    identity: Identity, environ: Mapping[str, str], variable: str
) -> Credential | None:
    """The writer credential in ``variable`` (None when unset), which must name ``identity``.

    IdentityError naming the variable when it holds no credential, or another writer's: a sidecar
    that started with it would ship records billing quarantines.
    """
    try:
        raw, where = credential_text(environ, variable)
    except WriterError as exc:
        raise IdentityError(str(exc)) from None
    if not raw:
        return None
    try:
        credential = Credential.parse(raw)
    except WriterError as exc:
        raise IdentityError(f"environment variable {where}: {exc}") from None
    writer = credential.writer
    if (writer.role, writer.group, writer.instance) != (
        Role.INSTANCE,
        identity.replica,
        identity.instance,
    ):
        raise IdentityError(
            f"environment variable {where}: the credential of {writer.principal}, not of "
            f"instance {identity.instance} of group {identity.replica}"
        )
    return credential
