"""Public keys must never guard a server that other machines can reach.

The embedded demo configuration (``defaults.yaml``) stores the SHA-256 of keys the README prints,
and earlier example files shipped the hashes of ``test``, ``foo`` and ``bar``: anyone can
present those keys. A process that silently fell back to the demo configuration, or a copied file
that kept its hashes, would hand every team's usage, the admin view and the ingest API to whoever
can reach it. So a process on the demo configuration says so on start, and no process starts with
a public hash while any listen address of the configuration (or its ``--listen``) is beyond
loopback.
"""

from __future__ import annotations

import functools
import ipaddress
from pathlib import Path

from infermeter.config import DEFAULT_CONFIG, Config, credential_hashes, load_config
from infermeter.serving import host_port

__all__ = [
    "DEMO_COMMANDS",
    "fallback_warning",
    "is_loopback",
    "listen_addresses",
    "public_hashes",
    "public_key_problems",
]

# The commands made to run on the demo configuration; they warn about nothing.
DEMO_COMMANDS = frozenset({"demo", "simulate"})

# Hashes earlier example files and manifests shipped (sha256 of "test", "foo", "bar", and one
# made-up value): a deployment copied from them must not keep them.
_SHIPPED_EXAMPLE_HASHES = frozenset(
    {
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae",
        "fcde2b2edba56bf408601fb721fe9b5c338d10ee429ea04fae5511b68fbf8fb9",
        "5d41402abc4b2a76b9719d911017c592aaf4b1e1a7c2e3e8b5a5a0fcd0c7c0a1",
    }
)


@functools.cache
def public_hashes() -> frozenset[str]:
    """Every key hash anyone can know: the embedded demo configuration's and the old examples'."""
    demo = load_config(DEFAULT_CONFIG, environ={})
    return frozenset(d for _, _, d in credential_hashes(demo)) | _SHIPPED_EXAMPLE_HASHES


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` (or a URL) is reachable from this machine only."""
    try:
        host = host_port(address)[0]
    except ValueError:
        return False  # unparseable: the server will refuse it anyway; assume the worst here
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def listen_addresses(config: Config, listen: str | None) -> list[tuple[str, str]]:
    """``(where, address)`` of every address a server of this configuration would listen on."""
    out = [
        (f"replicas[{i}].sidecar_listen", r.sidecar_listen)
        for i, r in enumerate(config.replicas)
        if r.sidecar_listen
    ]
    out += [
        ("billing.listen", config.billing.listen),
        ("collector.listen", config.collector.listen),
        ("dashboard.listen", config.dashboard.listen),
        ("autoscale.listen", config.autoscale.listen),
    ]
    if listen:
        out.append(("--listen", listen))
    return out


def public_key_problems(config: Config, listen: str | None) -> list[str]:
    """One line per public key hash in ``config`` when a listen address is beyond loopback."""
    exposed = [(w, a) for w, a in listen_addresses(config, listen) if not is_loopback(a)]
    if not exposed:
        return []
    where, address = exposed[0]
    public = public_hashes()
    return [
        f"{path} is the hash of a public demo key and {where} = {address!r} is reachable "
        "beyond this machine: put there the hash of a key of your own "
        '(`printf %s "$KEY" | sha256sum`), or listen on 127.0.0.1 only'
        for _, path, digest in credential_hashes(config)
        if digest in public
    ]


def fallback_warning(command: str, given: Path | None, resolved: Path) -> str | None:
    """The one warning line for a process that fell back to the demo configuration, or None."""
    if given is not None or resolved != DEFAULT_CONFIG or command in DEMO_COMMANDS:
        return None
    return (
        "infermeter: WARNING: no --config and no $INFERMETER_CONFIG: running on the embedded "
        "demo configuration, whose keys are public; give --config for anything but a demo"
    )
