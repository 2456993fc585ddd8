"""``infermeter credential``: derive one pod's writer credential, where the pod starts.

In Kubernetes a writer's credential cannot be in the manifests: instances come and go with the
autoscaler, each with a name, an address and a node of its own. An init container of each writer
pod runs this command before the pod's processes start. It holds the writer secret (from the
Secret, in its own environment only), reads who the pod is from the downward API, and writes
the pod's credential to a file on a memory volume the main container reads through
``<credential_env>_FILE``. The process that serves never sees the secret.

=============  =================================================  ===========================
role           principal                                          from
=============  =================================================  ===========================
``instance``   ``instance:<group>/<POD_NAME>@<POD_IP>:<port>``    ``--replica`` (the pod's
                                                                  ``infermeter.io/replica``
                                                                  label), the sidecar's port
``collector``  ``collector:<NODE_NAME>``                          the node the pod runs on
``autoscaler`` ``autoscaler:<name>``                              ``--name``
=============  =================================================  ===========================

``principal_for`` is the pure part; the command adds the secret and the file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from infermeter.commands import Subparsers, add_config, fail

if TYPE_CHECKING:
    from infermeter.config import Config
    from infermeter.writers import Writer

__all__ = ["CredentialError", "principal_for", "register", "write_credential"]


class CredentialError(ValueError):
    """The pod's environment does not say who it is; the message names what is missing."""


def register(subparsers: Subparsers) -> None:
    """Add the ``credential`` subcommand."""
    cmd = subparsers.add_parser(
        "credential",
        help="derive this pod's writer credential from the writer secret (an init container's job)",
        description=(
            "Derive the writer credential of the pod this runs in from the writer secret (in the "
            "variable billing.writer_secret_env names) and the downward API (POD_NAME, POD_IP, "
            "NODE_NAME), and write it to --out, readable by its owner only. The pod's main "
            "container reads it through <credential_env>_FILE."
        ),
    )
    add_config(cmd)
    cmd.add_argument("--role", required=True, choices=("instance", "collector", "autoscaler"))
    cmd.add_argument("--replica", metavar="GROUP", help="instance: its replica group")
    cmd.add_argument(
        "--port", type=int, metavar="PORT", help="instance: the port its sidecar serves on"
    )
    cmd.add_argument("--name", default="autoscaler", help="autoscaler: its name")
    cmd.add_argument("--out", required=True, type=Path, metavar="FILE")
    cmd.set_defaults(handler=_credential)


def principal_for(
    config: Config,
    role: str,
    environ: Mapping[str, str],
    *,
    replica: str | None = None,
    port: int | None = None,
    name: str = "autoscaler",
) -> Writer:
    """The writer a pod of ``role`` is, from its environment; CredentialError when it cannot say."""
    from infermeter.identity import IdentityError, identity_from_environment
    from infermeter.writers import Writer, WriterError

    try:
        if role == "instance":
            if replica is None or port is None:
                raise CredentialError("an instance needs --replica and --port")
            try:
                group = config.replica(replica)
            except KeyError:
                raise CredentialError(
                    f"no replica group {replica!r} in the configuration"
                ) from None
            ip = environ.get("POD_IP", "").strip()
            if not ip or not environ.get("POD_NAME", "").strip():
                raise CredentialError("POD_NAME and POD_IP (the downward API) must be set")
            me = identity_from_environment(group, environ)
            host = f"[{ip}]" if ":" in ip else ip
            return Writer.for_instance(me.replica, me.instance, f"{host}:{port}")
        if role == "collector":
            node = environ.get(config.collector.node_name_env, "").strip()
            if not node:
                raise CredentialError(
                    f"{config.collector.node_name_env} (spec.nodeName) must be set"
                )
            return Writer.for_collector([node])
        return Writer.for_autoscaler(name)
    except (IdentityError, WriterError) as exc:
        raise CredentialError(str(exc)) from None


def write_credential(path: Path, token: str) -> None:
    """Write ``token`` to ``path``, mode 0400, replacing what was there at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(token + "\n")
    os.replace(partial, path)


def _credential(args: argparse.Namespace, config: Config) -> int:
    from infermeter.config import env_value, process_environment
    from infermeter.writers import issue

    variable = config.billing.writer_secret_env
    secret = env_value(variable) or ""
    if not secret:
        return fail(f"the writer secret is not in {variable}: mount it from the Secret")
    try:
        writer = principal_for(
            config,
            args.role,
            process_environment(),
            replica=args.replica,
            port=args.port,
            name=args.name,
        )
    except CredentialError as exc:
        return fail(f"cannot tell which {args.role} this pod is: {exc}")
    write_credential(args.out, issue(secret.encode(), writer).token)
    print(f"infermeter: wrote the credential of {writer.principal} to {args.out}")
    return 0
