"""The simulated instances running on this machine: one small JSON file, the processes' contract.

The autoscaler's local scale hook starts and stops simulated instances of replica groups; the
dcgm-exporter stand-in must show their GPUs and the traffic generator must reach their sidecars.
Those are separate processes in separate packages, so they meet here, in a file
(``simulator.instances_file``) the hook replaces whole at every change and the readers re-read.

Shape::

    {"instances": [{"instance": "vllm-small-0-1", "replica": "small-0", "model": "chat-small",
                    "node": "node-b", "gpus": [2], "namespace": "local",
                    "upstream_url": "http://127.0.0.1:40123", "sidecar_url": "http://127.0.0.1:40124",
                    "started_at": 1764578700.2, "stopped_at": null, "usage": null,
                    "draining": false}],
     "stopped": [... the same, with stopped_at and the simulator's last figures in usage ...]}

An instance being stopped stays in ``instances`` with ``draining`` true until its processes have
ended, as a terminating pod leaves its Service's endpoints but keeps its GPUs: readers that send
it requests (the traffic, the front door) skip it, readers of its GPUs (the dcgm-exporter
stand-in) still see it.

A missing or unreadable file reads as no instances: the fixed fleet keeps working without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import orjson

from infermeter.atomic import write_atomically

__all__ = ["MAX_STOPPED", "LocalFleet", "LocalInstance", "read_fleet", "write_fleet"]

log = logging.getLogger("infermeter.local_fleet")

MAX_STOPPED: Final = 200  # the file stays small however long the demo runs


@dataclass(frozen=True)
class LocalInstance:
    """One simulated instance: who it is, where its GPUs are, and where it listens."""

    instance: str
    replica: str
    model: str
    node: str
    gpus: tuple[int, ...]
    namespace: str
    upstream_url: str
    sidecar_url: str | None
    started_at: float
    stopped_at: float | None = None
    usage: dict[str, float] | None = None
    # Being stopped: sent no new requests, its GPUs still its own (the module docstring).
    draining: bool = False

    def stopped(self, at: float, usage: dict[str, float] | None) -> LocalInstance:
        """This instance, stopped at ``at`` with the simulator's last figures."""
        return replace(self, stopped_at=at, usage=usage, draining=False)


@dataclass(frozen=True)
class LocalFleet:
    """The live instances and the most recently stopped ones."""

    instances: tuple[LocalInstance, ...] = ()
    stopped: tuple[LocalInstance, ...] = field(default=())


def _instance(row: Any) -> LocalInstance:
    row = dict(row)
    row["gpus"] = tuple(int(g) for g in row["gpus"])
    return LocalInstance(**row)


def read_fleet(path: Path) -> LocalFleet:
    """The file's fleet; an absent or unreadable file is an empty fleet."""
    try:
        data = orjson.loads(path.read_bytes())
        return LocalFleet(
            tuple(_instance(r) for r in data.get("instances", [])),
            tuple(_instance(r) for r in data.get("stopped", [])),
        )
    except FileNotFoundError:
        return LocalFleet()
    except (
        OSError,
        orjson.JSONDecodeError,
        AttributeError,
        KeyError,
        TypeError,
        ValueError,
    ) as exc:
        log.warning("ignoring the local instances file %s: %s", path, exc)
        return LocalFleet()


def write_fleet(
    path: Path, instances: Sequence[LocalInstance], stopped: Sequence[LocalInstance]
) -> None:
    """Replace the file with these instances (the newest ``MAX_STOPPED`` stopped ones kept)."""
    data = {
        "instances": [asdict(i) for i in instances],
        "stopped": [asdict(i) for i in list(stopped)[-MAX_STOPPED:]],
    }
    write_atomically(path, orjson.dumps(data))
