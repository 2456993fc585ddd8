"""Billing's copy of the issued keys in Redis, where the sidecars read it (``sidecar.keysync``).

After each change billing writes the set, signed (``infermeter.key_set_seal``: any pod holding
the Redis password can write there too), then its version (so a sidecar that sees the version
finds the set at least that new), in one MULTI. Redis may be down at that moment, restarted
empty later, or written over by someone else: ``keep`` checks every ``CHECK_SECONDS`` that Redis
holds billing's version and writes the set again when it does not. Meanwhile the sidecars read
billing's route instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from redis.exceptions import RedisError

from infermeter.config import SharedLimitsSettings, env_value
from infermeter.key_set_seal import public_hex, seal
from infermeter.keys import IssuedKeys, redis_keys

__all__ = ["CHECK_SECONDS", "RedisPublisher"]

log = logging.getLogger("infermeter.billing")

CHECK_SECONDS: Final = 2.0


class RedisPublisher:
    """Writes the issued keys under the sidecars' key prefix, signed with ``signer``
    (``key_set_seal.signing_key`` of billing's writer secret)."""

    def __init__(
        self,
        settings: SharedLimitsSettings,
        signer: Ed25519PrivateKey,
        client: redis.Redis | None = None,
    ) -> None:
        assert settings.redis_url is not None
        self._signer = signer
        # What billing's ``GET /v1/keys/active`` tells the sidecars to check the set with.
        self.signer_hex = public_hex(signer)
        password = env_value(settings.password_env) or None
        timeout = max(settings.timeout_millis / 1000, 0.5)
        self.client = client or redis.Redis.from_url(
            settings.redis_url,
            password=password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )
        self.set_key, self.version_key = redis_keys(settings.key_prefix)
        self._failing = False
        # The last set sealed, and its bytes.
        self._last: tuple[IssuedKeys, bytes] | None = None

    def publish(self, keys: IssuedKeys) -> None:
        """Write ``keys`` and its version; a failure is logged (``keep`` writes it again)."""
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.set(self.set_key, self._sealed(keys))
                pipe.set(self.version_key, keys.version)
                pipe.execute()
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.warning("issued keys not written to Redis (%s); the sidecars read billing", exc)
            self._failing = True
            return
        if self._failing:
            log.info("issued keys written to Redis again")
        self._failing = False

    def check(self, keys: IssuedKeys) -> None:
        """Write ``keys`` unless Redis holds exactly what billing wrote: its version and its
        signed set. Anything else is written over (a value that is no number included): it may
        be another writer's, and the sidecars would ask billing while it stood."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.get(self.version_key)
                pipe.get(self.set_key)
                version, held = pipe.execute()
        except (RedisError, OSError):
            version = held = None
        if version != str(keys.version).encode() or held != self._sealed(keys):
            self.publish(keys)

    def _sealed(self, keys: IssuedKeys) -> bytes:
        """``keys`` signed, once per set (Ed25519 signs alike every time: the check compares)."""
        if self._last is None or self._last[0] is not keys:
            self._last = (keys, seal(keys, self._signer))
        return self._last[1]

    async def keep(self, current: Callable[[], IssuedKeys]) -> None:
        """Check every ``CHECK_SECONDS`` that Redis holds the set ``current`` gives."""
        while True:
            await asyncio.to_thread(self.check, current())
            await asyncio.sleep(CHECK_SECONDS)
