"""A sidecar's copy of the keys issued at run time, kept current within the propagation bound.

Billing is the keys' one writer (``billing.keys``). Every ``sidecar.key_sync_seconds`` (1 s) a
sidecar asks for the set's version, and reads the set only when the version moved:

- with shared limits configured, from Redis (``<prefix>:keys:version``, ``<prefix>:keys``),
  where billing writes the set after each change, so a fleet of sidecars costs billing nothing.
  Any pod holding the Redis password can write there too, so a set is taken from Redis only
  when it verifies against billing's signing key (``infermeter.key_set_seal``), which the
  sidecar learns from billing's own answer and keeps; until it knows it, or when a set does not
  verify, it asks billing instead;
- otherwise, or while Redis does not answer, from billing's ``GET /v1/keys/active`` with the
  version as ``If-None-Match`` (a 304 while it has not moved), with the spend_reader token.

Even while Redis answers, billing is asked every ``CONFIRM_SECONDS``: a pod holding the Redis
password cannot forge a set, but it can write the version a sidecar already holds (or delete
it, or put back an older set billing signed) as often as it likes, and a sidecar reading Redis
alone would then never see a revocation.

A new or revoked key is thus taken (or refused) by every sidecar within a few seconds: the sync
interval plus one read (docs/identity.md measures it). When neither answers, the sidecar keeps
the set it has: the last one it read, which it also keeps in its spool directory
(``issued-keys.json``, replaced atomically), so a sidecar started while billing is down takes the
keys it knew. Only team keys (member, lead) are kept: the sidecar serves teams, and a role's key
(finance, viewer, spend_reader) is no team's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson

from infermeter.key_set_seal import SIGNER_HEADER, signer_of, unseal
from infermeter.keys import IssuedKeys, KeyRequestError, redis_keys
from infermeter.spooldir import ISSUED_KEYS

if TYPE_CHECKING:
    import httpx
    import redis.asyncio as aioredis
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

__all__ = ["CONFIRM_SECONDS", "KEYS_FILE", "KeySync", "team_keys"]

log = logging.getLogger("infermeter.sidecar")

KEYS_FILE: Final = ISSUED_KEYS
# However Redis answers, billing is asked at least this often (a 304 while nothing moved): what
# Redis says of the version is anyone's word who holds its password, so it alone cannot hold a
# revocation back for longer than this and one sync interval.
CONFIRM_SECONDS: Final = 2.0


def team_keys(issued: IssuedKeys) -> IssuedKeys:
    """The team keys of ``issued`` (members and leads): what a sidecar admits requests with."""
    return IssuedKeys.of(issued.version, (k for k in issued.by_id.values() if k.team is not None))


class KeySync:
    """Reads the issued keys from Redis or billing and hands each newer set to ``apply``."""

    def __init__(
        self,
        apply: Callable[[IssuedKeys], None],
        directory: Path,
        client: Callable[[], httpx.AsyncClient],
        billing_url: str | None,
        token: str | None,
        redis: aioredis.Redis | None,
        prefix: str,
        interval_seconds: float = 1.0,
        pinned_signer: str | None = None,
    ) -> None:
        self._apply = apply
        self.path = directory / KEYS_FILE
        self._client = client
        self.url = f"{billing_url.rstrip('/')}/v1/keys/active" if billing_url else None
        self.token = token
        self.redis = redis
        self.set_key, self.version_key = redis_keys(prefix)
        self.interval_seconds = interval_seconds
        self.current: IssuedKeys | None = None
        self._failing = False
        # Billing's key-set signing key, as billing's answer names it (kept with the set on disk),
        # in hex; made a key (``signer``) only when a set from Redis is checked with it.
        self._signer_hex = ""
        self._signer: Ed25519PublicKey | None = None
        # The Redis version whose set did not verify, said once.
        self._refused: bytes | None = None
        # ``sidecar.shared_limits.key_signer``: the one key sets are checked with, whatever
        # billing or a kept copy names.
        self._pinned = False
        self._said_mismatch = False
        # When billing last answered (monotonic; -inf: never): ``CONFIRM_SECONDS``.
        self._confirmed_at = float("-inf")
        if pinned_signer:
            self._learn(pinned_signer)
            self._pinned = bool(self._signer_hex)
        if redis is not None and not (self.url and token) and not self._pinned:
            log.warning(
                "issued keys: Redis is configured but billing cannot be asked (no billing URL "
                "or spend_reader token), so billing's signing key is learnt only from a copy "
                "kept on disk; without one, no set in Redis is taken"
            )

    @property
    def signer(self) -> Ed25519PublicKey | None:
        """Billing's signing key, None until one is known.

        Made from its hex on first use: ``cryptography`` costs a process about 8 MB, and only a
        sidecar reading sets from Redis checks one (``infermeter.key_set_seal``).
        """
        if self._signer is None and self._signer_hex:
            self._signer = signer_of(self._signer_hex)
        return self._signer

    @property
    def enabled(self) -> bool:
        """Whether there is a source to ask: Redis, or billing with the spend_reader token."""
        return self.redis is not None or (self.url is not None and self.token is not None)

    def load(self) -> IssuedKeys | None:
        """The set kept on disk by an earlier run (None: none, or not readable), applied."""
        try:
            data = orjson.loads(self.path.read_bytes())
            found = IssuedKeys.from_json(data)
        except FileNotFoundError:
            return None
        except (OSError, orjson.JSONDecodeError, KeyRequestError) as exc:
            log.error(
                "%s: the issued keys kept here cannot be read (%s); waiting for billing",
                self.path,
                exc,
            )
            return None
        self._learn(str(data.get("signer") or ""))
        self._take(found)
        return found

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_seconds)

    async def poll(self) -> bool:
        """One round: True when a newer set was taken. Never raises for an unreachable source."""
        found = None
        reached: str | None = None  # the source that answered
        if self.redis is not None:
            from redis.exceptions import RedisError  # loaded with the Redis client already

            with contextlib.suppress(RedisError, OSError, ValueError):  # down: billing instead
                found = await self._from_redis()
                reached = "Redis"
        if self.url is not None and (reached is None or self._confirm_due()):
            import httpx  # only a sidecar that syncs loads it, as for shipping

            with contextlib.suppress(httpx.HTTPError, ValueError):
                answer = await self._from_billing()
                self._confirmed_at = time.monotonic()
                reached = reached or "billing"
                if answer is not None and (found is None or answer.version > found.version):
                    found = answer
        if reached is None:
            if not self._failing:
                log.warning(
                    "issued keys: neither Redis nor billing answers; serving the %s",
                    "last set read" if self.current else "configured keys only",
                )
            self._failing = True
            return False
        if self._failing:
            log.warning("issued keys: %s answers again", reached)
        self._failing = False
        if found is None or (self.current is not None and found.version <= self.current.version):
            return False
        self._take(found)
        await asyncio.to_thread(self._keep, found)
        return True

    def _confirm_due(self) -> bool:
        """Whether billing is to be asked although Redis answered: Redis may say "nothing newer"
        (or hold an older set billing signed) for as long as any pod holding its password
        writes it so, and a revocation would then never reach this sidecar."""
        return time.monotonic() - self._confirmed_at >= CONFIRM_SECONDS

    def _take(self, found: IssuedKeys) -> None:
        self.current = team_keys(found)
        self._apply(self.current)

    async def _from_redis(self) -> IssuedKeys | None:
        """The set in Redis when it is newer than ours; ValueError (ask billing instead) when
        it is newer but cannot be taken: no signing key known yet, or one it does not verify
        with."""
        assert self.redis is not None
        version = await self.redis.get(self.version_key)
        if version is None or (self.current is not None and int(version) <= self.current.version):
            return None
        if self.signer is None:
            raise ValueError("billing's signing key is not known yet")
        raw = await self.redis.get(self.set_key)
        if raw is None:
            return None
        try:
            return unseal(raw, self.signer)
        except KeyRequestError as exc:
            if version != self._refused:
                log.error(
                    "issued keys: the set in Redis (version %s) is not taken: %s; asking billing",
                    version.decode("ascii", "replace")[:20],
                    exc,
                )
                self._refused = version
            raise

    async def _from_billing(self) -> IssuedKeys | None:
        assert self.url is not None
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        if self.current is not None:
            headers["if-none-match"] = f'"{self.current.version}"'
        response = await self._client().get(self.url, headers=headers, timeout=5.0)
        if response.is_success or response.status_code == 304:
            self._learn(response.headers.get(SIGNER_HEADER, ""))
        if response.status_code == 304:
            return None
        response.raise_for_status()
        data: Any = orjson.loads(response.content)
        return IssuedKeys.from_json(data)

    def _learn(self, signer_hex: str) -> None:
        """Take the signing key billing named (an empty or malformed one changes nothing, and
        neither does any other once the configuration pins one)."""
        if signer_hex and signer_hex != self._signer_hex:
            if self._pinned:
                if not self._said_mismatch:
                    log.error(
                        "issued keys: billing names the signing key %s, the configuration "
                        "(sidecar.shared_limits.key_signer) %s; only sets signed with the "
                        "configured one are taken from Redis",
                        signer_hex[:16],
                        self._signer_hex[:16],
                    )
                    self._said_mismatch = True
                return
            if _is_signer(signer_hex):
                self._signer, self._signer_hex = None, signer_hex

    def _keep(self, found: IssuedKeys) -> None:
        """Keep ``found`` on disk for a start while billing is down (atomic replace), with the
        signing key, so that a sidecar started then can check what Redis holds."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_bytes(orjson.dumps(found.to_json() | {"signer": self._signer_hex}))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("%s: the issued keys cannot be kept on disk: %s", self.path, exc)


def _is_signer(value: str) -> bool:
    """Whether ``value`` names an Ed25519 public key: 32 bytes in hex, every one of which
    ``signer_of`` takes (the check without loading ``cryptography``)."""
    try:
        return len(bytes.fromhex(value)) == 32
    except ValueError:
        return False
