"""The ground-truth log: what really happened in a simulated fleet, for tests to hold billing to.

Every part of infermeter is checked in its own tests; whether the assembled product tells a user
what really happened can only be checked against a record of what really happened that none of
its parts wrote. The simulator is the one place that knows: its engines know every token they
computed (including the tail a client's hang-up cut off before the sidecar saw it), its boards
know every joule, and its dcgm-exporter stand-in knows which pod held each board at each moment.

With ``simulator.truth_dir`` set, each simulator process appends JSON lines to its own file in
that directory (``<role>-<name>-<pid>.jsonl``), one ``write(2)`` per line so a line is whole even
if the process is killed. With it unset nothing is opened and nothing is written: the only cost
is one ``is None`` test per request. The scenario's clients add their side (what each request
was, which team sent it, what the client received) with the same writer.

Kinds of lines (``k``), all times Unix seconds:

``instance``  an engine process began (``event: start``) or ended cleanly (``stop``):
              ``instance``, ``replica``, ``model``, ``gpu_count``, ``t``, ``pid``
``request``   one request as the engine saw it, written when it ended: ``instance``,
              ``request_id`` (the caller's ``x-request-id``, as vLLM takes it), ``response_id``,
              ``endpoint``, ``stream``, ``n``, ``arrived``, ``first_token``, ``ended``,
              ``prompt_tokens`` (per sequence, as the engine's counter took them: 0 for a
              sequence aborted before it was admitted), ``cached_tokens`` and
              ``completion_tokens`` (per sequence: tokens actually generated), ``aborted``
``board``     one board once a second from the node's dcgm-exporter stand-in: ``node``,
              ``index``, ``uuid``, ``gpu_model``, ``holder`` (the instance it is lent to or the
              fixed replica that owns it; null when spare), ``replica`` (the holder's group),
              ``t``, ``energy_j`` and ``busy_s`` (the board's counters since the stand-in began)
``client``    one request as its client saw it: ``request_id``, ``team``, ``model``,
              ``target``, ``stream``, ``n``, ``sent``, ``ended``, ``status``, ``complete``
              (the whole answer arrived), ``received_tokens`` (token chunks read, or the usage
              of a whole body), ``usage`` (the usage object received, if any), ``hung_up``
              (the client closed early on purpose), ``error``
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

__all__ = ["Truth", "TruthWriter", "open_truth", "read_truth"]

KINDS = ("instance", "request", "board", "client")


class TruthWriter:
    """Appends ground-truth lines to one file, each with a single ``write(2)``."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        self.path = directory / f"{safe}-{os.getpid()}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, kind: str, fields: Mapping[str, Any]) -> None:
        """Append one line of ``kind``; a full disk is ignored (the log is for tests only)."""
        line = orjson.dumps({"k": kind, **fields}, option=orjson.OPT_APPEND_NEWLINE)
        with contextlib.suppress(OSError):
            os.write(self._fd, line)

    def close(self) -> None:
        """Close the file; later writes are dropped."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_truth(truth_dir: str, name: str) -> TruthWriter | None:
    """A writer in ``truth_dir`` for process ``name``, or None when the log is off."""
    return TruthWriter(Path(truth_dir), name) if truth_dir else None


@dataclass
class Truth:
    """Every line of a truth directory, by kind, in file then line order."""

    instances: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    boards: list[dict[str, Any]] = field(default_factory=list)
    clients: list[dict[str, Any]] = field(default_factory=list)


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    for raw in path.read_bytes().splitlines():
        # A line cut by a kill holds no fact: it is skipped, every other line is kept.
        with contextlib.suppress(orjson.JSONDecodeError):
            row = orjson.loads(raw)
            if isinstance(row, dict):
                yield row


def read_truth(directory: Path) -> Truth:
    """Read every ``*.jsonl`` file of ``directory``."""
    truth = Truth()
    by_kind = {
        "instance": truth.instances,
        "request": truth.requests,
        "board": truth.boards,
        "client": truth.clients,
    }
    for path in sorted(directory.glob("*.jsonl")):
        for row in _lines(path):
            rows = by_kind.get(row.get("k", ""))
            if rows is not None:
                rows.append(row)
    return truth
