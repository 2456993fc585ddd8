"""The issued keys' set as billing signs it for Redis, and the check every sidecar makes of it.

Billing writes the keys issued at run time into the sidecars' Redis (``billing.key_publish``), so
that a fleet of sidecars costs billing nothing. But Redis takes writes from every pod that holds
its password, every sidecar among them: a set read from it unchecked would let any such pod add a
key for any team and have every sidecar of the fleet serve it (or roll a revoked key back in, or
pin the sidecars to a version billing never reaches). So billing signs the set with an Ed25519
key of its own, derived from its writer secret (stable across restarts and replicas, never
written anywhere), and a sidecar takes a set from Redis only when the signature verifies against
billing's public key. The sidecar learns that key from billing itself, on the authenticated
channel it already uses (``GET /v1/keys/active`` with the spend_reader token, header
``SIGNER_HEADER``): a pod that writes Redis cannot make a sidecar believe another key.

The value in Redis: the signature (128 hex digits), a newline, the set's JSON. The signature
covers a context string and the JSON's exact bytes, so it holds for this use only.

``cryptography`` is imported by the functions that sign or verify, not with the module: it adds
about 8 MB to a process, and a sidecar without Redis never checks a set (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING, Final

import orjson

from infermeter.keys import IssuedKeys, KeyRequestError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

__all__ = [
    "MAX_SET_BYTES",
    "SIGNER_HEADER",
    "public_hex",
    "seal",
    "signer_of",
    "signing_key",
    "unseal",
]

# The response header of ``GET /v1/keys/active`` that names billing's public key (hex).
SIGNER_HEADER: Final = "x-infermeter-key-signer"
# The most a sealed set may be: 100 keys for each of 1,000 teams is about 40 MB of JSON at most;
# anything larger is not a set billing wrote.
MAX_SET_BYTES: Final = 64 << 20
_DERIVE: Final = b"infermeter issued key set signing key v1"
_CONTEXT: Final = b"infermeter issued key set v1\n"
_SIGNATURE_HEX: Final = 128


def signing_key(writer_secret: bytes) -> Ed25519PrivateKey:
    """Billing's signing key: the same for every billing holding ``writer_secret``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = hmac.new(writer_secret, _DERIVE, hashlib.sha256).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def public_hex(key: Ed25519PrivateKey) -> str:
    """The public half of ``key``, as ``SIGNER_HEADER`` carries it."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def signer_of(value: str) -> Ed25519PublicKey | None:
    """The public key ``SIGNER_HEADER`` names (None: not one)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        raw = bytes.fromhex(value)
        return Ed25519PublicKey.from_public_bytes(raw) if len(raw) == 32 else None
    except ValueError:
        return None


def seal(keys: IssuedKeys, key: Ed25519PrivateKey) -> bytes:
    """``keys`` as billing writes it into Redis."""
    body = orjson.dumps(keys.to_json())
    return key.sign(_CONTEXT + body).hex().encode("ascii") + b"\n" + body


def unseal(raw: bytes, signer: Ed25519PublicKey) -> IssuedKeys:
    """The set in ``raw``; KeyRequestError unless ``signer`` signed it, whole."""
    if len(raw) > MAX_SET_BYTES:
        raise KeyRequestError(f"not a key set: {len(raw)} bytes")
    signature, newline, body = raw.partition(b"\n")
    if not newline or len(signature) != _SIGNATURE_HEX:
        raise KeyRequestError("not a signed key set")
    from cryptography.exceptions import InvalidSignature

    try:
        signer.verify(bytes.fromhex(signature.decode("ascii")), _CONTEXT + body)
    except (InvalidSignature, ValueError):
        raise KeyRequestError("the key set's signature is not billing's") from None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise KeyRequestError(f"not a key set: {exc}") from None
    if not isinstance(data, dict):
        raise KeyRequestError("not a key set")
    return IssuedKeys.from_json(data)
