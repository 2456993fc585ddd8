"""Signed-in sessions, held by the dashboard server: one door for the sign-in form and every callback.

A key is a bearer credential for billing. If the browser kept it and sent it with each data
callback, every callback would be a second sign-in form without the throttle: whoever is locked
out of the form could put any key in the session store and read, from a callback's answer,
whether billing took it. So only the sign-in form ever takes a key. Once billing has accepted
it, the server keeps it in a ``Session`` and the browser gets an opaque id (256 random bits),
which is all it stores and sends; a callback names a session, never a key, and finds nothing
for an id it was not given. While an address is locked out of sign-in (``dashboards.throttle``),
nothing from it is looked up at all: no key, no session.

An unknown id is not counted as a failed sign-in: it cannot be guessed, and every tab open
across a restart of the dashboard (sessions live in memory) would otherwise lock its own
address out. Bounded: at most ``max_sessions``, and one unused for ``idle_seconds`` is gone.
Past the bound, the least recently used session of the holder with the most goes first. The
holder is the credential, not the team: a key (by its SHA-256), or the person signed in with
single sign-on. One key signing in again and again ends its own sessions, never everyone else's,
and not its teammates' either: members of a team hold keys of their own.

A session ends with its key. Billing answering one of its reads with 401 (the key was revoked,
or has expired; for single sign-on, billing refused the ID token) ends it at once
(``refused``), and a session that knows when its key expires (``Session.expires_at``, from
billing's answer at sign-in, or the single sign-on session's end) ends then. Billing's 503 (it
cannot check an ID token while the identity provider's keys cannot be read) ends nothing. The
browser is told why, once (``ended``), at its next refresh, and is sent to the sign-in form
rather than shown billing's refusals until the session goes idle; ``on_end`` hears of each such
end once, for the audit trail.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from dashboards.throttle import SignInThrottle

__all__ = ["EXPIRED", "IDLE_SECONDS", "REFUSED", "Gate", "Session", "Sessions", "clean_key"]

# A session unused this long is over: a working day and then some.
IDLE_SECONDS: Final = 12 * 3600.0
# Why a session was ended for its user (``Sessions.ended``): billing refused its key or ID token
# (401), or the key's expiry (or the single sign-on session's end) came.
REFUSED: Final = "refused"
EXPIRED: Final = "expired"
# What a pasted key may carry around it: whitespace, and the invisible characters editors and
# chat tools add (zero-width spaces and joiners, the byte-order mark).
_AROUND = re.compile(r"^[\s\u200b\u200c\u200d\u2060\ufeff]+|[\s\u200b\u200c\u200d\u2060\ufeff]+$")


def clean_key(typed: str | None) -> str:
    """The key as typed or pasted, without what surrounds it ("" when nothing else is left)."""
    return _AROUND.sub("", typed or "")


@dataclass(frozen=True, slots=True)
class Session:
    """A signed-in caller: the key billing accepted and who billing said it is.

    ``expires_at`` (Unix time): when the session ends, however busy: the key's expiry, as
    billing told it at sign-in (None: the key does not expire). Signed in with single sign-on
    (``dashboards.oidc``), ``token`` is the person's ID token, ``person`` who they are, and
    ``expires_at`` the session's end.
    """

    token: str
    name: str
    team: str | None
    is_admin: bool
    person: str | None = None
    expires_at: float | None = None

    @property
    def holder(self) -> str:
        """Whose session this is, for the bound: the person signed in, else the key's SHA-256.

        Not the team: its members hold keys of their own (issued by its lead), and one of them
        signing in again and again must end that member's sessions, not a teammate's.
        """
        if self.person is not None:
            return f"person:{self.person}"
        return "key:" + hashlib.sha256(self.token.encode()).hexdigest()


class Sessions:
    """Every live session by its id, shared by the server's threads."""

    def __init__(
        self,
        idle_seconds: float = IDLE_SECONDS,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_end: Callable[[Session, str], None] | None = None,
    ) -> None:
        # Told of each session its key's refusal or expiry ended, and why (``REFUSED``,
        # ``EXPIRED``), once per session and outside the lock: the app's audit trail.
        self.on_end = on_end
        self.idle_seconds = idle_seconds
        self.max_sessions = max_sessions
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        # By id: the session, when it was last used, and its holder (computed once).
        self._by_id: OrderedDict[str, tuple[Session, float, str]] = OrderedDict()
        # Why each session that ``refused`` or its expiry ended was ended, and the session, kept
        # until the browser is told (at most ``max_sessions``, the oldest forgotten first).
        self._why: OrderedDict[str, tuple[str, Session]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def begin(self, session: Session) -> str:
        """Keep ``session``; the id the browser will name it by."""
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._by_id[sid] = (session, self._clock(), session.holder)
            while len(self._by_id) > self.max_sessions:
                self._evict()
        return sid

    def _evict(self) -> None:
        """Forget the least recently used session of the holder with the most (lock held).

        Not simply the least recently used: whoever holds a key could then sign in
        ``max_sessions`` times and sign every other user, the admin included, out. Not per team
        either: one member's sign-ins would then end the sessions of every member of the team.
        """
        held = Counter(holder for _, _, holder in self._by_id.values())
        most = max(held.values())
        oldest = next(sid for sid, (_, _, holder) in self._by_id.items() if held[holder] == most)
        del self._by_id[oldest]

    def get(self, sid: str) -> Session | None:
        """The session named ``sid``, if it lives; using it keeps it alive."""
        now = self._clock()
        gone: list[tuple[str, Session]] = []
        with self._lock:
            found = self._by_id.pop(sid, None)
            if found is None or now - found[1] > self.idle_seconds:
                return None
            if not self._expired(found[0]):
                self._by_id[sid] = (found[0], now, found[2])
                return found[0]
            gone.append(self._ended(sid, found[0], EXPIRED))  # popped above: forgotten too
        self._tell(gone)
        return None

    def refused(self, token: str) -> None:
        """Billing answered a read with ``token`` with 401: end every session signed in with it.

        A key's sessions, or a person's signed in with that ID token (billing answers 401 for
        an ID token only when it refuses the token; while it cannot read the identity
        provider's keys it answers 503, which ends nothing).
        """
        with self._lock:
            found = [(sid, s) for sid, (s, _, _) in self._by_id.items() if s.token == token]
            gone = []
            for sid, session in found:
                del self._by_id[sid]
                gone.append(self._ended(sid, session, REFUSED))
        self._tell(gone)

    def ended(self, sid: str) -> str | None:
        """Why the session ``sid`` was ended (``REFUSED``, ``EXPIRED``), said once; None while
        it lives, or when it ended otherwise (sign-out, idle, the bound) or was never begun."""
        found = self.ending(sid)
        return None if found is None else found[0]

    def ending(self, sid: str) -> tuple[str, Session] | None:
        """``ended``, with the session that was ended."""
        gone: list[tuple[str, Session]] = []
        with self._lock:
            found = self._by_id.get(sid)
            if found is not None and self._expired(found[0]):
                del self._by_id[sid]
                gone.append(self._ended(sid, found[0], EXPIRED))
            why = self._why.pop(sid, None)
        self._tell(gone)
        return why

    def _expired(self, session: Session) -> bool:
        return session.expires_at is not None and self._wall() >= session.expires_at

    def _ended(self, sid: str, session: Session, why: str) -> tuple[str, Session]:
        """Keep why ``sid`` ended until the browser asks (lock held); what ``on_end`` hears."""
        self._why[sid] = (why, session)
        while len(self._why) > self.max_sessions:
            self._why.popitem(last=False)
        return why, session

    def _tell(self, gone: list[tuple[str, Session]]) -> None:
        """Tell ``on_end`` of each session just ended (the lock released: it may write)."""
        if self.on_end is not None:
            for why, session in gone:
                self.on_end(session, why)

    def end(self, sid: str) -> None:
        """Forget ``sid`` (sign-out)."""
        with self._lock:
            self._by_id.pop(sid, None)
            self._why.pop(sid, None)


@dataclass(frozen=True, slots=True)
class Gate:
    """The sign-in throttle and the sessions, asked together by every callback."""

    throttle: SignInThrottle
    sessions: Sessions

    def session(self, auth: Any, address: str) -> Session | None:
        """The session the browser's store names, unless ``address`` is locked out."""
        sid = auth.get("session") if isinstance(auth, dict) else None
        if not isinstance(sid, str) or self.throttle.retry_after(address) > 0:
            return None
        return self.sessions.get(sid)
