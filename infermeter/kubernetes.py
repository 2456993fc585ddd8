"""How a process in a pod reaches the Kubernetes API: the in-cluster service account.

The kubelet mounts the pod's service-account token and the cluster's CA under
``/var/run/secrets/kubernetes.io/serviceaccount`` and sets ``KUBERNETES_SERVICE_HOST`` and
``_PORT``. The token is projected and rotated, so callers read the file on every request
(``bearer``), never once at start.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path

from infermeter.config import process_environment

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "KubernetesApiError",
    "bearer",
    "ca_verify",
    "in_cluster_api",
]

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesApiError(Exception):
    """The API cannot be reached as configured; the message says what to set."""


def in_cluster_api(
    environ: Mapping[str, str] | None = None, account_dir: Path = SERVICE_ACCOUNT_DIR
) -> tuple[str, Path, ssl.SSLContext]:
    """The API server URL, token file and TLS context the pod's service account provides."""
    env = process_environment() if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise KubernetesApiError("not in a cluster (no KUBERNETES_SERVICE_HOST): set an api_url")
    if ":" in host:
        host = f"[{host}]"
    context = ssl.create_default_context(cafile=str(account_dir / "ca.crt"))
    return f"https://{host}:{port}", account_dir / "token", context


def ca_verify(ca_file: str | None, key: str) -> ssl.SSLContext | bool:
    """What a client to a configured ``api_url`` verifies its certificate with: ``ca_file``'s
    CAs, else the system's. KubernetesApiError naming ``key`` (the setting) when the file cannot
    be read as CA certificates: found at start, not at the first call, hours later."""
    if ca_file is None:
        return True
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        reason = exc.strerror or str(exc)
        raise KubernetesApiError(f"{key} = {ca_file!r}: {reason}") from None


def bearer(token: str | None, token_file: Path | None) -> dict[str, str]:
    """The authorization header: the token file's current content, else ``token``, else none."""
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise KubernetesApiError(f"cannot read the service-account token: {exc}") from exc
    return {"authorization": f"Bearer {token}"} if token else {}
