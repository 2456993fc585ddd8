"""Who may write to the ledger: one credential per writer, and the seal on every spool line.

Every process that ships records to billing holds a credential that names it, and may write only
as what it names:

==============  ============================================  ===================================
role            principal                                      writes
==============  ============================================  ===================================
``instance``    ``instance:<group>/<instance>[@<host:port>]``  usage, its lifetime events and
                                                               budget overrides, as that instance
                                                               of that replica group
``collector``   ``collector:<node>[,<node>...]``               GPU samples of those nodes, engine
                                                               samples of engines on them, and the
                                                               interrupted requests it recovers
                                                               from a gone sidecar's journal there
``autoscaler``  ``autoscaler:<name>``                          scaling decisions
``dashboard``   ``dashboard:<name>``                           audit events only (sign-ins)
==============  ============================================  ===================================

Every writer may also send its own audit events (``infermeter.audit_spool``), which billing keeps
under the writer's principal, on a route of their own (``POST /v1/ingest/audit``).

The key of a principal is derived from billing's secret, ``HMAC-SHA256(secret, "infermeter
writer key v1\\n" + principal)``, so billing needs no table of issued keys: it derives the key of
whatever principal a credential names and compares. Only whoever holds the secret can issue a
credential (billing, and whatever stands where the cluster would: ``infermeter demo`` and its
local scale hook; docs/security.md says how a Kubernetes pod gets its own). The credential is
one string, ``imw1:<principal>:<key, 64 hex digits>``, sent as the bearer token to billing.

An instance's ``host:port`` is where its sidecar serves ``/engine/metrics``: the only engine
address its lifetime events may carry, so an event cannot steer a collector's metrics token
anywhere else (``Writer.engine_metrics_url``).

The seal. Each spool line is the record's JSON with one more key at its end,
``"seal":"<principal>:<MAC>"``, where the MAC is the first 16 bytes (hex) of
``HMAC-SHA256(key, <the line without the seal>)``. One MAC per record, computed when the record is
appended, never per streamed chunk. A line changed on disk, or written by hand, no longer carries
a seal that verifies under the key of the principal it names, and billing quarantines it. The
bytes a seal covers are the record exactly as written (``orjson``'s output), so checking a seal
needs no JSON parser: ``open_line`` cuts the seal off the end.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

__all__ = [
    "CREDENTIAL_PREFIX",
    "DEMO_SECRET",
    "KINDS_BY_ROLE",
    "SEALED_NDJSON",
    "Credential",
    "Opened",
    "Role",
    "Sealer",
    "Writer",
    "WriterError",
    "WriterKeys",
    "credential_from",
    "credential_text",
    "derive_key",
    "issue",
    "open_line",
    "strip_seal",
]

CREDENTIAL_PREFIX: Final = "imw1:"
# The demo's writer secret: public, like the demo keys, so billing refuses it beyond loopback.
DEMO_SECRET: Final = b"im-demo-writer-secret"
# The media type of a batch billing must check line by line: the spool's lines as they are on
# disk, seals and all.
SEALED_NDJSON: Final = "application/vnd.infermeter.sealed-ndjson"
_KEY_CONTEXT: Final = b"infermeter writer key v1\n"
_SEAL_KEY: Final = b',"seal":"'
_MAC_BYTES: Final = 16
_KEY_HEX: Final = re.compile(r"[0-9a-f]{64}")
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
_INSTANCE: Final = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._:-]{0,251}[A-Za-z0-9])?")
_ADDRESS: Final = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})")
_MAX_PRINCIPAL: Final = 4096


class WriterError(ValueError):
    """A principal or credential that is not one; the message says which part is wrong."""


class Role(StrEnum):
    """What kind of process a writer is."""

    INSTANCE = "instance"
    COLLECTOR = "collector"
    AUTOSCALER = "autoscaler"
    DASHBOARD = "dashboard"


# The record kinds each role may write at all (billing checks the records themselves too).
KINDS_BY_ROLE: Final = {
    Role.INSTANCE: frozenset({"usage", "instances", "budget_overrides"}),
    Role.COLLECTOR: frozenset({"gpu_samples", "engine_samples", "usage"}),
    Role.AUTOSCALER: frozenset({"scaling_decisions"}),
    Role.DASHBOARD: frozenset(),
}


@dataclass(frozen=True, slots=True)
class Writer:
    """One writer: its role and what its principal names (the rest is None or empty)."""

    role: Role
    group: str | None = None
    instance: str | None = None
    address: str | None = None
    nodes: tuple[str, ...] = ()
    name: str | None = None

    @classmethod
    def for_instance(cls, group: str, instance: str, address: str | None = None) -> Writer:
        """An engine instance (its sidecar); ``address``: where its ``/engine/metrics`` is."""
        return cls.parse(f"instance:{group}/{instance}" + (f"@{address}" if address else ""))

    @classmethod
    def for_collector(cls, nodes: Iterable[str]) -> Writer:
        """A collector of ``nodes`` (sorted, each once)."""
        return cls.parse("collector:" + ",".join(sorted(set(nodes))))

    @classmethod
    def for_autoscaler(cls, name: str = "autoscaler") -> Writer:
        """The autoscaler called ``name``."""
        return cls.parse(f"autoscaler:{name}")

    @classmethod
    def for_dashboard(cls, name: str = "dashboard") -> Writer:
        """The dashboard called ``name`` (it writes its sign-ins to the audit trail)."""
        return cls.parse(f"dashboard:{name}")

    @classmethod
    def parse(cls, principal: str) -> Writer:
        """The writer ``principal`` names; WriterError saying what is wrong with it."""
        if len(principal) > _MAX_PRINCIPAL:
            raise WriterError(f"principal longer than {_MAX_PRINCIPAL} characters")
        role, _, rest = principal.partition(":")
        if role == Role.INSTANCE:
            return _instance(rest)
        if role == Role.COLLECTOR:
            nodes = tuple(rest.split(","))
            bad = [n for n in nodes if not _NAME.fullmatch(n)]
            if bad or len(set(nodes)) != len(nodes):
                raise WriterError(f"collector nodes {rest[:80]!r}: node names, each once")
            return cls(Role.COLLECTOR, nodes=nodes)
        if role in (Role.AUTOSCALER, Role.DASHBOARD):
            if not _NAME.fullmatch(rest):
                raise WriterError(f"{role} name {rest[:80]!r} is not a name")
            return cls(Role(role), name=rest)
        raise WriterError(f"role {role[:40]!r}: one of {', '.join(Role)}")

    @property
    def principal(self) -> str:
        """The writer's name as credentials and seals carry it."""
        if self.role is Role.INSTANCE:
            at = f"@{self.address}" if self.address else ""
            return f"instance:{self.group}/{self.instance}{at}"
        if self.role is Role.COLLECTOR:
            return "collector:" + ",".join(self.nodes)
        return f"{self.role}:{self.name}"

    @property
    def engine_metrics_url(self) -> str | None:
        """The one engine metrics URL an instance's events may name (None: none)."""
        return f"http://{self.address}/engine/metrics" if self.address else None

    def may_write(self, kind: str) -> bool:
        """Whether this role writes records of ``kind`` at all."""
        return kind in KINDS_BY_ROLE[self.role]


def _instance(rest: str) -> Writer:
    named, _, address = rest.partition("@")
    group, _, instance = named.rpartition("/")
    if not _NAME.fullmatch(group):
        raise WriterError(f"replica group {group[:80]!r} is not a name")
    if not _INSTANCE.fullmatch(instance):
        raise WriterError(f"instance {instance[:80]!r} is not an instance id")
    if "@" in rest and not _address_ok(address):
        raise WriterError(f"address {address[:80]!r}: host:port expected")
    return Writer(Role.INSTANCE, group=group, instance=instance, address=address or None)


def _address_ok(address: str) -> bool:
    found = _ADDRESS.fullmatch(address)
    return found is not None and 0 < int(found.group(2)) < 65536


def derive_key(secret: bytes, principal: str) -> bytes:
    """The 32-byte key of ``principal`` under billing's ``secret``."""
    return hmac.new(secret, _KEY_CONTEXT + principal.encode(), hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Credential:
    """A writer and its key: what a process is handed, as ``token`` (one string)."""

    writer: Writer
    key: bytes = field(repr=False)

    @property
    def token(self) -> str:
        """``imw1:<principal>:<key hex>``: the bearer token and the form it is handed over in."""
        return f"{CREDENTIAL_PREFIX}{self.writer.principal}:{self.key.hex()}"

    @classmethod
    def parse(cls, text: str) -> Credential:
        """The credential ``text`` holds; WriterError if it is not one (the key is never shown)."""
        if not text.startswith(CREDENTIAL_PREFIX):
            raise WriterError(f"a writer credential begins with {CREDENTIAL_PREFIX!r}")
        principal, _, key = text[len(CREDENTIAL_PREFIX) :].strip().rpartition(":")
        if not _KEY_HEX.fullmatch(key):
            raise WriterError("a writer credential ends with its key: 64 lower-case hex digits")
        return cls(Writer.parse(principal), bytes.fromhex(key))


def credential_text(environ: Mapping[str, str], variable: str) -> tuple[str, str]:
    """The credential handed over in ``variable``, or in the file ``<variable>_FILE`` names.

    Returns ``(text, where)``: the credential ("" when neither is set) and the name to quote in
    an error. A pod gets its credential as a file: an init container derives it before the
    process starts, and a variable cannot be filled from a file. WriterError when the file
    cannot be read.
    """
    raw = environ.get(variable, "").strip()
    if raw:
        return raw, variable
    path = environ.get(f"{variable}_FILE", "").strip()
    if not path:
        return "", variable
    where = f"{variable}_FILE={path}"
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read(_MAX_PRINCIPAL + 200).strip(), where
    except (OSError, UnicodeDecodeError) as exc:
        raise WriterError(f"environment variable {where}: cannot read it: {exc}") from None


def credential_from(environ: Mapping[str, str], variable: str, role: Role) -> Credential | None:
    """The credential of a ``role`` writer in ``variable`` or its file (None when neither is set).

    WriterError naming the variable when it holds no credential, or one of another role.
    """
    raw, variable = credential_text(environ, variable)
    if not raw:
        return None
    try:
        credential = Credential.parse(raw)
    except WriterError as exc:
        raise WriterError(f"environment variable {variable}: {exc}") from None
    if credential.writer.role is not role:
        raise WriterError(
            f"environment variable {variable}: the credential of {credential.writer.principal}, "
            f"not of a {role}"
        )
    return credential


def issue(secret: bytes, writer: Writer) -> Credential:
    """The credential of ``writer`` under billing's ``secret``."""
    return Credential(writer, derive_key(secret, writer.principal))


def _mac(key: bytes, record: bytes) -> bytes:
    return binascii.hexlify(hmac.digest(key, record, "sha256")[:_MAC_BYTES])


class Sealer:
    """Seals the lines one writer appends to its spools (one HMAC per record)."""

    def __init__(self, credential: Credential) -> None:
        self.credential = credential
        self._key = credential.key
        self._head = _SEAL_KEY + credential.writer.principal.encode() + b":"

    def __call__(self, record: bytes) -> bytes:
        """``record`` (one JSON object, as orjson wrote it) with its seal as the last key."""
        return record[:-1] + self._head + _mac(self._key, record) + b'"}'

    def vouches(self, line: bytes) -> bytes | None:
        """The record of ``line`` without its seal when this writer sealed it; else None."""
        opened = open_line(line)
        if opened is None or opened.principal != self.credential.writer.principal:
            return None
        return (
            opened.record
            if hmac.compare_digest(opened.mac, _mac(self._key, opened.record))
            else None
        )


@dataclass(frozen=True, slots=True)
class Opened:
    """A sealed line taken apart: the record it covers, the principal it names, its MAC."""

    record: bytes
    principal: str
    mac: bytes


def open_line(line: bytes) -> Opened | None:
    """The parts of a sealed spool line; None when it carries no seal (whatever else it is)."""
    body = line[:-1] if line.endswith(b"\n") else line
    if not body.endswith(b'"}'):
        return None
    at = body.rfind(_SEAL_KEY)
    if at <= 0:
        return None
    seal = body[at + len(_SEAL_KEY) : -2]
    principal, colon, mac = seal.rpartition(b":")
    if not colon:
        return None
    try:
        text = principal.decode("ascii")
    except UnicodeDecodeError:
        return None
    return Opened(body[:at] + b"}", text, mac)


def strip_seal(line: bytes) -> bytes:
    """``line`` without its seal (unchanged when it has none), newline kept."""
    opened = open_line(line)
    if opened is None:
        return line
    return opened.record + (b"\n" if line.endswith(b"\n") else b"")


class WriterKeys:
    """Billing's side: the secret, the keys it derives, and the checks of tokens and seals."""

    def __init__(self, secret: bytes, cache_entries: int = 4096) -> None:
        if not secret:
            raise WriterError("the writer secret is empty")
        self._secret = secret
        self._cache: dict[str, bytes] = {}
        self._cache_entries = cache_entries

    def key(self, principal: str) -> bytes:
        """The key of ``principal`` (derived once, kept for the next thousand lines)."""
        found = self._cache.get(principal)
        if found is None:
            if len(self._cache) >= self._cache_entries:
                self._cache.clear()
            found = self._cache[principal] = derive_key(self._secret, principal)
        return found

    def authenticate(self, token: str) -> Writer:
        """The writer a bearer token is the credential of; WriterError when it is not one."""
        credential = Credential.parse(token)
        expected = self.key(credential.writer.principal)
        if not hmac.compare_digest(expected, credential.key):
            raise WriterError("a writer credential that billing did not issue")
        return credential.writer

    def check(self, line: bytes) -> tuple[Writer, bytes] | tuple[None, str]:
        """(writer, record) of a line whose seal verifies; (None, why not) otherwise."""
        opened = open_line(line)
        if opened is None:
            return None, "unsealed"
        try:
            writer = Writer.parse(opened.principal)
        except WriterError:
            return None, "bad_seal"
        if not hmac.compare_digest(opened.mac, _mac(self.key(opened.principal), opened.record)):
            return None, "bad_seal"
        return writer, opened.record
