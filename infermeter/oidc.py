"""Single sign-on: who a person signed in with OpenID Connect is here, and checking their ID token.

The identity provider (IdP) says who a person is and which groups they are in; the configuration
(``dashboard.oidc.groups``) says what each group may do here: ``admin``, ``finance``, ``viewer``,
``lead:<team>`` or ``member:<team>``. ``caller_for_groups`` is that mapping, pure. A person in
several mapped groups gets the strongest role; one whose groups name two different teams is
refused rather than guessed, and so is one in no mapped group: an IdP account alone grants
nothing.

``IdTokens`` checks an ID token presented as a bearer (billing's read routes): its signature
against the issuer's published keys (JWKS, read once and again when a token names a key not
seen yet, at most every ``JWKS_REFRESH_SECONDS``), its issuer, its audience (the client id) and
its expiry. The JOSE work is joserfc's, the library authlib itself uses; nothing here parses a
JWT by hand. A token is refused (``AuthError``) only on its own account; when the keys it must be
checked against cannot be read (the provider unreachable, slow, answering an error, or publishing
something that is no key set), nothing is known of the token, and ``KeysUnavailable`` says so
instead: billing answers 503, not 401, and the caller asks again rather than taking the token
for revoked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, cast

import httpx
from joserfc import jwt
from joserfc.errors import InvalidKeyIdError, JoseError
from joserfc.jwk import KeySet, KeySetSerialization

from infermeter.auth import ADMIN, FINANCE, VIEWER, AuthError, Caller
from infermeter.config import OidcSettings

__all__ = [
    "ALGORITHMS",
    "JWKS_REFRESH_SECONDS",
    "RETRY_SECONDS",
    "WAIT_SECONDS",
    "IdTokens",
    "KeysUnavailable",
    "Unmapped",
    "caller_for_groups",
    "groups_of",
    "looks_like_jwt",
    "person_of",
]

log = logging.getLogger("infermeter.oidc")

# Asymmetric signatures only: an HMAC "signature" keyed with something public proves nothing.
ALGORITHMS: Final = ("RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA")
# After the keys could not be read, they are not tried again for this long: the tokens that
# come meanwhile are answered at once (KeysUnavailable), where each waited its own turn at the
# lock and then its own attempt on a provider that does not answer (up to two 5 s reads each),
# so a burst of tokens, anyone's, held billing's threads for as long as the outage lasted.
RETRY_SECONDS: Final = 2.0
# How long a token that needs the keys read waits for another token's read of them under way.
WAIT_SECONDS: Final = 1.0
# A token naming an unknown key refetches the keys, but not more often than this.
JWKS_REFRESH_SECONDS: Final = 30.0
# Clock skew allowed between the IdP and this host.
LEEWAY_SECONDS: Final = 60
_RANK: Final = {"admin": 0, "finance": 1, "viewer": 2, "lead": 3, "member": 4}
_ROLE_NAMES: Final = {"admin": ADMIN, "finance": FINANCE, "viewer": VIEWER}


class KeysUnavailable(Exception):
    """The issuer's keys cannot be read, so no ID token can be checked now (not an ``AuthError``:
    the token may be good, and asking again once the provider answers may succeed)."""


class Unmapped(AuthError):
    """A person the IdP vouches for whose groups give no role here (or two different teams)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "unmapped_groups")


def groups_of(claims: Mapping[str, Any], claim: str) -> list[str]:
    """The groups ``claims[claim]`` names: a list of strings, or one string (some IdPs send that)."""
    value = claims.get(claim)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [g for g in value if isinstance(g, str)]
    return []


def person_of(claims: Mapping[str, Any]) -> str:
    """Who signed in, as the audit trail names them: their e-mail, user name, or subject."""
    for name in ("email", "preferred_username", "sub"):
        value = claims.get(name)
        if isinstance(value, str) and value:
            return value
    return "unknown"


def caller_for_groups(groups: Iterable[str], mapping: Mapping[str, str], person: str) -> Caller:
    """The caller a person in ``groups`` is; Unmapped when no group is mapped, or two teams are."""
    groups = list(groups)
    roles = sorted(
        {mapping[g] for g in groups if g in mapping}, key=lambda r: _RANK[r.split(":")[0]]
    )
    if not roles:
        shown = ", ".join(sorted(groups)[:10]) or "none"
        raise Unmapped(f"none of your groups ({shown}) is given a role here; ask an admin")
    kind, _, team = roles[0].partition(":")
    if not team:
        return Caller(_ROLE_NAMES[kind], person=person)
    teams = sorted({r.partition(":")[2] for r in roles})
    if len(teams) > 1:
        raise Unmapped(f"your groups name more than one team ({', '.join(teams)}); ask an admin")
    return Caller(team, lead=kind == "lead", person=person)


def looks_like_jwt(credential: str) -> bool:
    """Whether ``credential`` has a JWT's shape (three base64url parts), not an API key's."""
    return credential.startswith("eyJ") and credential.count(".") == 2


def _get_json(url: str) -> dict[str, Any]:
    """GET ``url`` as JSON (the IdP's discovery document and keys)."""
    response = httpx.get(url, timeout=5.0, follow_redirects=False)
    response.raise_for_status()
    found: dict[str, Any] = response.json()
    return found


class IdTokens:
    """Checks ID tokens from the configured issuer and makes each a ``Caller``.

    ``fetch`` reads a URL as JSON (the discovery document, the keys); ``clock`` is Unix time.
    """

    def __init__(
        self,
        settings: OidcSettings,
        fetch: Callable[[str], dict[str, Any]] = _get_json,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: KeySet | None = None
        self._fetched_at = float("-inf")
        # Whether the last read of the keys failed (said in the log once, not per token), and
        # when (none is tried again for ``RETRY_SECONDS``).
        self._failing = False
        self._failed_at = float("-inf")

    def caller(self, token: str) -> Caller:
        """The caller ``token`` makes; AuthError when it is forged, stale, for another client or
        issuer, or its groups give no role here (Unmapped); KeysUnavailable when the issuer's
        keys, needed to tell, cannot be read."""
        claims = self.claims(token)
        s = self.settings
        return caller_for_groups(groups_of(claims, s.groups_claim), s.groups, person_of(claims))

    def claims(self, token: str) -> dict[str, Any]:
        """The token's claims once its signature, issuer, audience and expiry are checked
        (KeysUnavailable, not AuthError, when the keys to check it against cannot be read)."""
        try:
            try:
                decoded = jwt.decode(token, self._key_set(force=False), algorithms=ALGORITHMS)
            except InvalidKeyIdError:
                decoded = jwt.decode(token, self._key_set(force=True), algorithms=ALGORITHMS)
            s = self.settings
            jwt.JWTClaimsRegistry(
                now=lambda: int(self._clock()),
                leeway=LEEWAY_SECONDS,
                iss={"essential": True, "value": s.issuer.rstrip("/")},
                aud={"essential": True, "value": s.client_id},
                exp={"essential": True},
                sub={"essential": True},
            ).validate(decoded.claims)
        except (JoseError, ValueError) as exc:
            raise AuthError(f"ID token refused: {exc}") from None
        return dict(decoded.claims)

    def _key_set(self, force: bool) -> KeySet:
        """The issuer's keys, read when first needed or (``force``) when a token names a new one;
        KeysUnavailable when they cannot be read then, or could not be less than
        ``RETRY_SECONDS`` ago, or another token's read of them is still under way after
        ``WAIT_SECONDS`` (the keys held before stay held).

        Keys held are handed out without the lock: a read under way (up to two 5 s requests to
        a slow provider) holds up no token the held keys can check.
        """
        keys = self._keys
        if keys is not None and not force:
            return keys
        if not self._lock.acquire(timeout=WAIT_SECONDS):
            raise KeysUnavailable(
                "the identity provider's keys cannot be read (another read has waited on it "
                f"over {WAIT_SECONDS:g} s); ID tokens cannot be checked until it answers"
            )
        try:
            return self._read_keys(force)
        finally:
            self._lock.release()

    def _read_keys(self, force: bool) -> KeySet:
        """``_key_set`` with the lock held."""
        now = self._clock()
        stale = force and now - self._fetched_at >= JWKS_REFRESH_SECONDS
        if self._keys is not None and not stale:
            return self._keys
        if now - self._failed_at < RETRY_SECONDS:
            raise KeysUnavailable(
                "the identity provider's keys cannot be read (tried "
                f"{now - self._failed_at:.1f} s ago); ID tokens cannot be checked until it answers"
            )
        try:
            base = self.settings.issuer.rstrip("/")
            meta = self._fetch(f"{base}/.well-known/openid-configuration")
            jwks = self._fetch(str(meta["jwks_uri"]))
            keys = KeySet.import_key_set(cast(KeySetSerialization, jwks))
        except (httpx.HTTPError, JoseError, KeyError, TypeError, ValueError) as exc:
            if not self._failing:
                log.error("the identity provider's keys cannot be read: %s", exc)
            # (When the read ended, not began: the tokens that waited for it at the lock are
            # then answered at once.)
            self._failing, self._failed_at = True, self._clock()
            raise KeysUnavailable(
                f"the identity provider's keys cannot be read ({type(exc).__name__}); "
                "ID tokens cannot be checked until it answers"
            ) from None
        if self._failing:
            log.warning("the identity provider's keys are read again")
        self._failing = False
        self._keys, self._fetched_at = keys, now
        return keys
