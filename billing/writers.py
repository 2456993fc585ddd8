"""Who is writing to billing: the credential of an ingest request, and the seals of its lines.

An ingest request is sent by a writer (``infermeter.writers``: an instance, a collector, the
autoscaler), whose credential billing checks by deriving its key from the writer secret; the
records it sends are then checked against that writer (``billing.trust_sql``). The shared ingest
token of earlier releases is one credential for everything: it is taken only when the
configuration says so (``billing.shared_ingest_token``), and its records are checked against the
configuration only.

A batch of sealed lines (``SEALED_NDJSON``: a spool's lines as they are on disk, which a shipper
sends when it cannot vouch for every one itself) is opened here line by line: each line whose
seal verifies is the record of the writer the seal names, whoever forwarded it; a line without a
seal, or whose seal does not verify, is quarantined as it is (``billing.quarantine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from billing.ledger import IngestResult, Rejection
from billing.quarantine import Unopened
from infermeter.auth import (
    INGESTERS,
    AuthError,
    Forbidden,
    KeyRing,
    Unauthenticated,
    bearer_key,
    identify,
)
from infermeter.writers import CREDENTIAL_PREFIX, Writer, WriterError, WriterKeys

__all__ = ["Opened", "Sender", "WriterGate", "merge"]

_WHY = {
    "unsealed": "the line carries no seal",
    "bad_seal": "the line's seal does not verify (changed, or not written by its writer)",
}


@dataclass(frozen=True, slots=True)
class Sender:
    """Who sent an ingest request: a writer, or None for the shared ingest token."""

    writer: Writer | None


@dataclass(slots=True)
class Group:
    """The lines of one writer in a sealed batch: the records, and their places in the batch."""

    writer: Writer
    records: list[bytes] = field(default_factory=list)
    places: list[int] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        """The records as NDJSON."""
        return b"\n".join(self.records) + b"\n"


@dataclass(frozen=True, slots=True)
class Opened:
    """A sealed batch taken apart: the records per writer, and the lines that did not open."""

    groups: list[Group]
    unopened: list[Unopened]


class WriterGate:
    """Identifies ingest senders and opens sealed batches.

    ``keys``: derived from the writer secret (None: billing has none, and takes no writer
    credential); ``shared_token``: whether the shared ingest token is still taken.
    """

    def __init__(self, keys: WriterKeys | None, ring: KeyRing, shared_token: bool) -> None:
        self.keys = keys
        self.ring = ring
        self.shared_token = shared_token

    def sender(self, authorization: str | None) -> Sender:
        """The sender of a request; Unauthenticated (401) or Forbidden (403) when it may not ingest."""
        try:
            token = bearer_key(authorization)
        except AuthError as exc:
            raise Unauthenticated(str(exc)) from None
        if token.startswith(CREDENTIAL_PREFIX):
            if self.keys is None:
                raise Unauthenticated(
                    "billing holds no writer secret (billing.writer_secret_env), so it takes no "
                    "writer credential"
                )
            try:
                return Sender(self.keys.authenticate(token))
            except WriterError as exc:
                raise Unauthenticated(f"not a writer credential: {exc}") from None
        identify(self.ring, authorization).require(INGESTERS)
        if not self.shared_token:
            raise Forbidden(
                "the shared ingest token is not taken (billing.shared_ingest_token is false): "
                "each writer sends with its own credential (docs/security.md)"
            )
        return Sender(None)

    def open(self, body: bytes) -> Opened:
        """Each line of ``body`` as its writer's record, or unopened with the reason."""
        lines = body.split(b"\n")
        if body.endswith(b"\n"):
            lines.pop()
        groups: dict[str, Group] = {}
        unopened = []
        for pos, line in enumerate(lines, start=1):
            if self.keys is None:
                unopened.append(Unopened(pos, line, "bad_seal", "billing holds no writer secret"))
                continue
            writer, opened = self.keys.check(line)
            if writer is None:
                assert isinstance(opened, str)
                unopened.append(Unopened(pos, line, opened, _WHY[opened]))
                continue
            assert isinstance(opened, bytes)
            group = groups.setdefault(writer.principal, Group(writer))
            group.records.append(opened)
            group.places.append(pos)
        return Opened(list(groups.values()), unopened)


def merge(
    kind: str, parts: Sequence[tuple[IngestResult, Sequence[int]]], unopened: Sequence[Rejection]
) -> IngestResult:
    """One answer for a sealed batch from its writers' answers (each with the places of its
    records in the batch, so an id-less record's ``#<n>`` names its place in the whole batch)."""
    accepted = sum(r.accepted for r, _ in parts)
    duplicates = sum(r.duplicates for r, _ in parts)
    rejected = [_placed(x, places) for r, places in parts for x in r.rejected]
    quarantined = [_placed(x, places) for r, places in parts for x in r.quarantined]
    return IngestResult(kind, accepted, duplicates, rejected, [*quarantined, *unopened])


def _placed(rejection: Rejection, places: Sequence[int]) -> Rejection:
    rid = rejection.id
    if rid.startswith("#") and rid[1:].isdigit() and 0 < int(rid[1:]) <= len(places):
        return Rejection(f"#{places[int(rid[1:]) - 1]}", rejection.reason)
    return rejection
