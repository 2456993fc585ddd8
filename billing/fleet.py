"""The fleet as it is now: per replica group its live instances, per model what the autoscaler asked.

Two sources meet here, both kept by ingest: the instance lifetimes (``billing.lifetimes``: which
engines are live, where, on which GPUs) and the autoscaler's decisions (``scaling_decisions``:
each change of a model's desired replica count, with its reasons). The policy decides per model
and a model may be served by several replica groups, so the desired count and the last decision
belong to the model; each group names its model.

The builders return SQL and its parameters, and ``fleet_view`` assembles the answer from plain
rows; neither touches a connection (``billing.routes.fleet`` runs them), so both are tested on
their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

from infermeter.config import Config

__all__ = [
    "DECISION_COLUMNS",
    "MAX_DECISIONS",
    "Decision",
    "FleetView",
    "Group",
    "Instance",
    "ModelFleet",
    "asked_sql",
    "fleet_view",
    "latest_decisions_sql",
    "recent_decisions_sql",
]

# At most this many recent decisions in one answer: enough to mark every change of a day on a
# chart (the policy changes a model at most once per cool-down), bounded whatever the range.
MAX_DECISIONS: Final = 1000
DECISION_COLUMNS: Final = ("model", "decided_at", "previous", "current", "desired", "reasons")

_ORDER = "decided_at DESC, decision_id DESC"


def latest_decisions_sql() -> str:
    """Each model's latest decision, whenever it was made (``DECISION_COLUMNS``)."""
    columns = ", ".join(DECISION_COLUMNS)
    return f"""
SELECT {columns} FROM scaling_decisions
QUALIFY row_number() OVER (PARTITION BY model ORDER BY {_ORDER}) = 1
ORDER BY model"""


def asked_sql(since: float) -> tuple[str, dict[str, Any]]:
    """Per model the most replicas the autoscaler asked for lately (model, asked).

    Its latest desired count, whenever decided, or more when a decision since ``since`` asked
    for more or scaled down from more (``previous``): those instances may still be draining.
    It bounds how many live instances the registry believes (``billing.lifetimes.LiveBound``).
    """
    sql = """
SELECT model, greatest(arg_max(desired, struct_pack(t := decided_at, id := decision_id)),
    coalesce(max(greatest(desired, previous)) FILTER (WHERE decided_at >= $since), 0)) AS asked
FROM scaling_decisions GROUP BY model"""
    return sql, {"since": float(since)}


def recent_decisions_sql(start: float, end: float, limit: int) -> tuple[str, dict[str, Any]]:
    """The decisions made in ``start``..``end``, newest first, at most ``limit`` of them."""
    columns = ", ".join(DECISION_COLUMNS)
    sql = f"""
SELECT {columns} FROM scaling_decisions
WHERE decided_at >= $start AND decided_at < $end
ORDER BY {_ORDER} LIMIT $limit"""
    return sql, {"start": float(start), "end": float(end), "limit": int(limit)}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class Decision(_Frozen):
    """One change of a model's desired replicas: when, from how many to how many, and why."""

    model: str
    decided_at: float
    previous: int
    # The replicas seen serving when it was decided.
    current: int
    desired: int
    reasons: str


class Instance(_Frozen):
    """A live instance of a replica group: where it runs and since when."""

    instance: str
    node: str
    gpu_model: str
    gpu_count: int
    gpus: list[str]
    started_at: float
    last_seen: float


class Group(_Frozen):
    """A replica group: the replicas the configuration lists and the instances live now."""

    replica: str
    model: str
    configured: int
    live: int
    instances: list[Instance]


class ModelFleet(_Frozen):
    """A model over all its groups, beside the autoscaler's latest word on it (None: none yet)."""

    model: str
    groups: list[str]
    configured: int
    live: int
    desired: int | None
    last_decision: Decision | None


class FleetView(_Frozen):
    """``GET /v1/fleet``: models, groups, and the recent decisions for charts."""

    as_of: float
    models: list[ModelFleet]
    groups: list[Group]
    # Newest first; ``decisions_truncated`` when the range held more than were sent.
    decisions: list[Decision]
    decisions_from: float
    decisions_to: float
    decisions_truncated: bool


def _instance(row: Mapping[str, Any]) -> Instance:
    gpus = [g for g in str(row.get("gpus") or "").split(",") if g]
    return Instance(
        instance=row["instance"],
        node=row["node"],
        gpu_model=row["gpu_model"],
        gpu_count=int(row["gpu_count"]),
        gpus=gpus,
        started_at=float(row["started_at"]),
        last_seen=float(row["last_seen"]),
    )


def _decision(row: Mapping[str, Any]) -> Decision:
    return Decision(**{k: row[k] for k in DECISION_COLUMNS})


def fleet_view(
    config: Config,
    live: Sequence[Mapping[str, Any]],
    latest: Sequence[Mapping[str, Any]],
    recent: Sequence[Mapping[str, Any]],
    window: tuple[float, float, bool],
    now: float,
) -> FleetView:
    """The fleet from the live lifetimes, each model's latest decision and the recent ones.

    ``live``: rows of ``billing.lifetimes.COLUMNS`` in the live state. ``window``: the range the
    recent decisions were read from and whether there were more. The configured groups and models
    come first, in the configuration's order; a group or model seen live that the configuration
    does not list (renamed, or removed since) follows, with nothing configured.
    """
    groups = _groups(config, live)
    last = {row["model"]: _decision(row) for row in latest}
    start, end, truncated = window
    return FleetView(
        as_of=now,
        models=_models(config, groups, last),
        groups=groups,
        decisions=[_decision(r) for r in recent],
        decisions_from=start,
        decisions_to=end,
        decisions_truncated=truncated,
    )


def _groups(config: Config, live: Sequence[Mapping[str, Any]]) -> list[Group]:
    # Each entry of ``replicas`` is one group with its one configured replica (ids are unique).
    found: dict[str, tuple[str, int, list[Instance]]] = {
        r.id: (r.model, 1, []) for r in config.replicas
    }
    for row in live:
        _, _, instances = found.setdefault(row["replica"], (row["model"], 0, []))
        instances.append(_instance(row))
    return [
        Group(replica=g, model=m, configured=c, live=len(i), instances=sorted(i, key=_started))
        for g, (m, c, i) in found.items()
    ]


def _models(
    config: Config, groups: Sequence[Group], last: Mapping[str, Decision]
) -> list[ModelFleet]:
    members: dict[str, list[Group]] = {m.name: [] for m in config.models}
    for g in groups:
        members.setdefault(g.model, []).append(g)
    return [
        ModelFleet(
            model=name,
            groups=[g.replica for g in mine],
            configured=sum(g.configured for g in mine),
            live=sum(g.live for g in mine),
            desired=last[name].desired if name in last else None,
            last_decision=last.get(name),
        )
        for name, mine in members.items()
    ]


def _started(instance: Instance) -> tuple[float, str]:
    return instance.started_at, instance.instance
