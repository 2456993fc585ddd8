"""Records that cross processes: born in the sidecar or a collector, kept by billing.

This module is the single declaration of every record kind. Each is a frozen dataclass (a stage
can hand one on without fearing that the next one edits it), and everything else about a kind is
derived from it: the JSON spool lines (``to_json``), the Arrow wire schema (``infermeter.wire``),
the ledger's column list, its value checks and the defaults filled for absent keys
(``billing.ingest_sql``, ``billing.ledger``). Adding a field is one line here: give it a default,
so that records from shippers that do not know it yet, and rows already in a ledger, still read.

Times are Unix seconds. Field types are restricted to what JSON, Arrow and SQL all carry without
loss: ``str``, ``int``, ``float``, ``bool``, each optionally ``| None``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Final, Self

__all__ = [
    "BILLABLE_STATUSES",
    "BUDGET_OVERRIDES",
    "ENGINE",
    "FAILED_STATUSES",
    "GPU",
    "INSTANCES",
    "KINDS",
    "MAX_DECISION_REASONS",
    "MAX_ENGINE_COUNTER",
    "MAX_ENGINE_REQUESTS",
    "MAX_OVERRIDE_REASON",
    "MAX_SCALED_REPLICAS",
    "RESERVED",
    "SCALING_DECISIONS",
    "USAGE",
    "BudgetOverride",
    "EngineSample",
    "Field",
    "FieldType",
    "GpuSample",
    "InstanceEvent",
    "InstanceEventType",
    "RecordKind",
    "RequestStatus",
    "ScalingDecision",
    "UsageRecord",
    "record_kind",
]


class RequestStatus(StrEnum):
    """How a request ended, as far as the team that sent it is concerned."""

    OK = "ok"
    CLIENT_ABORTED = "client_aborted"
    UPSTREAM_ERROR = "upstream_error"
    BAD_REQUEST = "bad_request"
    REJECTED = "rejected"
    RATE_LIMITED = "rate_limited"
    UNAUTHORIZED = "unauthorized"
    # The sidecar ended it before vLLM did: killed while serving it (the record is made from the
    # admission journal when it starts again) or shut down with it still running past the drain.
    INTERRUPTED = "interrupted"


# Requests that reached the GPU: these are charged and counted; the rest are kept for audit. An
# interrupted request is charged like an upstream failure: the GPU computed its tokens for the
# team, and the ledger would otherwise disagree with the engines' own counters.
BILLABLE_STATUSES: Final = (
    RequestStatus.OK,
    RequestStatus.CLIENT_ABORTED,
    RequestStatus.UPSTREAM_ERROR,
    RequestStatus.INTERRUPTED,
)
# Billable requests that the platform, not the client, failed: the error ratio of the SLA.
FAILED_STATUSES: Final = (RequestStatus.UPSTREAM_ERROR, RequestStatus.INTERRUPTED)


class _Record:
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_json(self) -> dict[str, Any]:
        """A plain dict for JSON: the spool and wire format.

        Field by field rather than ``dataclasses.asdict``, whose deep copy took a third of the
        collector's CPU for 1,024 samples a round: every field is a scalar.
        """
        return {name: getattr(self, name) for name in _names(type(self))}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        """Rebuild a record from ``to_json``'s output; unknown keys are an error."""
        return cls(**data)


_NAMES: dict[type[Any], tuple[str, ...]] = {}


def _names(cls: type[Any]) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


@dataclass(frozen=True, slots=True)
class UsageRecord(_Record):
    """What one request used, written once by the sidecar that served it.

    ``request_id`` is the idempotency key of the whole pipeline: billing keeps the first record
    with a given id and ignores resends. ``status`` is a ``RequestStatus`` value.
    """

    request_id: str
    team: str
    model: str
    served_version: str
    replica: str
    received_at: float
    first_token_at: float | None
    finished_at: float
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    status: str
    http_status: int
    stream: bool
    endpoint: str = "/v1/chat/completions"
    finish_reason: str | None = None
    usage_exact: bool = True
    # The engine instance (pod) that served it; ``replica`` is then its replica group. None in
    # records from a fleet of fixed replicas, where each replica is its one instance.
    instance: str | None = None
    # The id vLLM gave its response (``chatcmpl-...``, ``cmpl-...``, the embeddings id), which
    # is what a user holds; None when no response came back.
    response_id: str | None = None
    # The caller's own ``x-request-id``, when it sent a valid one.
    client_request_id: str | None = None
    # A keyed digest of the prompt's head (the first message), never its text, and the share of
    # the prompt's characters it covers (``sidecar.prefix``); None when digests are off.
    prefix_digest: str | None = None
    prefix_share: float | None = None
    # Choices vLLM generated per prompt (the request's ``n``). The usage object counts each prompt
    # once, vLLM's ``vllm:prompt_tokens_total`` once per choice, so reconciliation counts
    # ``prompt_tokens x choices`` against the engine (``billing.reconciliation``).
    choices: int = 1
    # Attribution below the team: the end user the request named (OpenAI's ``user`` field) and
    # the project tag it carried (``X-Infermeter-Project``), checked by the sidecar; None when
    # it gave none. Never metric labels: there may be a great many.
    user: str | None = None
    project: str | None = None


@dataclass(frozen=True, slots=True)
class GpuSample(_Record):
    """One reading of one GPU (or MIG slice), joined to the replica that runs on it."""

    sample_id: str
    node: str
    gpu: str
    uuid: str
    gpu_model: str
    replica: str | None
    model: str | None
    timestamp: float
    interval_seconds: float
    utilization: float
    power_watts: float
    energy_joules: float | None
    memory_used_mib: float
    memory_free_mib: float
    xid_errors: int = 0
    mig_profile: str | None = None
    gap: bool = False
    # The instance (pod) running on the GPU, when known; ``replica`` is its replica group.
    instance: str | None = None
    # The part of the board this sample stands for, so a board counts once however it is cut:
    # 1 for a whole GPU, a MIG slice's compute share, 1/n of a board n pods share by time-slicing.
    # Billing counts interval_seconds x share as GPU time.
    share: float = 1.0


@dataclass(frozen=True, slots=True)
class EngineSample(_Record):
    """One reading of a vLLM engine's own state and counters."""

    sample_id: str
    replica: str
    model: str
    timestamp: float
    requests_running: float
    requests_waiting: float
    kv_cache_usage: float
    prompt_tokens_total: float
    generation_tokens_total: float
    prefix_cache_queries_total: float = 0.0
    prefix_cache_hits_total: float = 0.0
    preemptions_total: float = 0.0
    # The instance (pod) read; ``replica`` is its replica group. None: a fixed replica.
    instance: str | None = None
    # The engine's KV-cache capacity in tokens, as vLLM publishes it (``vllm:cache_config_info``:
    # GPU blocks x block size, summed over its engines). None: the page did not say.
    kv_cache_tokens: float | None = None
    # The node the engine runs on, as the collector found it: billing takes the sample only from
    # a collector whose credential covers that node. None: from a collector that did not say.
    node: str | None = None


# Requests running or waiting on one engine: no vLLM engine holds more, so a page saying more is
# broken or hostile (billing's ingest refuses such a sample, the autoscaler such a reading).
MAX_ENGINE_REQUESTS: Final = 1_000_000
# An engine's token and event counters: a trillion tokens a day for thirty years, exact in a
# double (billing's ingest refuses a sample past it, so the collector reads such a page as
# broken).
MAX_ENGINE_COUNTER: Final = 1e15


class InstanceEventType(StrEnum):
    """What an instance says about its own lifetime."""

    START = "start"
    HEARTBEAT = "heartbeat"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class InstanceEvent(_Record):
    """One running vLLM engine (an instance of a replica group) announcing itself.

    The sidecar in front of the engine writes ``start`` when it begins serving, a ``heartbeat``
    every ``sidecar.heartbeat_seconds`` and ``stop`` once drained, through the same spool and
    shipper as usage, so an instance's lifetime is as durable as its usage. ``started_at`` is
    repeated in every event: a lifetime can be opened from any one of them, whichever arrives
    first. An instance that stops heartbeating is closed by billing at its last event.
    """

    event_id: str
    instance: str
    replica: str
    model: str
    event: str
    timestamp: float
    started_at: float
    node: str
    gpu_model: str
    gpu_count: int
    # GPU UUIDs (or indices) the instance owns, comma-separated; "" when not known.
    gpus: str = ""
    namespace: str | None = None
    pod_uid: str | None = None
    # Where the collector reads this instance's engine metrics (the sidecar's /engine/metrics).
    engine_metrics_url: str | None = None


@dataclass(frozen=True, slots=True)
class BudgetOverride(_Record):
    """An admin's permission for a team to spend past its budget, as granted at one sidecar.

    Written to the sidecar's ``budget-overrides`` spool when the admin grants it and shipped as
    ``budget_overrides``, so the ledger answers who let which team past its budget, why and until
    when, long after the override itself has run out.
    """

    override_id: str
    team: str
    # The admin's words, at most ``MAX_OVERRIDE_REASON`` characters. Not ``reason``: ingest
    # names its own verdict column so (see ``RESERVED``).
    admin_reason: str
    until: float
    issued_at: float
    # The instance (sidecar) that took the admin's request.
    issued_by: str


# How long an override's reason may be, in characters: enough for a ticket and a sentence.
MAX_OVERRIDE_REASON: Final = 500


@dataclass(frozen=True, slots=True)
class ScalingDecision(_Record):
    """One change of a model's desired replica count, as the autoscaler decided it.

    Written to the autoscaler's spool when the policy's answer differs from the count it last
    asked for, and shipped as ``scaling_decisions``, so the ledger can say when the fleet was
    asked to grow or shrink and why, beside the instances that came and went.
    """

    decision_id: str
    model: str
    decided_at: float
    # The count asked for before (on the autoscaler's first decision: the replicas serving).
    previous: int
    # The replicas seen serving when it decided, and the count it asks for now.
    current: int
    desired: int
    # The policy's reasons, joined by "; ", at most ``MAX_DECISION_REASONS`` characters.
    reasons: str


# How long a decision's reasons may be, in characters: the policy writes a few short sentences.
MAX_DECISION_REASONS: Final = 1000
# A replica count beyond any fleet: a decision asking for more is not one the policy makes.
MAX_SCALED_REPLICAS: Final = 10_000


class FieldType(StrEnum):
    """A field's JSON type; each layer maps it to its own (Arrow, SQL, Polars) in one table."""

    STRING = "string"
    INT = "int"
    NUMBER = "number"
    BOOL = "bool"


_PYTHON_TYPES: Final[dict[object, FieldType]] = {
    str: FieldType.STRING,
    int: FieldType.INT,
    float: FieldType.NUMBER,
    bool: FieldType.BOOL,
}


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a record kind: its type, whether it may be null, and its default if any."""

    name: str
    type: FieldType
    nullable: bool = False
    has_default: bool = False
    default: str | int | float | bool | None = None

    @property
    def required(self) -> bool:
        """A record must carry this key: no default stands in for it."""
        return not self.has_default


@dataclass(frozen=True, slots=True)
class RecordKind:
    """A kind of record as it crosses processes: its wire name, ledger table, id and time fields."""

    key: str
    table: str
    record: type[Any]
    id_field: str
    time_field: str
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        """The field called ``name``; KeyError if the kind has none."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        """The field names, in declaration order (the column order everywhere)."""
        return tuple(f.name for f in self.fields)


# Columns billing's ingest adds beside a record's fields while checking a batch (the writer's,
# ``billing.trust_sql``), and the key a spool line's seal is written under (``infermeter.writers``).
RESERVED: Final = frozenset(
    {
        "item",
        "pos",
        "dup",
        "reason",
        "type_reason",
        "quarantine",
        "seal",
        "w_role",
        "w_principal",
        "w_group",
        "w_instance",
        "w_address",
        "w_nodes",
    }
)


def record_kind(
    record: type[Any], *, key: str, table: str, id_field: str, time_field: str
) -> RecordKind:
    """The kind of ``record`` (a dataclass), its fields read from the declaration.

    TypeError for a field whose type has no loss-free form in JSON, Arrow and SQL, for a name in
    ``RESERVED``, and for a default made by a factory (it could not be written into the ledger's column definition).
    """
    hints = typing.get_type_hints(record)
    fields = []
    for f in dataclasses.fields(record):
        if f.name in RESERVED:
            raise TypeError(f"{record.__name__}.{f.name}: the name is ingest's own column")
        ftype, nullable = _field_type(record.__name__, f.name, hints[f.name])
        if f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{record.__name__}.{f.name}: a default must be a plain value")
        has_default = f.default is not dataclasses.MISSING
        default = f.default if has_default else None
        fields.append(Field(f.name, ftype, nullable, has_default, default))  # type: ignore[arg-type]
    kind = RecordKind(key, table, record, id_field, time_field, tuple(fields))
    for name in (id_field, time_field):
        kind.field(name)
    return kind


def _field_type(record: str, name: str, hint: object) -> tuple[FieldType, bool]:
    args = typing.get_args(hint)
    nullable = isinstance(hint, types.UnionType) and type(None) in args
    if nullable:
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else hint
    if hint not in _PYTHON_TYPES:
        raise TypeError(f"{record}.{name}: {hint!r} is not str, int, float or bool (or | None)")
    return _PYTHON_TYPES[hint], nullable


USAGE: Final = record_kind(
    UsageRecord, key="usage", table="usage", id_field="request_id", time_field="received_at"
)
GPU: Final = record_kind(
    GpuSample, key="gpu_samples", table="gpu_samples", id_field="sample_id", time_field="timestamp"
)
ENGINE: Final = record_kind(
    EngineSample,
    key="engine_samples",
    table="engine_samples",
    id_field="sample_id",
    time_field="timestamp",
)
INSTANCES: Final = record_kind(
    InstanceEvent,
    key="instances",
    table="instance_events",
    id_field="event_id",
    time_field="timestamp",
)
BUDGET_OVERRIDES: Final = record_kind(
    BudgetOverride,
    key="budget_overrides",
    table="budget_overrides",
    id_field="override_id",
    time_field="issued_at",
)
SCALING_DECISIONS: Final = record_kind(
    ScalingDecision,
    key="scaling_decisions",
    table="scaling_decisions",
    id_field="decision_id",
    time_field="decided_at",
)
# Every kind that crosses a process, by its wire name (the ingest route and the JSON batch key).
KINDS: Final = {
    k.key: k for k in (USAGE, GPU, ENGINE, INSTANCES, BUDGET_OVERRIDES, SCALING_DECISIONS)
}
