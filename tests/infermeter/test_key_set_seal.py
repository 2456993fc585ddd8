"""The issued keys' set as billing signs it for Redis: only billing's signature, over the exact
bytes, makes a sidecar take it."""

from __future__ import annotations

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from infermeter.key_set_seal import (
    MAX_SET_BYTES,
    public_hex,
    seal,
    signer_of,
    signing_key,
    unseal,
)
from infermeter.keys import IssuedKey, IssuedKeys, KeyRequestError

SECRET = b"a writer secret"


def key_set(version: int = 7) -> IssuedKeys:
    """Two keys of two teams, one with limits."""
    return IssuedKeys.of(
        version,
        [
            IssuedKey("aaaaaaaaaaaa", "member", "search", "0" * 64, 1.0, "@admin"),
            IssuedKey(
                "bbbbbbbbbbbb", "lead", "research", "1" * 64, 2.0, "@admin", requests_per_minute=5
            ),
        ],
    )


def billing_signer() -> Ed25519PublicKey:
    """The public key billing's route names, as a sidecar reads it."""
    signer = signer_of(public_hex(signing_key(SECRET)))
    assert signer is not None
    return signer


def test_a_set_billing_sealed_is_read_back_whole():
    """Sealed with the key the writer secret gives, the set verifies and is the same set."""
    keys = key_set()
    assert unseal(seal(keys, signing_key(SECRET)), billing_signer()) == keys


def test_the_signing_key_is_the_same_for_every_billing_with_the_secret():
    """Two billings (a restart, a replica) sign alike; another secret signs otherwise."""
    assert public_hex(signing_key(SECRET)) == public_hex(signing_key(SECRET))
    assert public_hex(signing_key(SECRET)) != public_hex(signing_key(b"another"))
    assert len(public_hex(signing_key(SECRET))) == 64


@pytest.mark.parametrize(
    ("name", "forge"),
    [
        ("unsigned, as sets were written before", lambda k: orjson.dumps(k.to_json())),
        ("signed with another key", lambda k: seal(k, signing_key(b"another"))),
        (
            "billing's signature over a changed set",
            lambda k: seal(k, signing_key(SECRET)).replace(b'"search"', b'"admins"'),
        ),
        (
            "billing's signature with a key added",
            lambda k: seal(k, signing_key(SECRET))[:-2] + b',{"key_id":"x"}]}',
        ),
        (
            "billing's signature over an older set under a new version",
            lambda k: seal(k, signing_key(SECRET)).replace(b'"version":7', b'"version":9'),
        ),
        ("a signature cut short", lambda k: seal(k, signing_key(SECRET))[:100]),
        ("no separator", lambda k: b"f" * 128 + orjson.dumps(k.to_json())),
        ("a signature that is no hex", lambda k: b"z" * 128 + b"\n" + orjson.dumps(k.to_json())),
        ("empty", lambda k: b""),
    ],
)
def test_anything_but_billing_s_signature_over_the_exact_set_is_refused(name, forge):
    """Whatever a pod holding the Redis password writes there, it is not taken."""
    with pytest.raises(KeyRequestError):
        unseal(forge(key_set()), billing_signer())


def test_a_value_larger_than_any_set_is_refused_before_it_is_checked():
    """A value beyond MAX_SET_BYTES is refused on its size alone."""
    with pytest.raises(KeyRequestError, match="bytes"):
        unseal(b"0" * (MAX_SET_BYTES + 1), billing_signer())


def test_a_signed_value_that_is_not_a_set_is_refused():
    """Billing's key over JSON that is not a set (the key is used for nothing else, but the
    check holds anyway)."""
    key = signing_key(SECRET)
    body = b"[1, 2]"
    raw = key.sign(b"infermeter issued key set v1\n" + body).hex().encode() + b"\n" + body
    with pytest.raises(KeyRequestError, match="not a key set"):
        unseal(raw, billing_signer())


@pytest.mark.parametrize("value", ["", "zz", "00" * 31, "00" * 33, "not hex at all"])
def test_a_malformed_signer_header_names_no_key(value):
    """A header that is not a 32-byte key in hex is ignored, not trusted."""
    assert signer_of(value) is None
