"""Billing's copy of the issued keys in a real redis-server: written signed, and written again
over whatever else is found there."""

from __future__ import annotations

from typing import Any

import orjson
import redis

from billing.key_publish import RedisPublisher
from infermeter.key_set_seal import public_hex, signer_of, signing_key, unseal
from infermeter.keys import IssuedKey, IssuedKeys, redis_keys
from tests.sidecar.conftest import make_config

KEYS = IssuedKeys.of(4, [IssuedKey("aaaaaaaaaaaa", "member", "search", "0" * 64, 1.0, "@admin")])


def publisher_and_reader(redis_server: Any) -> tuple[RedisPublisher, redis.Redis, str, str]:
    """Billing's publisher, a second client (another pod's), and the two keys it writes."""
    config = make_config(
        "http://127.0.0.1:1", **{"sidecar.shared_limits.redis_url": redis_server.url}
    )
    settings = config.sidecar.shared_limits
    set_key, version_key = redis_keys(settings.key_prefix)
    return (
        RedisPublisher(settings, signing_key(b"secret")),
        redis.Redis.from_url(redis_server.url),
        set_key,
        version_key,
    )


def test_the_set_is_written_signed_with_its_version(redis_server):
    """What billing writes verifies against the key its route names, and is the set."""
    publisher, other, set_key, version_key = publisher_and_reader(redis_server)
    publisher.publish(KEYS)
    assert other.get(version_key) == b"4"
    signer = signer_of(publisher.signer_hex)
    assert signer is not None
    assert publisher.signer_hex == public_hex(signing_key(b"secret"))
    raw = other.get(set_key)
    assert isinstance(raw, bytes)
    assert unseal(raw, signer) == KEYS
    other.close()


def test_whatever_else_is_found_in_redis_is_written_over(redis_server):
    """Another writer's set under billing's own version, a version that is no number, or both
    keys gone: the next check writes billing's set again, and never raises."""
    publisher, other, set_key, version_key = publisher_and_reader(redis_server)
    publisher.publish(KEYS)
    written = other.get(set_key)
    for spoil in ("another writer's set", "a version that is no number", "both gone"):
        if spoil == "another writer's set":
            other.set(set_key, orjson.dumps(KEYS.to_json()))
        elif spoil == "a version that is no number":
            other.set(version_key, "not a number")
        else:
            other.delete(set_key, version_key)
        publisher.check(KEYS)
        assert other.get(set_key) == written
        assert other.get(version_key) == b"4"
    other.close()
