"""A small Redis client for the admission hot path: RESP2 on one pipelined asyncio connection.

Why not redis-py here: its asyncio client spends most of an admission's added latency in Python
(connection checkout from a pool, command packing, reply dispatch, script-object bookkeeping), on
the core the sidecar shares with the relay. This client does only what shared admission needs:

- one persistent connection per client; every command is written as soon as it is called and
  its reply resolves the oldest waiting future (Redis answers in order), so concurrent callers
  pipeline on the one socket without a pool or a lock;
- commands packed and replies parsed by ``hiredis`` (C), never by Python;
- ``EVALSHA`` that loads the script (``SCRIPT LOAD``) and tries once more on ``NOSCRIPT``;
- a deadline per call: a call not answered within ``timeout_seconds`` raises ``TimeoutError``
  and drops the connection, which fails every other call waiting on it (a server that slow is
  treated as down) and leaves no late reply to be matched to the wrong caller;
- reconnection on the next call, with attempts spaced by an exponential backoff while they fail.

Errors: ``ConnectionError`` (an ``OSError``) when the connection is lost, ``TimeoutError`` past
the deadline, ``ReplyError`` (``NoScriptError``) when Redis answers with an error. After any of
those Redis may or may not have run the command. ``NotSent`` (a ``ConnectionError``) says it
cannot have: there was no connection, so the command was never written; a caller that must undo
what a lost command may have done (``sidecar.shared_limits``) needs that difference. Everything
off the hot path (budget overrides, fair-share state) keeps redis-py.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis

__all__ = [
    "Endpoint",
    "NoScriptError",
    "NotSent",
    "ReplyError",
    "RespClient",
    "Script",
    "parse_url",
]

Arg = str | bytes | int | float


class ReplyError(Exception):
    """Redis answered a command with an error reply; the message is Redis's own."""


class NoScriptError(ReplyError):
    """EVALSHA of a script the server does not hold (it restarted, or SCRIPT FLUSH ran)."""


class NotSent(ConnectionError):
    """No connection to Redis: the command was never written, so Redis cannot run it."""


def _reply_error(message: str) -> ReplyError:
    """The exception hiredis puts in place of an error reply."""
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return ReplyError(message)


@dataclass(frozen=True)
class Script:
    """A Lua script and its SHA1, the name ``EVALSHA`` calls it by."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


@dataclass(frozen=True)
class Endpoint:
    """Where Redis listens and how to log in."""

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    unix_path: str | None = None  # a Unix socket instead of host and port

    @property
    def where(self) -> str:
        """The address, for messages (never the login)."""
        return self.unix_path or f"{self.host}:{self.port}"


def parse_url(url: str, password: str | None = None) -> Endpoint:
    """A Redis URL as an Endpoint, in the forms redis-py reads.

    ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` for TLS, and
    ``unix://[[user]:password@]/path/to/socket[?db=N]``. ``password``, when given, wins over
    one in the URL (the sidecar reads it from the environment so that it is never written in
    the configuration). Messages name the scheme and the database, never the URL, which may
    hold a password.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"Redis URL with scheme {parts.scheme!r}: the scheme must be redis://, rediss:// or unix://"
        )
    user = unquote(parts.username) if parts.username else None
    password = password or (unquote(parts.password) if parts.password else None)
    if parts.scheme == "unix":
        db = parse_qs(parts.query).get("db", ["0"])[0]
        if not db.isdigit():
            raise ValueError(f"Redis URL: db must be a database number, not {db!r}")
        return Endpoint(db=int(db), username=user, password=password, unix_path=parts.path)
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"Redis URL: the path must be a database number, not {path!r}")
    return Endpoint(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 6379,
        db=int(path) if path else 0,
        username=user,
        password=password,
        tls=parts.scheme == "rediss",
    )


def _pack(parts: Sequence[Arg]) -> bytes:
    """One command as RESP, packed in C."""
    # hiredis's stub types the argument as a 1-tuple; any tuple of arguments is what it takes.
    return cast("bytes", hiredis.pack_command(tuple(parts)))  # type: ignore[arg-type]


_MORE = object()  # hiredis's answer when the buffer holds no complete reply yet


class _Connection(asyncio.Protocol):
    """One socket to Redis: each reply resolves the oldest waiting future.

    The deadlines are kept by one timer per connection, not one per call: calls are answered in
    order, so only the oldest unanswered call can be late, and a timer armed and cancelled per
    call would cost more than the rest of the call (on the loop's heap of timers).
    """

    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds
        self.reader = hiredis.Reader(replyError=_reply_error, notEnoughData=_MORE)
        # Each call's future and the loop time its reply is due by, oldest first.
        self.waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; uvloop's is not an ``asyncio.Transport`` subclass.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.abort(ConnectionError, f"Redis sent a reply that is not RESP: {exc}")
                return
            if reply is _MORE:
                return
            if not self.waiting:
                self.abort(ConnectionError, "Redis sent a reply to no command")
                return
            future, _ = self.waiting.popleft()
            if future.done():  # its caller gave up (cancelled); the reply is not theirs to get
                continue
            if isinstance(reply, ReplyError):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError, f"connection to Redis lost: {exc or 'closed by the server'}")

    def usable(self) -> bool:
        """Open, and not already being closed (writes to a closing socket would be dropped)."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def send(self, payloads: Sequence[bytes]) -> list[asyncio.Future[Any]]:
        """Write the commands in one system call; their futures, in order."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        due = loop.time() + self.timeout_seconds
        futures = [loop.create_future() for _ in payloads]
        self.waiting.extend((f, due) for f in futures)
        self.transport.write(payloads[0] if len(payloads) == 1 else b"".join(payloads))
        if self._watchdog is None:
            self._watchdog = loop.call_at(due, self._check_deadline)
        return futures

    def _check_deadline(self) -> None:
        """Drop the connection if its oldest unanswered call is past due; else look again then."""
        self._watchdog = None
        if self.closed or not self.waiting:
            return
        loop = asyncio.get_running_loop()
        due = self.waiting[0][1]
        if loop.time() >= due:
            ms = self.timeout_seconds * 1000
            self.abort(TimeoutError, f"Redis did not answer within {ms:g} ms")
        else:
            self._watchdog = loop.call_at(due, self._check_deadline)

    def fail(self, kind: type[Exception], message: str) -> None:
        """Mark the connection unusable and fail every call still waiting on it.

        One exception per call: an instance raised in many tasks would pile up their tracebacks.
        """
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(kind(message))

    def abort(self, kind: type[Exception], message: str) -> None:
        """Drop the connection now: waiting calls fail with ``kind(message)``."""
        self.fail(kind, message)
        if self.transport is not None:
            self.transport.abort()


class RespClient:
    """Pipelined Redis commands on one connection, opened on first use and reopened after loss."""

    def __init__(
        self,
        endpoint: Endpoint,
        timeout_seconds: float,
        min_backoff_seconds: float = 0.05,
        max_backoff_seconds: float = 1.0,
    ) -> None:
        """``timeout_seconds`` bounds every call, connecting included; failed connection
        attempts are spaced from ``min_backoff_seconds``, doubling up to ``max_backoff_seconds``.
        """
        self.endpoint = endpoint
        self.timeout_seconds = timeout_seconds
        self.min_backoff_seconds = min_backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self._backoff = 0.0
        self._next_attempt = 0.0
        self._closed = False

    async def call(self, *parts: Arg) -> Any:
        """Send one command and return its reply (``ReplyError`` for an error reply)."""
        conn = self._conn
        if conn is None or not conn.usable():
            conn = await self._connected()
        (future,) = conn.send((_pack(parts),))
        return await future

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """Send the commands in one write; their replies in order, an error reply in its place.

        Only a lost connection or the deadline raises (for all of them).
        """
        if not commands:
            return []
        conn = self._conn
        if conn is None or not conn.usable():
            conn = await self._connected()
        futures = conn.send([_pack(c) for c in commands])
        done = await asyncio.gather(*futures, return_exceptions=True)
        for reply in done:
            if isinstance(reply, (OSError, TimeoutError)):
                raise reply
        return list(done)

    async def evalsha(self, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run ``script`` by its SHA; load it and run it again when Redis does not hold it."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.load(script)
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)

    async def load(self, script: Script) -> None:
        """``SCRIPT LOAD`` the script (after a restart or a flush)."""
        await self.call("SCRIPT", "LOAD", script.source)

    async def close(self) -> None:
        """Close the connection; calls waiting on it fail with ``ConnectionError``."""
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None:
            self._conn.abort(ConnectionError, "the Redis client was closed")
            self._conn = None
        # The transport closes on the next loop turn; let it, so nothing is left to the GC.
        await asyncio.sleep(0)

    # -- connection ------------------------------------------------------------------------------

    async def _connected(self) -> _Connection:
        """The open connection: the one being opened, or a new one when attempts are due."""
        if self._closed:
            raise NotSent("the Redis client was closed")
        if self._connecting is None:
            wait = self._next_attempt - time.monotonic()
            if wait > 0:
                raise NotSent(
                    f"Redis at {self.endpoint.where} is unreachable; "
                    f"next attempt in {wait * 1000:.0f} ms"
                )
            self._connecting = asyncio.get_running_loop().create_task(self._open())
            # Retrieved here so a failure nobody awaits any more is not reported as lost.
            self._connecting.add_done_callback(lambda t: t.cancelled() or t.exception())
        # Shielded: a caller cancelled while connecting must not cancel it for the others.
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Connection:
        ep = self.endpoint
        loop = asyncio.get_running_loop()
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.timeout_seconds):
                conn = await self._dial(loop)
                login: list[tuple[Arg, ...]] = []
                if ep.password is not None:
                    login.append(
                        ("AUTH", ep.username, ep.password) if ep.username else ("AUTH", ep.password)
                    )
                if ep.db:
                    login.append(("SELECT", ep.db))
                if login:  # an error reply (a wrong password) raises ReplyError here
                    await asyncio.gather(*conn.send([_pack(c) for c in login]))
        except (OSError, TimeoutError, ReplyError) as exc:
            if conn is not None:
                conn.abort(ConnectionError, "login to Redis failed")
            self._backoff = min(
                self.max_backoff_seconds, max(self.min_backoff_seconds, self._backoff * 2)
            )
            self._next_attempt = time.monotonic() + self._backoff
            raise NotSent(
                f"cannot connect to Redis at {ep.where}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self._connecting = None
        self._backoff = 0.0
        self._conn = conn
        return conn

    async def _dial(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        """A new connection to the endpoint, not yet logged in."""
        ep = self.endpoint
        if ep.unix_path is not None:
            _, conn = await loop.create_unix_connection(
                lambda: _Connection(self.timeout_seconds), ep.unix_path
            )
        else:
            tls = ssl.create_default_context() if ep.tls else None
            _, conn = await loop.create_connection(
                lambda: _Connection(self.timeout_seconds), ep.host, ep.port, ssl=tls
            )
        return conn
